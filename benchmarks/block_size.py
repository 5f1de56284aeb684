"""What the KV block size and the pool's pages cost a CPU decode step: the C++ decode attention and a whole decode
step at each block size, on the pool's 2 MiB pages or on 4 KiB ones.

``python -m benchmarks.block_size [--rows 24] [--context 600] [--dtype bfloat16] [--block-sizes 16,32,64,128]
[--pages huge|4k|both] [--pool-blocks N]``: the default model's layer shapes (SmolLM2-135M: 30 layers, 9 query and
3 KV heads of 64) with random weights, in one process, the setups taking turns call by call (a machine whose speed
drifts moves them together). Each sequence's blocks are interleaved with the others' in the pool, as a batch that
grows one block at a time gets them (``--scattered``: in random order, anywhere in a pool of ``--pool-blocks``), so
that a block is the longest run of one sequence's KV cache in memory. The pools are on 2 MiB transparent huge pages
as the engine allocates them (``kernels.cpu.kv_pool_zeros``; ``--pages 4k``: torch's allocator, 4 KiB pages;
``both``: each block size on both). Prints, per setup: ``paged_decode_attention`` over every layer (median ms and
the rate it reads the KV cache at), and ``decode_layers`` (the whole step's layers: norms, GEMMs, rotary, KV write,
attention) in median ms, both also as a ratio to the first setup. Needs the C++ kernels (``kernels/cpu``).
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
            scattered: bool = False, seed: int = 0, pages: tuple[str, ...] = ("huge",),
            pool_blocks: int = 0) -> list[dict]:
    """Median ms per call of each setup's attention (all layers) and decode step, taking turns: every block size
    on every kind of ``pages`` (``huge``: the engine's pools, ``kernels.cpu.kv_pool_zeros``; ``4k``: torch's
    allocator). ``pool_blocks``: with ``scattered``, the pool the blocks are drawn from (at least the blocks the
    sequences hold; 0: just those).

    Returns:
        One dict per setup: ``block_size``, ``pages``, ``attention_ms``, ``attention_gbps`` (KV bytes read / time),
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
    for block_size, kind in ((b, k) for b in block_sizes for k in pages):
        per_seq = (context + block_size - 1) // block_size
        num_blocks = max(rows * per_seq, pool_blocks if scattered else 0)
        if scattered:
            tables = torch.randperm(num_blocks, generator=generator)[:rows * per_seq].view(rows, per_seq)
        else:  # block j of every sequence, then block j + 1 of every sequence: as a growing batch takes them
            tables = torch.arange(rows * per_seq).view(per_seq, rows).t()
        tables = tables.contiguous()
        seq_lens = torch.full((rows,), context, dtype=torch.int64)
        slots = tables[:, (context - 1) // block_size] * block_size + (context - 1) % block_size
        shape = (num_blocks, block_size, kv_heads, head_dim)
        caches = []
        for _ in weights:
            pair = []
            for _ in range(2):
                pool = cpu.kv_pool_zeros(shape, dtype) if kind == "huge" else torch.empty(shape, dtype=dtype)
                pair.append(pool.copy_(torch.randn(shape, generator=generator) * 0.5))
            caches.append(pair)
        flat = [t for layer, kv in zip(weights, caches) for t in (*layer, *kv)]
        setups.append((block_size, kind, tables, seq_lens, slots, caches, flat))
    hidden = torch.randn(rows, config.hidden_size, generator=generator).to(dtype)
    angles = torch.rand(rows, head_dim) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    query = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
    out = torch.empty_like(query)
    scale = head_dim ** -0.5
    module = cpu._module()
    attention = [[] for _ in setups]
    step = [[] for _ in setups]
    with torch.inference_mode():
        for _ in range(calls):
            for i, (_, _, tables, seq_lens, slots, caches, flat) in enumerate(setups):
                start = time.perf_counter()
                for key_cache, value_cache in caches:
                    module.paged_decode_attention(out, query, key_cache, value_cache, tables, seq_lens, scale)
                attention[i].append(time.perf_counter() - start)
                start = time.perf_counter()
                cpu.decode_layers(hidden.clone(), cos, sin, slots, tables, seq_lens, flat, heads, kv_heads, head_dim,
                                  config.rms_norm_eps, scale)
                step[i].append(time.perf_counter() - start)
    kv_bytes = rows * context * kv_heads * head_dim * 2 * dtype.itemsize * config.num_hidden_layers
    return [{"block_size": block_size, "pages": kind, "attention_ms": 1e3 * statistics.median(a),
             "attention_gbps": kv_bytes / statistics.median(a) / 1e9, "step_ms": 1e3 * statistics.median(s)}
            for (block_size, kind, *_), a, s in zip(setups, attention, step)]


def markdown(results: list[dict]) -> str:
    first = results[0]
    lines = ["| block size | pages | attention, all layers (ms) | KV read (GB/s) | vs first | decode step (ms) "
             "| vs first |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        pages = "2 MiB" if r["pages"] == "huge" else "4 KiB"
        lines.append(f"| {r['block_size']} | {pages} | {r['attention_ms']:.2f} | {r['attention_gbps']:.1f} | "
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
    parser.add_argument("--pages", choices=("huge", "4k", "both"), default="huge",
                        help="the pools on 2 MiB pages as the engine's (huge), on 4 KiB pages, or each size on both")
    parser.add_argument("--pool-blocks", type=int, default=0,
                        help="with --scattered: the pool's blocks (default: just the sequences' own)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.block_sizes.split(",")]
    if args.rows < 1 or args.context < 1 or args.calls < 1 or not sizes or min(sizes) < 1 or args.pool_blocks < 0:
        parser.error("--rows, --context, --calls and every block size must be positive, --pool-blocks not negative")
    torch.set_num_threads(args.threads)
    pages = ("4k", "huge") if args.pages == "both" else (args.pages,)
    results = measure(args.rows, args.context, getattr(torch, args.dtype), sizes, args.calls, args.scattered,
                      pages=pages, pool_blocks=args.pool_blocks)
    print(f"{args.rows} sequences of {args.context} tokens, {args.dtype}, {args.threads} threads, "
          f"{'scattered' if args.scattered else 'interleaved'} blocks"
          f"{f' in a pool of {args.pool_blocks}' if args.scattered and args.pool_blocks else ''}, "
          f"{args.calls} calls each, medians:")
    print(markdown(results))


if __name__ == "__main__":
    main()
