"""The benchmark harness: a tiny end-to-end run (tiny random model, no server) gives a complete, consistent
report; the workload is deterministic; the figures are computed as defined. No speed assertions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.__main__ import parse_args
from benchmarks.config import HF_BASELINES, QUICK, BenchConfig
from benchmarks.records import RequestRecord, SystemRun, summarize
from benchmarks.workload import make_workload

SYSTEMS = ("naive", "static", "generate_batch", "engine", "ceiling")  # the server has its own tests
MODES = ("offline", "online", "concurrent")
BASELINES = HF_BASELINES  # one request or batch at a time: no closed-loop mode


def tiny_config(model_dir: str, output_dir, **overrides) -> BenchConfig:
    settings = dict(model=model_dir, num_requests=6, seed=3, rate=40.0, systems=(*SYSTEMS, "prefix_cache"), modes=MODES,
                    prompt_tokens=(8, 40), short_output=(3, 8), long_output=(16, 24), long_share=0.3,
                    static_batch=4, concurrency=2, naive_max_requests=None, kv_cache_bytes=8 << 20, ceiling_steps=3,
                    output_dir=str(output_dir), progress=False)
    return BenchConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory):
    from benchmarks.runner import run_benchmark

    return run_benchmark(tiny_config(tiny_model_dir, tmp_path_factory.mktemp("bench")))


def runs_by(report: dict) -> dict[tuple[str, str], dict]:
    return {(r["system"], r["mode"]): r for r in report["runs"]}


def test_every_system_runs_in_every_mode(report):
    assert report["skipped"] == {}
    assert set(runs_by(report)) == {(s, m) for s in SYSTEMS for m in MODES
                                    if s not in BASELINES or m != "concurrent"}


def test_every_system_produced_exactly_the_workload_tokens(report):
    total = report["workload"]["total_output_tokens"]
    assert total == sum(r["output_tokens"] for r in report["workload"]["requests"])
    for (system, mode), run in runs_by(report).items():
        if system != "ceiling":
            assert run["requests"] == report["workload"]["num_requests"], (system, mode)
            assert run["output_tokens"] == run["expected_tokens"] == total, (system, mode)
    assert report["checks"]["all_tokens_exact"]


def test_figures_are_positive_finite_and_percentiles_ordered(report):
    def positive(value):
        return isinstance(value, (int, float)) and math.isfinite(value) and value > 0

    for (system, mode), run in runs_by(report).items():
        assert positive(run["output_tokens_per_s"]), (system, mode)
        if system == "ceiling":
            assert positive(run["step_s"]) and run["batch"] >= 1 and run["context"] >= 1
            # the work-matched ceiling: the engine's output at the decode ceiling plus its prompts' prefill
            work = run["work"]
            assert work["output_tokens"] == report["workload"]["total_output_tokens"]
            assert work["prompt_tokens"] == report["workload"]["total_prompt_tokens"]
            seconds = work["output_tokens"] / run["output_tokens_per_s"] + work["prompt_tokens"] * run["prefill_s_per_token"]
            assert run["with_prefill_tokens_per_s"] == pytest.approx(work["output_tokens"] / seconds)
            assert run["with_prefill_tokens_per_s"] < run["output_tokens_per_s"]
            assert run["engine_output_tokens_per_s"] == pytest.approx(run["batch"] / run["engine_step_s"])
            continue
        assert positive(run["requests_per_s"]) and positive(run["duration_s"]) and positive(run["mean_batch"])
        names = ["ttft_s", "e2e_s"] + (["itl_ms"] if run["streams"] else [])
        for name in names:
            p50, p99 = run[f"{name}_p50"], run[f"{name}_p99"]
            assert positive(p50) and positive(p99) and p50 <= p99, (system, mode, name, p50, p99)
        assert run["ttft_s_p50"] <= run["e2e_s_p99"]
    static = runs_by(report)[("static", "offline")]
    assert not static["streams"] and static["itl_ms_p50"] is None
    assert static["ttft_s_p50"] == static["e2e_s_p50"]  # no streaming: the first token comes with the last


def assert_closed_loop(records, concurrency: int) -> None:
    """At most ``concurrency`` requests were in flight, the first ``concurrency`` went out at once, and every later
    one only after another had finished (arrival = when it was sent, before its first token)."""
    arrivals = sorted(r.arrival for r in records)
    finishes = sorted(r.finish for r in records)
    for k, arrival in enumerate(arrivals[concurrency:]):
        assert arrival >= finishes[k]  # the (k + concurrency)-th request waited for the k-th finish
    assert arrivals[concurrency - 1] < finishes[0]  # and the first ones did not wait
    for r in records:
        assert r.arrival <= r.token_times[0] <= r.finish and len(r.token_times) == r.expected_tokens


def test_concurrent_mode_keeps_n_requests_in_flight(tiny_model_dir, tokenizer, tmp_path):
    from benchmarks.engine_system import EngineSystem

    config = tiny_config(tiny_model_dir, tmp_path, concurrency=2)
    workload = make_workload(tokenizer, config)
    system = EngineSystem(config)
    try:
        run = system.run(workload, "concurrent")
    finally:
        system.close()
    assert len(run.records) == 6
    assert_closed_loop(run.records, 2)


def test_one_round_has_no_spread_and_says_so(report):
    spread = report["spread"]["offline"]["engine"]
    assert spread["spread_pct"] is None and len(spread["tokens_per_s"]) == 1
    assert "the spread needs at least 3" in (Path(report["files"][1])).read_text()
    from benchmarks.machine import FEATURES

    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
                .split(":", 1)[1].split())
    assert report["machine"]["cpu_features"] == [f for f in FEATURES if f in flags]


def test_engine_kv_use_and_ratios(report):
    for mode in MODES:
        kv = runs_by(report)[("engine", mode)]["kv"]
        assert 0 <= kv["waste_pct"] <= 100
        assert 0 < kv["stored_per_reserved"] <= 1
        assert kv["stored_tokens"] <= kv["reserved_slots"]
        assert runs_by(report)[("engine", mode)]["preemptions"] >= 0
        ratios = report["ratios"][mode]
        for key in ("engine_vs_ceiling", "engine_vs_ceiling_with_prefill"):
            assert ratios[key] > 0, key
        for key in ("engine_vs_static", "engine_vs_generate_batch", "engine_vs_naive"):
            assert (ratios[key] > 0) if mode != "concurrent" else ratios[key] is None, key
        assert ratios["engine_vs_ceiling_with_prefill"] > ratios["engine_vs_ceiling"]
        ceiling = runs_by(report)[("ceiling", mode)]
        assert ratios["engine_step_vs_ceiling_step"] == pytest.approx(ceiling["step_s"] / ceiling["engine_step_s"])
        assert ratios["server_vs_engine"] is None  # not run here
    assert {t["name"] for t in report["targets"]} >= {"engine_vs_static", "kv_waste_pct (offline)"}


def test_files_are_written_and_agree(report):
    files = {p.rsplit("/", 1)[-1]: p for p in report["files"]}
    assert set(files) == {"report.json", "report.md", "throughput.png", "latency_cdf.png", "engine_timeline.png"}
    on_disk = json.loads(open(files["report.json"]).read())
    assert on_disk["workload"]["seed"] == 3 and len(on_disk["runs"]) == len(report["runs"])
    assert on_disk["machine"]["torch_threads"] == report["config"]["threads"]
    text = open(files["report.md"]).read()
    for label in ("naive", "static batching", "HF continuous batching", "ours, in process", "ceiling"):
        assert label in text
    for name in ("throughput.png", "latency_cdf.png", "engine_timeline.png"):
        assert open(files[name], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_workload_is_fixed_by_its_seed(tokenizer, tmp_path):
    config = tiny_config(None, tmp_path, num_requests=40, prompt_tokens=(16, 256))
    a, b = make_workload(tokenizer, config), make_workload(tokenizer, config)
    assert a == b
    head = a.head(5)
    assert head.requests == a.requests[:5] and head.seed == a.seed and a.head(None) is a and a.head(99) is a
    with pytest.raises(ValueError):
        a.head(0)
    assert make_workload(tokenizer, tiny_config(None, tmp_path, num_requests=40, seed=4)) != a
    arrivals = a.arrivals("online")
    assert arrivals[0] == 0 and all(x < y for x, y in zip(arrivals, arrivals[1:]))
    assert a.arrivals("offline") == a.arrivals("concurrent") == [0.0] * 40  # concurrent: due when a slot frees
    for r in a.requests:
        assert tokenizer.encode(r.prompt_text) == list(r.prompt_ids)  # text and ids are the same prompt
        assert 3 <= r.output_len <= 24


def test_a_report_without_table_rows_has_no_plots(tmp_path):
    from benchmarks.plots import write_plots

    assert write_plots({"runs": []}, tmp_path) == []  # e.g. only prefix_cache ran: report files still written


def test_summary_follows_the_definitions():
    records = [RequestRecord(0, 10.0, 3, [10.5, 10.7, 11.0], 11.0, 3),
               RequestRecord(1, 10.0, 2, [11.5, 12.0], 12.0, 2)]
    s = summarize(SystemRun("engine", "offline", records, start=10.0, mean_batch=2.0))
    assert s["output_tokens"] == 5 and s["duration_s"] == pytest.approx(2.0)
    assert s["output_tokens_per_s"] == pytest.approx(2.5) and s["requests_per_s"] == pytest.approx(1.0)
    assert s["ttft_s_p50"] == pytest.approx(1.0)  # 0.5 and 1.5
    assert s["itl_ms_p50"] == pytest.approx(300)  # gaps 200, 300, 500 ms
    not_streamed = summarize(SystemRun("static", "offline", [RequestRecord(0, 1.0, 4, [], 3.0, 4)], 1.0, streams=False))
    assert not_streamed["ttft_s_p50"] == not_streamed["e2e_s_p50"] == pytest.approx(2.0)
    assert not_streamed["itl_ms_p50"] is None


@pytest.mark.parametrize("argv", [[], ["--max-step-ms", "50", "--stream-interval", "4", "--dtype", "float32"]])
def test_the_served_engine_is_set_as_the_in_process_one(argv):
    """The server's version gets every setting of its engine.json from the benchmark's in-process engine settings,
    the step time budget included: by default none (the served model's config.pbtxt sets 50 ms, which schedules an
    offline batch in more, smaller steps than the in-process engine and vLLM do)."""
    from benchmarks.engine_system import engine_config
    from benchmarks.server_system import served_settings

    config = parse_args(argv)
    settings = served_settings(config)
    assert settings["max_step_ms"] == config.max_step_ms == (50 if argv else 0)
    engine = engine_config(config)
    assert {name: getattr(engine, name) for name in settings} == settings


def test_command_line():
    quick = parse_args(["--quick", "--seed", "7", "--systems", "engine,ceiling", "--output-dir", "x"])
    assert (quick.quick, quick.seed, quick.systems, quick.output_dir) == (True, 7, ("engine", "ceiling"), "x")
    assert quick.num_requests == QUICK["num_requests"] and quick.short_output == QUICK["short_output"]
    full = parse_args(["--num-requests", "5", "--rate", "3", "--naive-max-requests", "0", "--max-num-seqs", "32"])
    assert (full.num_requests, full.rate, full.naive_max_requests, full.quick) == (5, 3.0, None, False)
    assert full.max_num_seqs == 32 and full.static_max_requests == 64
    # subsets: naive 8, static 64 offline; every system at most 64 online; quick runs all but naive's 4
    default = parse_args([])
    assert [default.max_requests(s, "offline") for s in ("naive", "static", "engine")] == [8, 64, None]
    assert [default.max_requests(s, "online") for s in ("naive", "static", "engine")] == [8, 64, 64]
    assert parse_args(["--online-max-requests", "0"]).max_requests("engine", "online") is None
    assert [quick.max_requests(s, "online") for s in ("naive", "static", "engine")] == [4, None, None]
    assert default.max_requests("engine", "concurrent") == 64 and default.concurrency == 16 and quick.concurrency == 4
    assert parse_args(["--concurrency", "3"]).concurrency == 3
    assert default.max_step_ms == 0 and parse_args(["--max-step-ms", "50"]).max_step_ms == 50
    for bad in (["--systems", "engine,nonsense"], ["--systems", ","], ["--online-max-requests", "-1"],
                ["--max-step-ms", "-1"], ["--max-step-ms", "inf"],
                ["--static-max-requests", "-3"], ["--max-num-seqs", "0"], ["--max-num-batched-tokens", "0"],
                ["--rate", "nan"], ["--rate", "inf"], ["--num-requests", "0"], ["--concurrency", "0"],
                ["--modes", "offline,closed"]):
        with pytest.raises(SystemExit):  # argparse's one-line error, exit status 2
            parse_args(bad)
    with pytest.raises(ValueError, match="naive_max_requests"):
        BenchConfig(naive_max_requests=0)  # None means all; 0 would run nothing


def test_busy_mean_counts_only_busy_time():
    from benchmarks.records import busy_mean

    assert busy_mean([(0, 2), (1, 3), (10, 11)]) == pytest.approx(5 / 4)  # union 0-3 and 10-11
    assert busy_mean([(0, 1), (0, 1)]) == pytest.approx(2)


def test_prefix_cache_section_is_consistent(report):
    result = report["prefix_cache"]
    off, on = result["off"], result["on"]
    requests, prefix = result["workload"]["requests"], result["workload"]["prefix_tokens"]
    assert off["output_tokens"] == on["output_tokens"] == requests * result["workload"]["max_tokens"]
    assert off["prefix_cache_hits"] == 0 and off["mean_cached_tokens"] == 0
    # every request after the first finds the system prompt's full blocks
    assert on["prefix_cache_hits"] >= (requests - 1) * (prefix // 16) * 16
    assert result["ttft_p50_speedup"] == pytest.approx(off["ttft_p50_s"] / on["ttft_p50_s"])
    assert "## Prefix caching" in (Path(report["files"][1])).read_text()


def test_rounds_run_every_system_in_turn_and_report_the_median_of_each_rounds_ratio(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    from benchmarks.runner import run_benchmark

    import threading

    import benchmarks.limits
    import benchmarks.runner
    import benchmarks.steadiness

    monkeypatch.setattr("benchmarks.steadiness.PROBE_SECONDS", 0.2)  # the machine probe's minimum samples suffice
    on_main: list[tuple[str, bool]] = []  # what ran torch, and whether on the benchmark's own thread

    def recorded(name, fn):
        def call(*args, **kwargs):
            on_main.append((name, threading.current_thread() is threading.main_thread()))
            return fn(*args, **kwargs)
        return call

    for module, name in ((benchmarks.runner, "_build"), (benchmarks.steadiness, "sample_gemm_rate"),
                         (benchmarks.limits, "model_limits")):
        monkeypatch.setattr(module, name, recorded(name, getattr(module, name)))
    config = tiny_config(tiny_model_dir, tmp_path, systems=("static", "engine"), modes=("offline",), rounds=3,
                         limits=True)
    report = run_benchmark(config)
    # what runs torch on its caller runs on a thread that ends with it: no OpenMP pool left on this thread beside
    # the engine's loop thread; the engine (which loads and steps on threads of its own) is built here
    assert sorted(on_main) == sorted([("_build", False)] * 3 + [("_build", True)] * 3
                                     + [("sample_gemm_rate", False)] * 6 + [("model_limits", False)])
    assert report["config"]["parts_on_own_threads"] and report["limits"]["bandwidth_gbps"] > 0
    runs = [(r["system"], r["round"]) for r in report["runs"]]
    assert sorted(runs) == sorted((s, i) for s in ("static", "engine") for i in range(3))
    per_round = report["ratios_by_round"]["offline"]["engine_vs_static"]
    rate = {(r["system"], r["round"]): r["output_tokens_per_s"] for r in report["runs"]}
    assert per_round == pytest.approx([rate["engine", i] / rate["static", i] for i in range(3)])
    assert report["ratios"]["offline"]["engine_vs_static"] == pytest.approx(sorted(per_round)[1])
    assert report["checks"]["all_tokens_exact"] and len(report["checks"]["tokens_exact"]) == 6
    text = (tmp_path / "report.md").read_text()
    assert "ours, in process (round 3)" in text and "3 rounds: each ratio is the median" in text
    engine = report["spread"]["offline"]["engine"]
    values = [rate["engine", i] for i in range(3)]
    assert engine["tokens_per_s"] == values and engine["median"] == sorted(values)[1]
    assert engine["spread_pct"] == pytest.approx(100 * (max(values) - min(values)) / sorted(values)[1])
    assert f"{engine['spread_pct']:.0f}%" in text and "the spread needs at least" not in text
    # the machine's own matmul rate, sampled before every run, beside each round's figure
    probes = [r["machine_gflops_before"] for r in report["runs"]]
    assert len(probes) == 6 and all(0 < p["min"] <= p["median"] <= p["max"] and p["samples"] >= 5 for p in probes)
    assert all(p["dtype"] == report["config"]["dtype_resolved"] for p in probes)
    assert engine["machine_gflops_before"] == [r["machine_gflops_before"] for r in report["runs"]
                                               if r["system"] == "engine"]
    low, high = min(p["min"] for p in probes), max(p["max"] for p in probes)
    assert f"ran at {low:.0f}-{high:.0f} GFLOP/s" in text
    assert ", ".join(f"{p['min']:.0f}-{p['max']:.0f}" for p in engine["machine_gflops_before"]) in text
    from benchmarks.docs_page import generate

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "tiny.json").write_text(json.dumps(report))
    page = generate("# Page\n\n<!-- result: tiny -->\n", tmp_path / "results")
    assert report["command"] is None and report["date"] in page and "engine / static **" in page
    assert ", ".join(f"{v:.1f}" for v in values) in page and report["machine"]["cpu_model"] in page
    with pytest.raises(FileNotFoundError, match="missing.json"):
        generate("<!-- result: missing -->\n", tmp_path / "results")
    assert parse_args(["--rounds", "2"]).rounds == 2
    with pytest.raises(ValueError, match="rounds"):
        BenchConfig(rounds=0)


def test_memory_floor_counts_every_weight_and_each_cached_token_once_a_step(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.memory_floor import run, weight_bytes

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # a tied embedding counts once
    read = matrices - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)  # its rows: not read
    assert weight_bytes(cfg, 4) == 4 * read
    config = tiny_config(tiny_model_dir, tmp_path, dtype="float32")
    result = run(config)
    steps = sum(p.steps for p in result.phases.values())
    assert steps > 0 and result.seconds > 0 and result.weight_bytes_per_step == weight_bytes(cfg, 4)
    kv_tokens, rest = divmod(result.bytes - steps * result.weight_bytes_per_step, result.kv_bytes_per_token)
    assert rest == 0
    requests = make_workload(AutoTokenizer.from_pretrained(tiny_model_dir), config).requests
    # after its prompt, each of a request's later steps reads at least its prompt and at most its whole context
    assert sum(len(r.prompt_ids) * (r.output_len - 1) for r in requests) <= kv_tokens
    assert kv_tokens <= sum((len(r.prompt_ids) + r.output_len) * r.output_len for r in requests)
    assert "At 18 GB/s these bytes take at least" in result.markdown(18.0)


def test_vllm_runs_only_with_tcmalloc_preloaded_and_older_reports_say_where_it_did_not(tmp_path):
    from benchmarks.report import page_markdown
    from benchmarks.vllm_system import vllm_environment

    config = BenchConfig(threads=2)
    with pytest.raises(RuntimeError, match="apt-get install libtcmalloc-minimal4"):
        vllm_environment(config, tmp_path, tcmalloc_glob=str(tmp_path / "lib*" / "libtcmalloc_minimal.so.4"))
    (tmp_path / "lib").mkdir()
    tcmalloc = tmp_path / "lib" / "libtcmalloc_minimal.so.4"
    tcmalloc.write_bytes(b"")
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env, notes = vllm_environment(config, tmp_path, tcmalloc_glob=str(tmp_path / "lib*" / "libtcmalloc_minimal.so.4"))
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{tmp_path / 'lib' / 'libiomp5.so'}"  # tcmalloc first, as the docs do
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and notes == [f"LD_PRELOAD {env['LD_PRELOAD']}"]

    # A report written while the benchmark only noted the missing allocator: the page says so under its table.
    report = json.loads((Path(__file__).resolve().parent.parent / "docs" / "results" / "vllm-fp32.json").read_text())
    for run in report["runs"]:
        run["notes"] = [n for n in run.get("notes", []) if "tcmalloc" not in n]
    assert "did not run as prescribed" not in page_markdown(report)
    for run in report["runs"]:
        if run["system"] == "vllm":  # every round of it: shown once
            run["notes"].append("tcmalloc not found (apt-get install libtcmalloc-minimal4): vLLM ran without it")
    page = page_markdown(report)
    assert page.count("did not run as prescribed here") == 1
    assert "vLLM CPU, in process did not run as prescribed here**: tcmalloc not found" in page


def test_machine_rate_samples_are_each_a_measured_rate():
    import torch

    from benchmarks.steadiness import MIN_SAMPLES, sample_gemm_rate, summarize_rates

    threads = torch.get_num_threads()
    try:
        samples = sample_gemm_rate("float32", 1, seconds=0.01, n=64)
    finally:
        torch.set_num_threads(threads)
    assert len(samples) >= MIN_SAMPLES and all(rate > 0.01 for rate in samples)  # 64^3 on one core: >> 10 MFLOP/s
    summary = summarize_rates([100.0, 200.0, 150.0])
    assert summary == {"min": 100.0, "median": 150.0, "max": 200.0, "spread_pct": pytest.approx(100 * 100 / 150),
                       "samples": 3}
    with pytest.raises(ValueError, match="seconds"):
        sample_gemm_rate("float32", 1, seconds=0)
    with pytest.raises(ValueError, match="no samples"):
        summarize_rates([])


def test_machine_probe_leaves_no_openmp_pool_on_the_calling_thread():
    """The probe's matmuls run on a thread that ends with them: a pool of OpenMP workers left on the thread that
    runs the benchmark would make our engine's barriers sleep while it steps on its loop thread."""
    import subprocess
    import sys

    code = """
import os
import time
import torch
from benchmarks.config import BenchConfig
from benchmarks.runner import _probe_machine
torch.set_num_threads(2)
before = len(os.listdir("/proc/self/task"))
probe = _probe_machine(BenchConfig(dtype="float32", threads=2))
deadline = time.monotonic() + 10  # a finished thread's workers leave within milliseconds; a live pool stays
while len(os.listdir("/proc/self/task")) != before and time.monotonic() < deadline:
    time.sleep(0.05)
print(before, len(os.listdir("/proc/self/task")), probe is not None and probe["min"] > 0)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr
    before, after, measured = result.stdout.split()
    assert measured == "True"
    assert int(after) == int(before), "the probe left OpenMP worker threads behind on the calling thread"


def test_page_marks_runs_whose_engine_ran_beside_a_second_openmp_pool():
    """Reports written before the benchmark ran its probes on threads of their own say on the page that ours ran
    slower than it serves; newer reports, and older ones with nothing run on the benchmark's thread, do not."""
    from benchmarks.matrix import page_markdown as matrix_page
    from benchmarks.report import SECOND_POOL_NOTE, page_markdown, second_pool

    results = Path(__file__).resolve().parent.parent / "docs" / "results"
    engine, vllm = {"system": "engine"}, {"system": "vllm"}
    probed = {"system": "engine", "machine_gflops_before": {"min": 1.0}}
    assert second_pool({}, [probed, vllm], None)  # a round's machine probe
    assert second_pool({}, [engine, vllm], {"bandwidth_gbps": 20.0})  # --limits
    assert second_pool({}, [{"system": "static"}, engine], None)  # a transformers baseline in the same process
    assert not second_pool({}, [engine, vllm], None)  # nothing of torch on the benchmark's thread
    assert not second_pool({"parts_on_own_threads": True}, [probed, vllm], {"bandwidth_gbps": 20.0})
    assert not second_pool({}, [{"system": "vllm", "machine_gflops_before": {}}], {"bandwidth_gbps": 20.0})

    matrix = json.loads((results / "matrix-zen4.json").read_text())  # every cell measured with --limits
    assert matrix_page(matrix).count(SECOND_POOL_NOTE) == len(matrix["groups"])
    for cell in (c for g in matrix["groups"] for c in g["cells"]):
        cell["config"]["parts_on_own_threads"] = True
    assert SECOND_POOL_NOTE not in matrix_page(matrix)
    report = json.loads((results / "vllm-bf16-avx2.json").read_text())  # three rounds, before the probe existed
    assert SECOND_POOL_NOTE not in page_markdown(report)


