"""The Locust load test: its workload and stream timing on their own, then a short headless run against a real
tritonserver over HTTP and gRPC, with some users cancelling mid-stream."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client.llm_client import Delta
from loadtest.report import format_summary
from loadtest.server_metrics import Snapshot
from loadtest.streaming import time_stream
from loadtest.workload import DEFAULT_WORKLOAD, load_workload, make_workload, save_workload

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_committed_workload_is_the_seeded_mix(tmp_path):
    regenerated = tmp_path / "workload.jsonl"
    save_workload(make_workload(100, seed=0), regenerated)
    assert regenerated.read_text() == DEFAULT_WORKLOAD.read_text(), \
        "loadtest/workload.jsonl differs from `python -m loadtest.workload --seed 0 --count 100`"
    items = load_workload(DEFAULT_WORKLOAD)
    long_outputs = [i.max_tokens for i in items if i.max_tokens >= 256]
    assert 10 <= len(long_outputs) <= 30 and all(i.max_tokens <= 512 for i in items)
    assert all(16 <= i.max_tokens <= 64 for i in items if i.max_tokens < 256)
    prompt_words = sorted(len(i.prompt.split()) for i in items)
    assert prompt_words[0] < 20 and prompt_words[-1] > 150


def test_workload_cap_and_validation(tmp_path):
    assert {i.max_tokens for i in load_workload(DEFAULT_WORKLOAD, 8)} == {8}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_workload(bad)


@pytest.mark.parametrize("flags, words", [
    (["--cancel-share", "2"], "--cancel-share is a fraction"), (["--cancel-share", "-0.5"], "--cancel-share is a"),
    (["-u", "0"], "--users must be at least 1"), (["-r", "0"], "--spawn-rate must be positive"),
    (["--max-output-tokens", "-1"], "--max-output-tokens must be 0"), (["-t", "bogus"], "--run-time 'bogus'"),
    (["--workload", "/nonexistent.jsonl"], "--workload /nonexistent.jsonl"),
    (["--idle-timeout", "nan"], "timeouts must be finite"), (["--idle-timeout", "inf"], "timeouts must be finite"),
    (["--memory-interval", "0"], "--memory-interval must be positive"),
    (["--memory-interval", "nan"], "--memory-interval must be positive"),
    (["--max-rss-drift-mib", "nan"], "--max-rss-drift-mib must be finite"),
])
def test_bad_flags_are_refused_before_locust_starts(flags, words, capsys):
    from loadtest.__main__ import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(flags)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


class FakeStream:
    """Deltas of one token each, 0.1 s apart on a fake clock, the last one finished; records close()."""

    def __init__(self, clock: list[float], tokens: int) -> None:
        self.clock, self.tokens, self.closed = clock, tokens, False

    def __iter__(self):
        for n in range(1, self.tokens + 1):
            self.clock[0] += 0.5 if n == 1 else 0.1
            yield Delta(text="x", token_ids=[n], finish_reason="length" if n == self.tokens else None)

    def close(self) -> None:
        self.closed = True


def test_time_stream_measures_ttft_itl_tpot_and_e2e():
    clock = [0.0]
    stream = FakeStream(clock, tokens=5)
    timing = time_stream(stream, clock=lambda: clock[0])
    assert timing.ttft_s == pytest.approx(0.5) and timing.e2e_s == pytest.approx(0.9)
    assert timing.itl_s == pytest.approx([0.1] * 4) and timing.tpot_s == pytest.approx(0.1)
    assert timing.output_tokens == 5 and timing.finish_reason == "length" and not timing.cancelled
    assert timing.tokens_per_s == pytest.approx(5 / 0.9) and stream.closed


def test_time_stream_cancels_by_closing_the_stream():
    clock = [0.0]
    stream = FakeStream(clock, tokens=10)
    timing = time_stream(stream, cancel_after_tokens=3, clock=lambda: clock[0])
    assert timing.cancelled and timing.output_tokens == 3 and timing.finish_reason is None and stream.closed


def test_snapshot_total_matches_counters_renamed_by_the_parser():
    labels = (("model", "llm"), ("version", "2"))
    snapshot = Snapshot({("nv_inference_request_success_total", labels): 3.0,
                         ("llm_prompt_tokens_total", labels): 7.0,
                         ("llm_num_requests_running", (("model", "llm"), ("version", "1"))): 1.0,
                         ("llm_num_requests_running", labels): 2.0})
    assert snapshot.total("nv_inference_request_success") == 3.0
    assert snapshot.total("llm_prompt_tokens_total") == 7.0
    assert snapshot.total("llm_num_requests_running") == 3.0
    assert snapshot.total("llm_num_requests_running", version="1") == 1.0


def test_summary_formats_without_a_server():
    result = {"users": 2, "run_time": "5s", "cancel_share": 0.0, "output_dir": "out", "elapsed_s": 5.0,
              "locust": {"protocols": {}, "failure_messages": [], "exceptions": []}, "server": None, "ok": False,
              "problems": ["no stream completed"]}
    assert "Server metrics: not reachable" in format_summary(result)


@pytest.mark.server
@pytest.mark.timeout(300)
def test_headless_run_streams_cancels_and_leaves_the_server_idle(triton_server, tmp_path):
    _wait_idle(triton_server, timeout_s=30)
    metrics_url = triton_server.metrics_url
    out = tmp_path / "loadtest"
    command = [sys.executable, "-m", "loadtest", "--host", triton_server.http_url,
               "--grpc-host", triton_server.grpc_url, "--metrics-url", metrics_url,
               "--users", "4", "--spawn-rate", "4", "--run-time", "20s", "--cancel-share", "0.5",
               "--max-output-tokens", "12", "--stop-timeout", "60", "--idle-timeout", "20", "--output-dir", str(out)]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (f"python -m loadtest failed:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}\n"
                                 f"tritonserver's log:\n{triton_server.log()[-3000:]}")

    result = json.loads((out / "summary.json").read_text())
    protocols = result["locust"]["protocols"]
    assert set(protocols) == {"http", "grpc"}
    for name, stats in protocols.items():
        assert stats["failures"] == 0, result["locust"]["failure_messages"]
        # 2 users per protocol, one of them cancelling: streams completed and were cancelled over both.
        assert stats["completed"] > 0 and stats["cancelled"] > 0, (name, stats)
        assert stats["TTFT"]["p50"] > 0 and stats["ITL"]["p50"] > 0 and stats["e2e"]["p50"] > 0, (name, stats)
    assert result["locust"]["failure_messages"] == [] and result["locust"]["exceptions"] == []

    # The server saw what the clients did: every request finished once, and a cancel (gRPC cancel or HTTP
    # disconnect) aborted its request unless the request had finished first (a client reading behind the engine
    # cancels after its last token was sent: the server counts length, the client a cancel).
    deltas = result["server"]["deltas"]
    completed = sum(s["completed"] for s in protocols.values())
    cancelled = sum(s["cancelled"] for s in protocols.values())
    assert deltas["finished_length"] + deltas["finished_abort"] == completed + cancelled, deltas
    assert deltas["finished_length"] >= completed and 0 < deltas["finished_abort"] <= cancelled, deltas
    assert deltas["finished_error"] == 0 and deltas["triton_failure"] == 0, deltas
    assert result["server"]["idle"] and result["server"]["ready"]

    assert triton_server.is_ready()
    for gauge in ("llm_num_requests_running", "llm_num_requests_waiting", "llm_kv_cache_blocks_used"):
        assert triton_server.metric(gauge) == 0, gauge
    assert (out / "report.html").stat().st_size > 0 and (out / "locust_stats.csv").exists()


def _wait_idle(server, timeout_s: float) -> None:
    """Earlier tests may leave requests finishing: start from an idle engine."""
    deadline = time.monotonic() + timeout_s
    while any(server.metric(g) for g in ("llm_num_requests_running", "llm_num_requests_waiting")):
        assert time.monotonic() < deadline, "server busy before the load test"
        time.sleep(0.5)


@pytest.mark.server
@pytest.mark.timeout(400)
def test_one_minute_soak_has_no_failures_returns_to_idle_and_memory_does_not_drift(triton_server, tmp_path):
    """``make soak`` in small: 60 s at saturation over both protocols with 20% of users cancelling, memory of
    tritonserver and its stubs sampled every 10 s; drift after a 20 s warm-up bounded by 200 MiB a process."""
    _wait_idle(triton_server, timeout_s=30)
    out = tmp_path / "soak"
    command = [sys.executable, "-m", "loadtest", "--soak", "--host", triton_server.http_url,
               "--grpc-host", triton_server.grpc_url, "--metrics-url", triton_server.metrics_url,
               "--users", "10", "--spawn-rate", "10", "--run-time", "60s", "--cancel-share", "0.2",
               "--max-output-tokens", "24", "--stop-timeout", "90", "--idle-timeout", "30",
               "--memory-interval", "10", "--memory-warmup", "20", "--max-rss-drift-mib", "200",
               "--output-dir", str(out)]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=360)
    print(run.stdout[-3000:])
    assert run.returncode == 0, f"soak failed:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    result = json.loads((out / "summary.json").read_text())
    protocols = result["locust"]["protocols"]
    assert set(protocols) == {"http", "grpc"}
    assert all(s["failures"] == 0 and s["completed"] > 0 and s["cancelled"] > 0 for s in protocols.values())
    assert result["server"]["idle"] and result["server"]["deltas"]["triton_failure"] == 0
    memory = result["memory"]
    assert {"tritonserver", "stub llm/1", "stub llm/2"} <= set(memory["processes"])
    assert len(memory["samples"]) >= 6
    assert all(p["drift_mib"] <= 200 for p in memory["processes"].values()), memory["processes"]
