"""The peer matrix (``benchmarks.matrix``): its cells, its goals computed from the cells' runs, and a real run of
every cell in a process of its own on a tiny model. No speed assertions."""

from __future__ import annotations

import json

import pytest

from benchmarks import matrix
from benchmarks.matrix import Cell


def test_the_plan_runs_offline_then_each_stream_count_per_shape_and_dtype():
    cells = matrix.plan(("a", "b"), ("bfloat16",), (1, 16))
    assert [c.name for c in cells] == ["a-bfloat16-offline", "a-bfloat16-c1", "a-bfloat16-c16",
                                       "b-bfloat16-offline", "b-bfloat16-c1", "b-bfloat16-c16"]
    args = Cell("llama-3b", "bfloat16", 16).args(("engine", "vllm"), 3, ["--quantization", "w8a8"])
    assert args[:2] == ["--shape", "llama-3b"] and args[args.index("--concurrency") + 1] == "16"
    assert args[args.index("--num-requests") + 1] == "32"  # twice the streams: the loop stays full
    assert args[args.index("--modes") + 1] == "concurrent" and args[-2:] == ["--quantization", "w8a8"]
    offline = Cell("default", "float32").args(("engine",), 1, [])
    assert "--shape" not in offline and offline[offline.index("--num-requests") + 1] == "12"
    assert offline[offline.index("--modes") + 1] == "offline" and "--concurrency" not in offline


def test_options_the_matrix_sets_or_the_benchmark_does_not_know_are_refused(capsys):
    for argv, message in ((["--streams", "0"], "at least one count"), (["--concurrency", "4"], "per cell"),
                          (["--conc", "8"], "--conc: the matrix sets"), (["--num-req=9"], "--num-req: the matrix sets"),
                          (["--systems", "vllm"], "must include engine"), (["--shapes", "nope"], "unknown shape"),
                          (["--shapes", ""], "at least one name"), (["--model", "/x"], "--shapes default"),
                          (["--no-such-option"], "--no-such-option: not an option"),
                          (["--stream", "4"], "--stream: not an option"),
                          (["--dtypes", "int4"], "invalid choice: 'int4'"), (["--publish", "Not_A_Name"], "lowercase"),
                          (["--systems", "engine,nope"], "nope")):
        with pytest.raises(SystemExit):
            matrix.parse_args(argv)
        assert message in capsys.readouterr().err, argv
    args = matrix.parse_args(["--shapes", "default", "--model", "/m", "--quantization", "int8", "--streams", "1,4,1"])
    assert args.extra == ["--model", "/m", "--quantization", "int8"] and args.streams == (1, 4)


def run(system: str, round_index: int, tokens_per_s: float, itl_ms: float | None) -> dict:
    return {"system": system, "round": round_index, "output_tokens_per_s": tokens_per_s, "itl_ms_p50": itl_ms}


def test_each_goal_is_the_median_of_the_rounds_own_ratios():
    offline = {"runs": [run("engine", 0, 30.0, None), run("vllm", 0, 20.0, None), run("engine", 1, 33.0, None),
                        run("vllm", 1, 30.0, None), run("engine", 2, 40.0, None), run("vllm", 2, 20.0, None)]}
    one = {"limits": {"itl_floor_ms": 50.0},
           "runs": [run("engine", 0, 1, 60.0), run("vllm", 0, 1, 100.0), run("llamacpp", 0, 1, 50.0),
                    run("engine", 1, 1, 70.0), run("vllm", 1, 1, 80.0), run("llamacpp", 1, 1, 80.0),
                    run("engine", 2, 1, 55.0), run("vllm", 2, 1, 110.0), run("llamacpp", 2, 1, 60.0)]}
    sixteen = {"runs": [run("engine", 0, 26.0, 1), run("llamacpp", 0, 10.0, 1)]}  # vLLM absent: no ratio to it
    goals = {g["name"]: g for g in matrix.goals({Cell("s", "d"): offline, Cell("s", "d", 1): one,
                                                 Cell("s", "d", 16): sixteen})}
    tokens = goals["offline tokens/s, ours / vLLM"]
    assert tokens["rounds"] == pytest.approx([1.5, 1.1, 2.0]) and tokens["value"] == pytest.approx(1.5)
    assert tokens["met"] is True
    itl = goals["ITL p50 at 1 stream, ours / vLLM"]
    assert itl["rounds"] == pytest.approx([0.6, 0.875, 0.5]) and itl["value"] == pytest.approx(0.6) and itl["met"]
    llama = goals["ITL p50 at 1 stream, ours / llama.cpp"]
    assert llama["rounds"] == pytest.approx([1.2, 70 / 80, 55 / 60]) and llama["value"] == pytest.approx(55 / 60)
    assert llama["met"] is True
    floor = goals["ITL p50 at 1 stream, ours / physical floor"]
    assert floor["rounds"] == pytest.approx([1.2, 1.4, 1.1]) and floor["value"] == pytest.approx(1.2)
    assert goals["tokens/s at 16 streams, ours / llama.cpp"]["value"] == pytest.approx(2.6)
    missing = matrix.goals({Cell("s", "d", 1): {"runs": [run("engine", 0, 1, 60.0)]}})  # no peer, no limits
    assert [g["name"] for g in missing] == list(goals) and all(g["value"] is g["met"] is None for g in missing)


