"""GPU micro-benchmark of the paged decode attention kernel.

Decode attention reads every cached key and value once and does little
arithmetic on them, so its speed limit is memory bandwidth. This script
measures the device's copy bandwidth, then times `paged_decode_attention`
over a sweep of batch sizes, context lengths and head dims (fp16, GQA with
32 query heads over 8 kv heads, blocks scattered randomly through the cache)
and reports, as markdown tables:

    achieved bandwidth = K/V bytes read / kernel time
    ratio              = achieved bandwidth / copy bandwidth

Copy bandwidth counts bytes read plus bytes written. Times are medians from
triton.testing.do_bench, which flushes the L2 cache before every run. By
default the kernel is also compared with a PyTorch baseline that gathers each
sequence's blocks into contiguous K/V and calls scaled_dot_product_attention.

Usage: python benchmarks/kernel_bench.py [--no-baseline] [--output FILE]
Needs a CUDA GPU; takes about a minute on one H200.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADLINE = (64, 2048)  # (batch, context) of the headline number
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048, 8192)
HEAD_DIMS = (64, 128)
NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE = 32, 8, 16
DTYPE = torch.float16


def bench_ms(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth_gbps(num_bytes=2 << 30):
    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = bench_ms(lambda: target.copy_(source))
    return 2 * num_bytes / ms / 1e6  # read + write


def make_decode_inputs(batch, context, head_dim):
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    key_cache = torch.randn(cache_shape, dtype=DTYPE, device="cuda")
    value_cache = torch.randn(cache_shape, dtype=DTYPE, device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, NUM_HEADS, head_dim, dtype=DTYPE, device="cuda")
    return query, key_cache, value_cache, block_tables, seq_lens


def gather_sdpa_decode(query, key_cache, value_cache, block_tables, context, scale):
    """Baseline: gather every sequence's blocks into contiguous K/V, then SDPA (all at one context length)."""
    batch = block_tables.shape[0]

    def gather(cache):
        tokens = cache[block_tables.long()].flatten(1, 2)[:, :context]  # [batch, context, kv_heads, head_dim]
        return tokens.transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(
        query.unsqueeze(2), gather(key_cache), gather(value_cache), scale=scale, enable_gqa=True
    )
    return out.view(batch, NUM_HEADS, -1)


def bench_decode(batch, context, head_dim, copy_gbps, with_baseline):
    from kernels import paged_decode_attention
    from kernels.decode_attention import choose_num_splits

    inputs = make_decode_inputs(batch, context, head_dim)
    scale = head_dim**-0.5
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * head_dim * DTYPE.itemsize
    ms = bench_ms(lambda: paged_decode_attention(*inputs, scale))
    gbps = kv_bytes / ms / 1e6
    row = {
        "batch": batch,
        "context": context,
        "head_dim": head_dim,
        "splits": choose_num_splits(batch, NUM_KV_HEADS, inputs[3].shape[1] * BLOCK_SIZE, inputs[0].device),
        "K/V MiB": f"{kv_bytes / 2**20:.1f}",
        "kernel us": f"{ms * 1e3:.1f}",
        "GB/s": f"{gbps:.0f}",
        "of copy": f"{gbps / copy_gbps:.2f}",
    }
    if with_baseline:
        baseline_inputs = inputs[:4] + (context, scale)
        baseline_ms = bench_ms(lambda: gather_sdpa_decode(*baseline_inputs))
        max_error = (paged_decode_attention(*inputs, scale) - gather_sdpa_decode(*baseline_inputs)).abs().max().item()
        row["gather+SDPA us"] = f"{baseline_ms * 1e3:.1f}"
        row["speedup"] = f"{baseline_ms / ms:.2f}x"
        row["max abs diff"] = f"{max_error:.1e}"
    del inputs
    torch.cuda.empty_cache()
    return row


def markdown_table(rows):
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row[key]) for key in header) + " |" for row in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-baseline", action="store_true", help="skip the gather + SDPA comparison")
    parser.add_argument("--output", type=Path, help="also write the markdown report to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_bench.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.")

    copy_gbps = copy_bandwidth_gbps()
    device = torch.cuda.get_device_name()
    report = [
        f"# Paged decode attention on {device}",
        "",
        f"Device copy bandwidth (read + write, 2 GiB tensor): **{copy_gbps:.0f} GB/s**",
        f"fp16, {NUM_HEADS} query heads / {NUM_KV_HEADS} kv heads, block size {BLOCK_SIZE}, all sequences "
        "at the same context length; GB/s = K/V bytes read / kernel time.",
        "",
    ]
    batch, context = HEADLINE
    headline = [bench_decode(batch, context, head_dim, copy_gbps, not args.no_baseline) for head_dim in HEAD_DIMS]
    report += [f"## Batch {batch}, context {context}", "", markdown_table(headline), ""]
    sweep = [
        bench_decode(b, c, d, copy_gbps, not args.no_baseline)
        for d in HEAD_DIMS
        for b in BATCHES
        for c in CONTEXTS
        if (b, c) != HEADLINE
    ]
    report += ["## Sweep", "", markdown_table(sweep), ""]

    text = "\n".join(report)
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
