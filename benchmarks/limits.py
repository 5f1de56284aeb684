"""The machine's physical limits for a model, measured beside a run: what no engine can beat.

* **Memory bandwidth**: the read rate of a 1 GiB buffer summed by torch on the run's threads (best of 5); a
  decode step reads every weight once, so one stream's step cannot be shorter than weight bytes / bandwidth,
  and a batch of B decodes cannot exceed B x bandwidth / weight bytes tokens/s (KV reads come on top).
* **GEMM peak**: the rate of a 2048 x 2048 x 2048 matmul in the run's dtype (best of 5); a token costs about
  2 x parameters FLOPs, so no engine exceeds peak / (2 x parameters) tokens/s, prefill or decode. bf16 on a CPU
  without bf16 multiply-adds (no AVX512-BF16, no AMX) runs on the fp32 units (our kernels widen the weights in
  registers), so fp32's matmul rate is its peak there; torch's own bf16 matmul on such a CPU is far below it.

The roofline model of Williams, Waterman and Patterson (CACM 2009) on one axis each.
"""

from __future__ import annotations

import time

GIB = 1 << 30


def measure_bandwidth_gbps(threads: int, repeats: int = 5) -> float:
    """GB/s (1e9 bytes) read by ``torch.sum`` over a 1 GiB float32 buffer, best of ``repeats``."""
    import torch

    torch.set_num_threads(threads)
    buffer = torch.ones(GIB // 4, dtype=torch.float32)
    buffer.sum()
    best = min(_timed(lambda: buffer.sum()) for _ in range(repeats))
    return GIB / best / 1e9


def measure_gemm_gflops(dtype: str, threads: int, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of an ``n`` x ``n`` x ``n`` matmul in ``dtype``, best of ``repeats``."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(n, n).to(getattr(torch, dtype))
    b = torch.randn(n, n).to(getattr(torch, dtype))
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def peak_dtype(dtype: str) -> str:
    """The dtype whose matmul rate bounds GEMMs in ``dtype`` on this CPU: float32 for bfloat16 without bf16
    multiply-adds (no AVX512-BF16, no AMX), ``dtype`` itself otherwise."""
    from backend.config import cpu_has_native_bf16

    return "float32" if dtype == "bfloat16" and not cpu_has_native_bf16() else dtype


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_limits(model_dir: str, dtype: str, threads: int, quantization: str = "none") -> dict:
    """The measured bandwidth and GEMM peak, the model's weight bytes per step (in ``dtype``, or int8 with their
    scales for ``quantization`` int8 or w8a8) and parameters, and the bounds they set: the shortest decode step (one
    stream's ITL floor, ms), decode tokens/s per stream in the batch (memory bound), and tokens/s at the GEMM peak
    (compute bound)."""
    from transformers import AutoConfig

    from benchmarks.memory_floor import int8_weight_bytes, weight_bytes

    config = AutoConfig.from_pretrained(model_dir)
    params = weight_bytes(config, 1)
    int8 = quantization in ("int8", "w8a8")
    weights = int8_weight_bytes(config) if int8 else weight_bytes(config, 4 if dtype == "float32" else 2)
    bandwidth = measure_bandwidth_gbps(threads)
    gemm_dtype = peak_dtype(dtype)
    peak = measure_gemm_gflops(gemm_dtype, threads)
    return {"bandwidth_gbps": bandwidth, "gemm_gflops": peak, "gemm_dtype": gemm_dtype, "weight_bytes_per_step": weights,
            "weight_format": "int8" if int8 else dtype,
            "matmul_parameters": params, "itl_floor_ms": 1e3 * weights / (bandwidth * 1e9),
            "decode_tokens_per_s_per_stream_bound": bandwidth * 1e9 / weights,
            "compute_bound_tokens_per_s": peak * 1e9 / (2 * params)}


def markdown(limits: dict, quantization: str = "none") -> str:
    """The limits as a sentence. With ``quantization`` w8a8 the GEMMs multiply int8, so the float GEMM peak is
    given without the bound it would set."""
    compute = (f"a {limits['gemm_dtype']} GEMM peak of {limits['gemm_gflops']:.0f} GFLOP/s gives at most "
               f"{limits['compute_bound_tokens_per_s']:.0f} tokens/s at any batch")
    if quantization == "w8a8":
        compute = (f"w8a8's GEMMs multiply int8 and are not bound by the {limits['gemm_dtype']} GEMM peak of "
                   f"{limits['gemm_gflops']:.0f} GFLOP/s")
    return (f"Physical limits on this machine: memory read {limits['bandwidth_gbps']:.1f} GB/s and "
            f"{limits['weight_bytes_per_step'] / 1e9:.2f} GB of {limits.get('weight_format', limits['gemm_dtype'])} "
            f"weights per step give a decode step of at least "
            f"{limits['itl_floor_ms']:.1f} ms (one stream's ITL floor; a batch of B at most "
            f"{limits['decode_tokens_per_s_per_stream_bound']:.1f} x B tokens/s); {compute}.")
