"""Benchmarks.

``python -m benchmarks``: our engine against what a user would otherwise run (transformers ``generate`` one
request at a time and in static batches, transformers' own continuous batching), in process and through
tritonserver, next to the forward-only ceiling; one workload, one model, dtype and thread count.
``benchmarks.profile_engine``: where our engine's step time goes. ``benchmarks.kernel_bench``: the kernels.
"""