@pytest.mark.slow
def test_a_matrix_runs_every_cell_as_a_benchmark_and_publishes_one_report(tiny_model_dir, tmp_path, monkeypatch):
    from benchmarks import docs_page

    monkeypatch.setattr(docs_page, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(docs_page, "PAGE", tmp_path / "performance.md")
    monkeypatch.setattr(docs_page, "TEMPLATE", tmp_path / "page.md")
    (tmp_path / "page.md").write_text("# Page\n\n<!-- result: tiny-matrix -->\n")
    out = tmp_path / "matrix"
    status = matrix.main(["--shapes", "default", "--model", tiny_model_dir, "--dtypes", "float32", "--streams", "1,3",
                          "--systems", "engine", "--rounds", "1", "--output-dir", str(out), "--publish", "tiny-matrix"])
    assert status == 0
    report = json.loads((out / "report.json").read_text())
    (group,) = report["groups"]
    assert [c["name"] for c in group["cells"]] == ["default-float32-offline", "default-float32-c1",
                                                   "default-float32-c3"]
    for cell in group["cells"]:  # each cell is the benchmark's own report, condensed
        full = json.loads((out / cell["name"] / "report.json").read_text())
        assert cell["runs"] == [{k: r.get(k) for k in matrix.RUN_KEYS} for r in full["runs"]]
        assert cell["checks"]["all_tokens_exact"] and cell["limits"]["itl_floor_ms"] > 0
        assert "latencies" not in json.dumps(cell) and cell["config"]["model"] == tiny_model_dir
    c1, c3 = group["cells"][1:]
    assert c1["config"]["concurrency"] == 1 and c3["config"]["concurrency"] == 3
    assert c1["workload"]["num_requests"] == 12 and c3["workload"]["num_requests"] == 12
    floor = next(g for g in group["goals"] if g["name"].endswith("physical floor"))
    assert floor["value"] == pytest.approx(c1["runs"][0]["itl_ms_p50"] / c1["limits"]["itl_floor_ms"])
    assert {g["name"]: g["met"] for g in group["goals"]}["offline tokens/s, ours / vLLM"] is None  # vLLM not run
    page = (tmp_path / "performance.md").read_text()
    assert f"{c3['runs'][0]['output_tokens_per_s']:.1f}" in page and "| 3 streams |" in page
    assert report["machine"]["cpu_model"] in page and "python -m benchmarks.matrix --shapes default" in page
    assert json.loads((tmp_path / "results" / "tiny-matrix.json").read_text())["groups"] == report["groups"]


def test_the_kernel_comparison_runs_where_both_kernels_read_the_same_weight_format():
    args = matrix.kernel_args("llama-3b", "bfloat16", ["--served-offline-stream", "--threads=4", "--quantization",
                                                       "none"])
    assert args == ["--shape", "llama-3b", "--dtype", "bfloat16", "--rounds", str(matrix.KERNEL_ROUNDS),
                    "--threads", "4"]
    assert matrix.kernel_args("default", "float32", ["--model", "/m", "--threads", "2"]) == [
        "--dtype", "float32", "--rounds", str(matrix.KERNEL_ROUNDS), "--threads", "2", "--model", "/m"]
    assert matrix.kernel_args("default", "float32", [])[:2] == ["--shape", "default"]
    assert matrix.kernel_args("llama-3b", "float16", []) is None  # not a type both kernels take
    assert matrix.kernel_args("llama-3b", "bfloat16", ["--quantization", "w8a8"]) is None  # int8 weights: not equal
    assert matrix.kernel_args("llama-3b", "bfloat16", ["--llamacpp-quant=q8_0"]) is None


def test_the_kernel_goal_is_the_median_of_its_rounds_and_the_page_shows_it():
    rounds = [{"ours_vs_llamacpp_time": r} for r in (1.1, 0.9, 0.8)]
    kernel = {"matrices": 9, "weight_bytes": 2e9, "rounds": rounds,
              "median": {"ours_ms": 50.0, "llamacpp_ms": 55.0, "ours_vs_llamacpp_time": 0.9, "ours_gbps": 40.0,
                         "llamacpp_gbps": 36.4, "probe_gbps": 41.0}}
    cell = {"runs": [{**run("engine", 0, 1, 60.0), "requests": 12, "ttft_s_p50": 0.5}], "config": {},
            "checks": {"all_tokens_exact": True}}
    (goal,) = [g for g in matrix.goals({Cell("s", "d", 1): cell}, kernel) if g["name"].startswith("one row")]
    assert goal["value"] == 0.9 and goal["rounds"] == [1.1, 0.9, 0.8] and goal["met"] is True
    report = {"groups": [{"shape": "s", "dtype": "d", "cells": [{"name": "s-d-c1", "streams": 1, **cell}],
                          "kernel": kernel, "goals": matrix.goals({Cell("s", "d", 1): cell}, kernel)}]}
    page = matrix.page_markdown(report)
    assert "ours 50.0 ms (40.0 GB/s), llama.cpp's kernel 55.0 ms (36.4 GB/s)" in page
    assert ("| one row through every weight, kernel time, ours / llama.cpp | <= 1.0x | 0.90x | 1.10, 0.90, 0.80 | yes |"
            in page)
    (none,) = [g for g in matrix.goals({Cell("s", "d", 1): cell}) if g["name"].startswith("one row")]
    assert none["value"] is none["met"] is None


def test_a_cell_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    import sys
    import time
    from pathlib import Path

    pid_file = tmp_path / "child.pid"
    command = [sys.executable, "-c", "import subprocess, sys, time; child = subprocess.Popen(['sleep', '60']); "
               f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)"]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="ran past 10 s and was killed"):
        matrix._run_process(command, timeout_s=10)  # time for the child to start its own and say which
    assert time.monotonic() - started < 40
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # gone, or a zombie until whoever adopted it reaps it
        try:
            if (Path("/proc") / str(child) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the cell's child {child} outlived the cell")
    assert matrix._run_process([sys.executable, "-c", "raise SystemExit(3)"], timeout_s=30) == 3
    with pytest.raises(SystemExit):
        matrix.parse_args(["--cell-timeout", "0"])


def test_resume_keeps_only_what_this_machine_measured():
    from benchmarks.machine import machine_info

    here = machine_info(2)
    assert matrix.same_machine(here)
    assert not matrix.same_machine({**here, "cpu_model": "another CPU"})
    assert not matrix.same_machine({**here, "cpu_features": [*here["cpu_features"], "another feature"]})
    assert not matrix.same_machine({**here, "usable_cpus": here["usable_cpus"] + 1})
    assert not matrix.same_machine(None) and not matrix.same_machine({})


def test_the_table_gives_the_ttft_mean_where_a_burst_and_the_rest_split_p50():
    """16 requests at once, then 16 one by one: p50 falls between the two groups; the mean column counts both.
    A report from before the mean was recorded keeps its old table."""
    from benchmarks.records import RequestRecord, SystemRun, summarize

    ttfts = [14.0] * 16 + [2.0 + 0.1 * k for k in range(16)]  # the burst's prompts in one step; then one by one
    records = []
    for i, ttft in enumerate(ttfts):
        r = RequestRecord(i, 0.0 if i < 16 else 20.0 + i, 4)
        r.token_times = [r.arrival + ttft + k * 0.2 for k in range(4)]
        r.finish, r.num_output_tokens = r.token_times[-1], 4
        records.append(r)
    s = summarize(SystemRun("engine", "concurrent", records, 0.0))
    assert s["ttft_s_p50"] == pytest.approx((3.5 + 14.0) / 2)  # between the groups
    assert s["ttft_s_mean"] == pytest.approx(sum(ttfts) / 32) == pytest.approx(8.375)
    runs = [{**run("engine", 0, 16, 30.0), "requests": 32, "ttft_s_p50": 8.5, "ttft_s_mean": 6.25}]
    cell = {"name": "s-d-c16", "streams": 16, "runs": runs, "config": {}, "checks": {"all_tokens_exact": True}}
    page = matrix.page_markdown({"groups": [{"shape": "s", "dtype": "d", "cells": [cell], "goals": []}]})
    assert "| TTFT p50 (s) | TTFT mean (s) | ITL p50 (ms) |" in page and "| 8.50 | 6.25 |" in page
    old = {**cell, "runs": [{k: v for k, v in runs[0].items() if k != "ttft_s_mean"}]}
    page = matrix.page_markdown({"groups": [{"shape": "s", "dtype": "d", "cells": [old], "goals": []}]})
    assert "TTFT mean" not in page and "| 8.50 |" in page
