"""Paged decode attention: one new query token per sequence.

Ideas and sources:
- Paged KV cache and block tables: PagedAttention (Kwon et al., SOSP 2023).
- Single-pass online softmax with a running max and running sum of exponentials,
  fp32 accumulation: FlashAttention-2 (Dao, 2023).
- Split-K over the context ("Flash-Decoding", Dao, Haziza, Massa, Sizov, 2023):
  when the batch alone cannot fill the GPU, each sequence's context is cut into
  num_splits partitions handled by separate programs; each writes a partial
  output with its max and sum of exponentials, and a reduction kernel rescales
  and combines them.

Each program handles one (sequence, kv head, split) and all the query heads that
share that kv head (GQA/MQA), so every key/value tile is read once per group.

Variants, as in `prefill_attention`: a sliding window (only the last W keys are
read and split), logit soft-capping, and per-head attention sinks (added to the
denominator once, in the single split or in the combine pass).
"""

import torch
import triton
import triton.language as tl

from ._validation import (
    check_batch,
    check_caches,
    check_query,
    check_same_device,
    check_variants,
    last_dim_contiguous,
)
from .prefill_attention import _softcap

TILE_N = 64  # context tokens per loop iteration (may span several cache blocks)
MIN_HEAD_GROUP = 16  # tl.dot needs at least 16 rows; padded query heads are masked
MAX_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256
DEFAULT_SM_COUNT = 132  # used when the device cannot be queried (CPU interpreter)


