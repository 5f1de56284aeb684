"""Triton's Prometheus metrics for the load test: snapshots, deltas over a run, and the wait for idle.

Idle means no request running or waiting and no KV cache block in use, summed over every version of the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import requests
from prometheus_client.parser import text_string_to_metric_families

FINISH_REASONS = ("length", "stop", "abort", "error", "timeout")
IDLE_GAUGES = ("llm_num_requests_running", "llm_num_requests_waiting", "llm_kv_cache_blocks_used")


@dataclass(frozen=True)
class Snapshot:
    """One scrape of ``/metrics``: (sample name, sorted labels) -> value."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``.

        ``name`` is the name on the wire. prometheus_client's parser appends ``_total`` to counters whose name
        lacks it (Triton's ``nv_inference_request_success`` becomes ``..._success_total``), so that is matched too.
        """
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n in (name, f"{name}_total") and wanted <= set(ls))


def scrape(metrics_url: str, model: str = "llm", timeout_s: float = 5.0) -> Snapshot:
    """The samples labelled ``model=<model>`` (Triton's own and the engine's).

    Raises:
        requests.RequestException: the metrics endpoint cannot be reached.
    """
    response = requests.get(metrics_url, timeout=timeout_s)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.labels.get("model") == model:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return Snapshot(samples)


def idle_gauges(snapshot: Snapshot) -> dict[str, float]:
    """Running and waiting requests, KV blocks in use and KV usage (0..1), summed over versions."""
    values = {name: snapshot.total(name) for name in IDLE_GAUGES}
    values["llm_kv_cache_usage_ratio"] = snapshot.total("llm_kv_cache_usage_ratio")
    return values


def is_idle(snapshot: Snapshot) -> bool:
    return all(value == 0 for value in idle_gauges(snapshot).values())


def wait_for_idle(metrics_url: str, timeout_s: float, interval_s: float = 0.5,
                  model: str = "llm") -> tuple[bool, Snapshot, float]:
    """Polls until the server is idle or ``timeout_s`` passes: (idle, the last snapshot, seconds waited).

    Idle is two scrapes in a row, ``interval_s`` apart, with the idle gauges at 0 and every sample unchanged:
    the model publishes its metrics every 0.25 s at most, so a single scrape can read gauges that are 0 from
    before the last requests ran and counters that do not count them yet."""
    start = time.monotonic()
    previous = None
    while True:
        snapshot = scrape(metrics_url, model)
        waited = time.monotonic() - start
        settled = is_idle(snapshot) and previous is not None and previous.samples == snapshot.samples
        if settled or waited >= timeout_s:
            return settled, snapshot, waited
        previous = snapshot
        time.sleep(interval_s)


def run_deltas(before: Snapshot, after: Snapshot) -> dict[str, float | None]:
    """What the server counted during the run: requests by outcome, tokens, preemptions, prompt tokens looked
    up in and found in the prefix cache, and the mean server-side TTFT / TPOT / e2e latency (seconds) of the
    requests that finished in it (None when none did)."""
    def delta(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    deltas = {
        "triton_success": delta("nv_inference_request_success"),
        "triton_failure": delta("nv_inference_request_failure"),
        **{f"finished_{reason}": delta("llm_request_finished_total", finish_reason=reason)
           for reason in FINISH_REASONS},
        "prompt_tokens": delta("llm_prompt_tokens_total"),
        "generation_tokens": delta("llm_generation_tokens_total"),
        "preemptions": delta("llm_num_preemptions_total"),
        "prefix_cache_queries": delta("llm_prefix_cache_queries_total"),
        "prefix_cache_hits": delta("llm_prefix_cache_hits_total"),
    }
    for key, histogram in (("ttft", "llm_time_to_first_token_seconds"),
                           ("tpot", "llm_time_per_output_token_seconds"),
                           ("e2e", "llm_e2e_request_latency_seconds")):
        count = delta(f"{histogram}_count")
        deltas[f"mean_{key}_s"] = delta(f"{histogram}_sum") / count if count else None
    return deltas
