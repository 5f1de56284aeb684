"""What a system run produces (per-request timings) and how it becomes the reported figures.

All times are ``time.perf_counter()`` seconds; latencies are reported in seconds (ITL in milliseconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """One request as a system served it.

    Attributes:
        arrival: when the request was due (run start + its arrival offset; in the concurrent mode, when it was
            sent: once a slot freed); latencies start here.
        token_times: when each output token became visible to the caller (empty if the system cannot stream).
        finish: when the whole answer was available to the caller.
        num_output_tokens: tokens the system produced for this request (static batching counts only the
            request's own length; padding rows past it are not useful tokens).
    """

    index: int
    arrival: float
    expected_tokens: int
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    num_output_tokens: int = 0

    @property
    def ttft(self) -> float:
        """Time to first token, s; the end-to-end latency where no token was seen before the end."""
        return (self.token_times[0] if self.token_times else self.finish) - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    def gaps(self) -> list[float]:
        """Inter-token gaps, s."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class SystemRun:
    """One system in one mode.

    Attributes:
        start: run start (arrival offsets count from here).
        streams: whether token_times are real per-token times.
        mean_batch: mean running batch size (how it was measured: ``batch_source``).
        kv: our engine's KV use: ``stored_tokens``, ``reserved_slots`` (sums over step samples),
            ``stored_per_reserved`` and ``waste_pct``.
        timeline: per-step samples for the plots (our engine).
    """

    system: str
    mode: str
    records: list[RequestRecord]
    start: float
    streams: bool = True
    mean_batch: float | None = None
    batch_source: str = ""
    preemptions: int | None = None
    kv: dict | None = None
    timeline: dict | None = None
    notes: list[str] = field(default_factory=list)
    first_tokens: dict[int, list[int]] | None = None  # request index -> its first 16 output token ids


def summarize(run: SystemRun) -> dict:
    """The reported figures of one run (JSON-ready; None where a figure does not apply)."""
    done = [r for r in run.records if r.finish is not None]
    duration = max(r.finish for r in done) - run.start
    tokens = sum(r.num_output_tokens for r in done)
    gaps = [g for r in done for g in r.gaps()] if run.streams else []
    return {
        "system": run.system, "mode": run.mode, "requests": len(done),
        "output_tokens": tokens, "expected_tokens": sum(r.expected_tokens for r in run.records),
        "duration_s": duration, "output_tokens_per_s": tokens / duration, "requests_per_s": len(done) / duration,
        "streams": run.streams,
        **_percentiles("ttft_s", [r.ttft for r in done]),
        # where the requests arrive in a burst and then one by one (the closed loop), TTFT falls in two groups
        # and p50 can sit between them: the mean counts both
        "ttft_s_mean": float(np.mean([r.ttft for r in done])) if done else None,
        **_percentiles("itl_ms", [g * 1e3 for g in gaps]),
        **_percentiles("e2e_s", [r.e2e for r in done]),
        "mean_batch": run.mean_batch, "batch_source": run.batch_source, "preemptions": run.preemptions,
        "kv": run.kv, "notes": run.notes, "timeline": run.timeline, "first_tokens": run.first_tokens,
        "latencies": {"ttft_s": [r.ttft for r in done], "e2e_s": [r.e2e for r in done]},
    }


def _percentiles(name: str, values: list[float]) -> dict:
    if not values:
        return {f"{name}_p50": None, f"{name}_p99": None}
    p50, p99 = np.percentile(values, [50, 99])
    return {f"{name}_p50": float(p50), f"{name}_p99": float(p99)}


def busy_mean(intervals: list[tuple[float, float]]) -> float:
    """Mean number of open intervals while at least one is open: total interval length / length of their union."""
    union, reach = 0.0, -math.inf
    for begin, end in sorted(intervals):
        union += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    total = sum(end - begin for begin, end in intervals)
    return total / union if union > 0 else float(len(intervals))


def is_finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0
