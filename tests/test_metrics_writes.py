"""The model's metrics (``serve.metrics.EngineMetrics``) write only what changed: every write is an IPC round trip
from the stub to tritonserver. A recording stand-in for ``pb_utils``' metric classes counts the writes; the real
ones are exercised by the server tests (``test_metrics_match_what_the_requests_did``)."""

from __future__ import annotations

from dataclasses import replace

from backend import EngineStats
from backend.kv_cache_manager import KVCacheUsage
from serve.metrics import EngineMetrics


class RecordingFamily:
    GAUGE, COUNTER, HISTOGRAM = 0, 1, 2
    writes: list[tuple[str, dict, str, float]] = []

    def __init__(self, name, description, kind) -> None:
        self.name = name

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        family = self

        class Metric:
            def set(self, value):
                RecordingFamily.writes.append((family.name, labels, "set", value))

            def increment(self, value):
                RecordingFamily.writes.append((family.name, labels, "increment", value))

            def observe(self, value):
                RecordingFamily.writes.append((family.name, labels, "observe", value))

        return Metric()


class FakePbUtils:
    MetricFamily = RecordingFamily


def stats(**changes) -> EngineStats:
    base = EngineStats(num_running=3, num_waiting=1, kv=KVCacheUsage(num_blocks=100, used_blocks=10, free_blocks=90,
                                                                     tokens_per_block=16),
                       max_num_seqs=8, num_preemptions=0, prompt_tokens=50, generation_tokens=7, num_steps=4,
                       finished={"length": 1})
    return replace(base, **changes)


def test_only_changed_values_are_written():
    metrics = EngineMetrics(FakePbUtils, "llm", "1")
    RecordingFamily.writes.clear()
    metrics.update(stats())
    first = [w for w in RecordingFamily.writes if w[0] != "llm_thread_cpu_seconds_total"]
    # The first update writes every gauge, and the counters that moved from zero; no zero increments.
    assert ("llm_kv_cache_blocks_total", {"model": "llm", "version": "1"}, "set", 100) in first
    assert ("llm_generation_tokens_total", {"model": "llm", "version": "1"}, "increment", 7) in first
    assert not [w for w in first if w[2] == "increment" and w[3] == 0]
    assert not [w for w in first if w[0] == "llm_num_preemptions_total"]

    RecordingFamily.writes.clear()
    metrics.update(stats(num_running=4, generation_tokens=10, num_steps=5))
    second = {(w[0], w[1].get("request_type"), w[2], w[3]) for w in RecordingFamily.writes
              if w[0] != "llm_thread_cpu_seconds_total"}
    assert second == {
        ("llm_num_requests_running", None, "set", 4),
        ("llm_generation_tokens_total", None, "increment", 3),
        ("llm_engine_steps_total", None, "increment", 1),
        ("nv_trt_llm_request_metrics", "active", "set", 4),
        ("vllm:num_requests_running", None, "set", 4),  # vLLM's names, on by default
    }


def test_speculative_decoding_counters_use_vllm_names_and_count_what_changed():
    RecordingFamily.writes.clear()
    EngineMetrics(FakePbUtils, "llm", "1").update(stats(spec_decode_num_drafts=3))  # off: no such counters
    assert not [w for w in RecordingFamily.writes if w[0].startswith("vllm:spec_decode")]
    metrics = EngineMetrics(FakePbUtils, "llm", "1", speculative=True)
    metrics.update(stats())
    RecordingFamily.writes.clear()
    metrics.update(stats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12, spec_decode_num_accepted_tokens=7))
    metrics.update(stats(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=16, spec_decode_num_accepted_tokens=7))
    spec = [(w[0], w[1], w[3]) for w in RecordingFamily.writes if w[0].startswith("vllm:spec_decode")]
    labels = {"model_name": "llm", "version": "1"}
    assert spec == [("vllm:spec_decode_num_drafts_total", labels, 3),
                    ("vllm:spec_decode_num_draft_tokens_total", labels, 12),
                    ("vllm:spec_decode_num_accepted_tokens_total", labels, 7),
                    ("vllm:spec_decode_num_drafts_total", labels, 1),
                    ("vllm:spec_decode_num_draft_tokens_total", labels, 4)]


def test_counters_are_written_before_the_gauges_that_say_idle():
    """A scrape sees each write at once: one that reads 0 running and 0 waiting (the load test's wait for idle)
    must already read the finished requests and their tokens in the counters."""
    metrics = EngineMetrics(FakePbUtils, "llm", "1")
    metrics.update(stats())
    RecordingFamily.writes.clear()
    metrics.update(stats(num_running=0, num_waiting=0, generation_tokens=19, num_steps=9, finished={"length": 4}))
    names = [w[0] for w in RecordingFamily.writes]
    counters = [i for i, w in enumerate(RecordingFamily.writes) if w[2] == "increment"]
    idle = [names.index(name) for name in ("llm_num_requests_running", "llm_num_requests_waiting",
                                           "vllm:num_requests_running", "vllm:num_requests_waiting")]
    assert "llm_request_finished_total" in names and "llm_generation_tokens_total" in names
    assert max(counters) < min(idle), RecordingFamily.writes