@triton.jit
def _decode_split_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, split_out_ptr, split_max_ptr, split_sum_ptr, sinks_ptr,
    scale, softcap, window,
    stride_q_seq, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    stride_out_seq, stride_out_head,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = seq_len * 0  # the window's first key position (0 without a window)
    if USE_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
    first_tile = first_key // TILE_N
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    group = tl.arange(0, HEAD_GROUP)
    head_valid = group < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + group
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                mask=head_valid[:, None], other=0.0)
    log2e = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))

    running_max = tl.full([HEAD_GROUP], float("-inf"), tl.float32)
    running_sum = tl.zeros([HEAD_GROUP], tl.float32)
    acc = tl.zeros([HEAD_GROUP, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for tile in range(tile_begin, tile_end):
        positions = tile * TILE_N + tl.arange(0, TILE_N)
        in_context = (positions < seq_len) & (positions >= first_key)
        block_ids = tl.load(table + positions // BLOCK_SIZE, mask=in_context, other=0).to(tl.int64)
        rows = block_ids * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_slot
        rows += kv_head * stride_cache_head
        k = tl.load(key_cache_ptr + rows[:, None] + dims[None, :], mask=in_context[:, None], other=0.0)
        v = tl.load(value_cache_ptr + rows[:, None] + dims[None, :], mask=in_context[:, None], other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if USE_SOFTCAP:
            scores = _softcap(scores, softcap)
        scores = tl.where(in_context[None, :], scores * log2e, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # padded head rows see nothing
        p = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(running_max - safe_max)
        running_sum = running_sum * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        running_max = new_max

    # An empty split (or an empty context) keeps sum 0 and writes zeros.
    denominator = running_sum
    if USE_SINKS and NUM_SPLITS == 1:  # with splits, the combine pass adds the sink once
        sink = tl.load(sinks_ptr + heads, mask=head_valid, other=0.0) * log2e
        denominator += tl.exp2(sink - tl.where(running_max == float("-inf"), sink, running_max))
    out = acc / tl.where(denominator > 0, denominator, 1.0)[:, None]
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None])
    else:
        split_row = (seq * QUERIES_PER_KV * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(split_out_ptr + split_row[:, None] * HEAD_DIM + dims[None, :], out, mask=head_valid[:, None])
        tl.store(split_max_ptr + split_row, running_max, mask=head_valid)  # in log2 units
        tl.store(split_sum_ptr + split_row, running_sum, mask=head_valid)


@triton.jit
def _combine_splits_kernel(
    split_out_ptr, split_max_ptr, split_sum_ptr, out_ptr, sinks_ptr,
    stride_out_seq, stride_out_head,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM)
    split_rows = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits

    split_max = tl.load(split_max_ptr + split_rows, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(split_sum_ptr + split_rows, mask=split_valid, other=0.0)
    split_out = tl.load(split_out_ptr + split_rows[:, None] * HEAD_DIM + dims[None, :],
                        mask=split_valid[:, None], other=0.0)

    global_max = tl.max(split_max, axis=0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        global_max = tl.maximum(global_max, sink)
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)  # empty context
    weights = split_sum * tl.exp2(split_max - global_max)  # empty splits: 0 * exp2(-inf) = 0
    total = tl.sum(weights, axis=0)
    if USE_SINKS:
        total += tl.exp2(sink - global_max)
    out = tl.sum(split_out * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty))


def choose_num_splits(num_seqs, num_kv_heads, max_context_len, device):
    """Split the context only when (sequence, kv head) programs alone would not fill the GPU.

    Aims at about two programs per SM, with at least MIN_TOKENS_PER_SPLIT tokens per split.
    """
    if device.type == "cuda":
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sm_count = DEFAULT_SM_COUNT
    programs = num_seqs * num_kv_heads
    by_occupancy = triton.cdiv(2 * sm_count, programs)
    by_length = max(1, max_context_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, num_splits=None,
                           sliding_window=None, softcap=None, sinks=None):
    """Attention of one new query token per sequence over its paged KV cache.

    Sequence i's query sits at position seq_lens[i] - 1 and attends to its keys
    0 .. seq_lens[i] - 1, which must already be in the cache (see
    `reshape_and_cache`). Softmax uses a running max and sum in fp32 (online
    softmax, FlashAttention-2); long contexts with small batches are split over
    several programs and combined afterwards (split-K, Flash-Decoding).

    Args:
        query: [num_seqs, num_heads, head_dim], fp16, bf16 or fp32.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim],
            contiguous, same dtype as query. head_dim must be a power of two >= 16.
            Query head h reads kv head h // (num_heads // num_kv_heads) (GQA/MQA).
        block_tables: int32 [num_seqs, max_blocks_per_seq]; entry j is the cache block
            holding tokens j * block_size .. (j + 1) * block_size - 1. Entries past
            a sequence's last used block are ignored.
        seq_lens: int32 [num_seqs], context length in tokens including the new token.
            A sequence of length 0 gets a zero output. Not range-checked.
        scale: softmax scale, usually head_dim ** -0.5.
        num_splits: number of context partitions per sequence (split-K). None picks
            it from the batch size and the longest possible context
            (max_blocks_per_seq * block_size); 1 disables the reduction pass.
        sliding_window: None, or W >= 1: only keys seq_lens[i] - W .. seq_lens[i] - 1
            are read (W keys, the new token's included: transformers' semantics);
            table entries for blocks wholly before them are never read.
        softcap: None, or c > 0: logits (after scale) become c * tanh(logits / c).
        sinks: None, or [num_heads] per-head sink logits added to each softmax's
            denominator (attention sinks).

    Returns:
        [num_seqs, num_heads, head_dim] tensor, dtype of query.

    Raises:
        ValueError: on wrong ranks, shapes or dtypes, num_heads not a multiple of
            num_kv_heads, head_dim not a power of two, num_splits < 1, tensors
            on different devices, a window < 1, a softcap <= 0 or sinks not of
            shape [num_heads].
    """
    _, block_size, num_kv_heads, head_dim = check_caches(key_cache, value_cache)
    num_heads = check_query(query, key_cache)
    num_seqs = query.shape[0]
    check_batch(block_tables, seq_lens, num_seqs)
    check_same_device(query=query, key_cache=key_cache, value_cache=value_cache,
                      block_tables=block_tables, seq_lens=seq_lens)
    sinks = check_variants(sliding_window, softcap, sinks, num_heads, query)
    if num_splits is None:
        context = block_tables.shape[1] * block_size
        context = min(context, sliding_window) if sliding_window is not None else context
        num_splits = choose_num_splits(num_seqs, num_kv_heads, context, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    query, block_tables = last_dim_contiguous(query), last_dim_contiguous(block_tables)

    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads
    if num_splits == 1:
        split_out = split_max = split_sum = out  # placeholders, not touched by the kernel
    else:
        split_out = query.new_empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32)
        split_max = query.new_empty((num_seqs, num_heads, num_splits), dtype=torch.float32)
        split_sum = torch.empty_like(split_max)

    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, split_out, split_max, split_sum,
        sinks if sinks is not None else out,  # a placeholder pointer when unused
        scale, float(softcap or 0.0), int(sliding_window or 0),
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        QUERIES_PER_KV=queries_per_kv,
        HEAD_GROUP=max(MIN_HEAD_GROUP, triton.next_power_of_2(queries_per_kv)),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        TILE_N=TILE_N,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            split_out, split_max, split_sum, out, sinks if sinks is not None else out,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_POW2=triton.next_power_of_2(num_splits),
            USE_SINKS=sinks is not None,
        )
    return out
