"""The machine's own arithmetic rate, sampled before each system's round of a benchmark of several rounds.

On small cloud machines the rate a plain matmul gets can move by 2x from one second to the next with nothing else
running in the guest and almost no steal time counted (an Intel Xeon with AMX, 2 vCPUs under KVM: a 2048^3 bf16 matmul
at 394-800 GFLOP/s, fp32 at 166-260, samples 3 s apart; docs/performance.md). An engine's spread between rounds
means little without the machine's beside it: :func:`sample_gemm_rate` measures it before each system's round
(before the system is built, so with nothing else of ours running), and the report puts the samples next to each
round's tokens/s. A 2 s sample before a run of a minute shows how much the machine moves, not its rate during the
run.
"""

from __future__ import annotations

import statistics
import time

PROBE_SECONDS = 2.0  # per run: at least this long, at least MIN_SAMPLES samples
PROBE_N = 1024  # the matmul's size: n x n x n, 2.1 GFLOP
SAMPLE_SECONDS = 0.05  # a sample is as many matmuls as take about this long (timer noise well below 1%)
MIN_SAMPLES = 5


def sample_gemm_rate(dtype: str, threads: int, seconds: float = PROBE_SECONDS, n: int = PROBE_N) -> list[float]:
    """GFLOP/s of back-to-back ``n`` x ``n`` x ``n`` matmuls in ``dtype`` on ``threads`` threads, one figure per
    sample of about :data:`SAMPLE_SECONDS`, sampled for ``seconds`` (at least :data:`MIN_SAMPLES` samples).

    ``dtype`` is the run's (``float32`` or ``bfloat16``); bf16 on a CPU without bf16 multiply-adds samples fp32's
    rate, which bounds our kernels there (:func:`benchmarks.limits.peak_dtype`). Leaves torch's thread count at
    ``threads``.

    Raises:
        ValueError: ``seconds`` is not positive or ``n`` < 1.
    """
    import torch

    from benchmarks.limits import peak_dtype

    if not seconds > 0 or n < 1:
        raise ValueError(f"seconds must be positive and n at least 1, got {seconds} and {n}")
    torch.set_num_threads(threads)
    kind = getattr(torch, peak_dtype(dtype))
    a, b = torch.randn(n, n).to(kind), torch.randn(n, n).to(kind)
    a @ b  # packing and thread start-up, not sampled
    start = time.perf_counter()
    a @ b
    repeats = max(1, round(SAMPLE_SECONDS / max(time.perf_counter() - start, 1e-6)))
    flops = 2 * n**3 * repeats
    samples: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(samples) < MIN_SAMPLES:
        begin = time.perf_counter()
        for _ in range(repeats):
            a @ b
        samples.append(flops / (time.perf_counter() - begin) / 1e9)
    return samples


def summarize_rates(samples: list[float]) -> dict:
    """Min, median and max of GFLOP/s samples, and their spread ``(max - min) / median`` in percent.

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("no samples")
    median = statistics.median(samples)
    return {"min": min(samples), "median": median, "max": max(samples),
            "spread_pct": 100 * (max(samples) - min(samples)) / median, "samples": len(samples)}