def test_block_size_tool_times_each_size_and_reads_the_whole_cache():
    """``benchmarks.block_size``: a row per size (and kind of pages) in the order given, each rate the KV bytes over
    its time."""
    import torch

    import kernels.cpu
    from benchmarks import block_size

    if kernels.cpu.load() is None or not kernels.cpu.small_gemm_available(torch.float32):
        pytest.skip("no C++ kernels with an fp32 small_gemm here")
    rows, context = 3, 40
    results = block_size.measure(rows, context, torch.float32, [16, 32], calls=2)
    assert [r["block_size"] for r in results] == [16, 32]
    kv_bytes = rows * context * 3 * 64 * 2 * 4 * 30  # SmolLM2-135M: 3 KV heads of 64, 30 layers; K and V in fp32
    for r in results:
        assert 0 < r["attention_ms"] < r["step_ms"] < 60_000
        assert r["attention_gbps"] == pytest.approx(kv_bytes / r["attention_ms"] / 1e6)
    table = block_size.markdown(results).splitlines()
    assert len(table) == 4 and table[2].startswith("| 16 | 2 MiB |") and "| 1.00x |" in table[2]
    both = block_size.measure(rows, context, torch.float32, [16], calls=1, scattered=True, pages=("4k", "huge"),
                              pool_blocks=50)
    assert [(r["block_size"], r["pages"]) for r in both] == [(16, "4k"), (16, "huge")]
    assert all(r["attention_gbps"] == pytest.approx(kv_bytes / r["attention_ms"] / 1e6) for r in both)
