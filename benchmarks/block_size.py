"""What the KV block size costs a CPU decode step: the C++ decode attention and a whole decode step at each size.

``python -m benchmarks.block_size [--rows 24] [--context 600] [--dtype bfloat16] [--block-sizes 16,32,64,128]``:
the default model's layer shapes (SmolLM2-135M: 30 layers, 9 query and 3 KV heads of 64) with random weights, in
one process, the block sizes taking turns call by call (a machine whose speed drifts moves them together). Each
sequence's blocks are interleaved with the others' in the pool, as a batch that grows one block at a time gets
them (``--scattered``: in random order), so that a block is the longest run of one sequence's KV cache in memory.
Prints, per block size: ``paged_decode_attention`` over every layer (median ms and the rate it reads the KV cache
at), and ``decode_layers`` (the whole step's layers: norms, GEMMs, rotary, KV write, attention) in median ms, both
also as a ratio to the first size. Needs the C++ kernels (``kernels/cpu``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _layers(config, dtype: torch.dtype, generator: torch.Generator) -> list[list[torch.Tensor]]:
    """Per layer, the weights ``decode_layers`` takes (random, packed for ``small_gemm``), without the caches."""
    from kernels import cpu

    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads

    def packed(rows: int, cols: int) -> torch.Tensor:
        return cpu.small_gemm_pack((torch.randn(rows, cols, generator=generator) * 0.02).to(dtype))

    none = torch.empty(0, dtype=dtype)
    return [[torch.ones(hidden, dtype=dtype), packed((heads + 2 * kv_heads) * head_dim, hidden), none,
             packed(hidden, heads * head_dim), none, torch.ones(hidden, dtype=dtype),
             packed(2 * config.intermediate_size, hidden), packed(hidden, config.intermediate_size)]
            for _ in range(config.num_hidden_layers)]


def measure(rows: int, context: int, dtype: torch.dtype, block_sizes: list[int], calls: int,
            scattered: bool = False, seed: int = 0) -> list[dict]:
    """Median ms per call of each block size's attention (all layers) and decode step, taking turns.

    Returns:
        One dict per block size: ``block_size``, ``attention_ms``, ``attention_gbps`` (KV bytes read / time),
        ``step_ms``.
    """
    from transformers import AutoConfig

    from backend.model_loader import resolve_model_dir
    from kernels import cpu

    config = AutoConfig.from_pretrained(resolve_model_dir(None))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    generator = torch.Generator().manual_seed(seed)
    weights = _layers(config, dtype, generator)
    setups = []
    for block_size in block_sizes:
        per_seq = (context + block_size - 1) // block_size
        if scattered:
            tables = torch.randperm(rows * per_seq, generator=generator).view(rows, per_seq)
        else:  # block j of every sequence, then block j + 1 of every sequence: as a growing batch takes them
            tables = torch.arange(rows * per_seq).view(per_seq, rows).t()
        tables = tables.contiguous()
        seq_lens = torch.full((rows,), context, dtype=torch.int64)
        slots = tables[:, (context - 1) // block_size] * block_size + (context - 1) % block_size
        caches = [[(torch.randn(rows * per_seq, block_size, kv_heads, head_dim, generator=generator) * 0.5).to(dtype)
                   for _ in range(2)] for _ in weights]
        flat = [t for layer, kv in zip(weights, caches) for t in (*layer, *kv)]
        setups.append((tables, seq_lens, slots, caches, flat))
    hidden = torch.randn(rows, config.hidden_size, generator=generator).to(dtype)
    angles = torch.rand(rows, head_dim) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    query = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
    out = torch.empty_like(query)
    scale = head_dim ** -0.5
    module = cpu._module()
    attention = [[] for _ in block_sizes]
    step = [[] for _ in block_sizes]
    with torch.inference_mode():
        for _ in range(calls):
            for i, (tables, seq_lens, slots, caches, flat) in enumerate(setups):
                start = time.perf_counter()
                for key_cache, value_cache in caches:
                    module.paged_decode_attention(out, query, key_cache, value_cache, tables, seq_lens, scale)
                attention[i].append(time.perf_counter() - start)
                start = time.perf_counter()
                cpu.decode_layers(hidden.clone(), cos, sin, slots, tables, seq_lens, flat, heads, kv_heads, head_dim,
                                  config.rms_norm_eps, scale)
                step[i].append(time.perf_counter() - start)
    kv_bytes = rows * context * kv_heads * head_dim * 2 * dtype.itemsize * config.num_hidden_layers
    return [{"block_size": block_size, "attention_ms": 1e3 * statistics.median(a),
             "attention_gbps": kv_bytes / statistics.median(a) / 1e9, "step_ms": 1e3 * statistics.median(s)}
            for block_size, a, s in zip(block_sizes, attention, step)]


def markdown(results: list[dict]) -> str:
    first = results[0]
    lines = ["| block size | attention, all layers (ms) | KV read (GB/s) | vs first | decode step (ms) | vs first |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['block_size']} | {r['attention_ms']:.2f} | {r['attention_gbps']:.1f} | "
                     f"{r['attention_ms'] / first['attention_ms']:.2f}x | {r['step_ms']:.2f} | "
                     f"{r['step_ms'] / first['step_ms']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.block_size", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=24, help="sequences decoding in the step")
    parser.add_argument("--context", type=int, default=600, help="tokens of each sequence's KV cache")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--block-sizes", default="16,32,64,128", help="comma-separated, the first is the reference")
    parser.add_argument("--calls", type=int, default=40, help="calls of each size, taking turns")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scattered", action="store_true", help="blocks in random order instead of interleaved")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.block_sizes.split(",")]
    if args.rows < 1 or args.context < 1 or args.calls < 1 or not sizes or min(sizes) < 1:
        parser.error("--rows, --context, --calls and every block size must be positive")
    torch.set_num_threads(args.threads)
    results = measure(args.rows, args.context, getattr(torch, args.dtype), sizes, args.calls, args.scattered)
    print(f"{args.rows} sequences of {args.context} tokens, {args.dtype}, {args.threads} threads, "
          f"{'scattered' if args.scattered else 'interleaved'} blocks, {args.calls} calls each, medians:")
    print(markdown(results))


if __name__ == "__main__":
    main()
