"""Paged prefill attention: packed variable-length queries over a paged KV cache.

Ideas and sources:
- Paged KV cache and block tables: PagedAttention (Kwon et al., SOSP 2023).
- Tiled causal attention with online softmax (running max and running sum of
  exponentials, fp32 accumulation): FlashAttention-2 (Dao, 2023).

The new tokens' keys and values are read back from the cache (they were written
there by `reshape_and_cache` first), so a prefill with a cached prefix, a fresh
prefill and a decode step are all the same case: query token j of a sequence
with q_len new tokens and seq_len tokens in all sits at position
seq_len - q_len + j and attends to keys 0 .. that position.

Variants (the keywords transformers passes to attention functions):
- sliding window W: keys p - W + 1 .. p only (Mistral, Gemma 2/3's local layers;
  transformers' `sliding_window_overlay`); tiles wholly before the window are skipped.
- logit soft-capping: softcap * tanh(logits / softcap) (Gemma 2).
- attention sinks: one learned logit per query head in every softmax's
  denominator (Xiao et al., ICLR 2024; GPT-OSS's `s_aux`).

Each program handles BLOCK_M query tokens of one sequence and one query head;
the grid is flat over all sequences' query tiles, so mixed batches of long
prefills and many decodes launch no idle programs beyond one per sequence.
"""

import torch
import triton
import triton.language as tl

from ._validation import (
    check_batch,
    check_caches,
    check_query,
    check_same_device,
    check_tensor,
    check_variants,
    last_dim_contiguous,
)

BLOCK_M = 64  # query tokens per program
TILE_N = 64  # context tokens per loop iteration (may span several cache blocks)


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, q_tile, num_seqs, BLOCK_M: tl.constexpr):
    """Binary search for the sequence owning global query tile q_tile.

    Sequence i owns tiles cu_seqlens_q[i] // BLOCK_M + i onwards, at least
    cdiv(q_len_i, BLOCK_M) of them, so the grid needs no longest query length.
    """
    low = 0
    high = num_seqs
    while low < high:
        mid = (low + high) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_M + mid <= q_tile:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _softcap(scores, softcap):
    """softcap * tanh(scores / softcap), tanh written with exp (saturates cleanly to +-1 in fp32)."""
    x = scores / softcap
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr,
    sinks_ptr,
    scale, softcap, window,
    num_seqs,
    stride_q_token, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    stride_out_token, stride_out_head,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, tl.program_id(0), num_seqs, BLOCK_M)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    q_tile = tl.program_id(0) - (q_begin // BLOCK_M + seq)
    if q_tile * BLOCK_M >= q_len:  # spare tile of this sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    kv_head = head // QUERIES_PER_KV

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    q_positions = prefix_len + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(query_ptr + (q_begin + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    log2e = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    kv_end = tl.minimum(seq_len, prefix_len + (q_tile + 1) * BLOCK_M)  # causal: nothing past the last row
    kv_start = prefix_len * 0
    if USE_WINDOW:  # the first row sees keys from its position - window + 1 on
        kv_start = tl.maximum(prefix_len + q_tile * BLOCK_M - window + 1, 0)
    for kv_begin in range(kv_start, kv_end, TILE_N):
        positions = kv_begin + tl.arange(0, TILE_N)
        in_context = positions < kv_end
        block_ids = tl.load(table + positions // BLOCK_SIZE, mask=in_context, other=0).to(tl.int64)
        kv_rows = block_ids * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_slot
        kv_rows += kv_head * stride_cache_head
        k = tl.load(key_cache_ptr + kv_rows[:, None] + dims[None, :], mask=in_context[:, None], other=0.0)
        v = tl.load(value_cache_ptr + kv_rows[:, None] + dims[None, :], mask=in_context[:, None], other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if USE_SOFTCAP:
            scores = _softcap(scores, softcap)
        scores = scores * log2e
        allowed = in_context[None, :] & (positions[None, :] <= q_positions[:, None])
        if USE_WINDOW:
            allowed = allowed & (positions[None, :] > q_positions[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        # A row may see nothing in this tile (a window starting later): subtract 0 then, so p is 0, not NaN.
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(running_max - safe_max)
        running_sum = running_sum * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        running_max = new_max

    if USE_SINKS:  # the sink's exp joins the denominator (every row saw itself, so running_max is finite)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * log2e
        running_sum += tl.exp2(sink - running_max)
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]  # padded rows may see nothing
    out_ptrs = out_ptr + (q_begin + rows)[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                            sliding_window=None, softcap=None, sinks=None):
    """Causal attention of packed variable-length queries over their paged KV cache.

    Sequence i owns query rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1
    (q_len_i of them). Its query token j sits at position seq_lens[i] - q_len_i + j
    and attends to keys 0 .. that position, all of which must already be in the
    cache, the new tokens included (call `reshape_and_cache` first). Batches may
    mix prefills with a cached prefix, fresh prefills and decodes (q_len 1).
    Online softmax in fp32 (FlashAttention-2). With a sliding window only keys
    position - sliding_window + 1 .. position are read (their blocks may be
    freed placeholders elsewhere in the table).

    Args:
        query: [total_q_tokens, num_heads, head_dim], fp16, bf16 or fp32.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim],
            contiguous, same dtype as query. head_dim must be a power of two >= 16.
            Query head h reads kv head h // (num_heads // num_kv_heads) (GQA/MQA).
        block_tables: int32 [num_seqs, max_blocks_per_seq]; entry j is the cache block
            holding tokens j * block_size .. (j + 1) * block_size - 1.
        cu_seqlens_q: int32 [num_seqs + 1], cumulative query lengths starting at 0
            and ending at total_q_tokens. Not range-checked.
        seq_lens: int32 [num_seqs], tokens per sequence including its new query
            tokens; seq_lens[i] >= q_len_i. Not range-checked.
        scale: softmax scale, usually head_dim ** -0.5.
        sliding_window: None, or W >= 1: each query sees W keys, itself included
            (transformers' semantics).
        softcap: None, or c > 0: logits (after scale) become c * tanh(logits / c).
        sinks: None, or [num_heads] per-head sink logits (any float dtype) added to
            each softmax's denominator.

    Returns:
        [total_q_tokens, num_heads, head_dim] tensor, dtype of query.

    Raises:
        ValueError: on wrong ranks, shapes or dtypes, num_heads not a multiple of
            num_kv_heads, head_dim not a power of two, tensors on different devices,
            a window < 1, a softcap <= 0 or sinks not of shape [num_heads].
    """
    _, block_size, num_kv_heads, head_dim = check_caches(key_cache, value_cache)
    num_heads = check_query(query, key_cache)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, torch.int32)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 entries, got an empty tensor")
    check_batch(block_tables, seq_lens, num_seqs)
    check_same_device(query=query, key_cache=key_cache, value_cache=value_cache,
                      block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
    query, block_tables = last_dim_contiguous(query), last_dim_contiguous(block_tables)
    sinks = check_variants(sliding_window, softcap, sinks, num_heads, query)

    out = torch.empty_like(query)
    total_q_tokens = query.shape[0]
    if total_q_tokens == 0 or num_seqs == 0:
        return out
    grid = (total_q_tokens // BLOCK_M + num_seqs, num_heads)  # see _find_sequence
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out,
        sinks if sinks is not None else out,  # a placeholder pointer when unused
        scale, float(softcap or 0.0), int(sliding_window or 0),
        num_seqs,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=BLOCK_M,
        TILE_N=TILE_N,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None,
    )
    return out
