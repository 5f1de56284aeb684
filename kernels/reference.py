"""Plain PyTorch references for the paged-attention kernels.

Slow and simple on purpose: they loop over sequences, gather each sequence's
keys and values out of the paged cache through its block table, and run
ordinary softmax attention in fp32. The Triton kernels are tested against
them. Shapes and arguments are the same as for the Triton versions (see
`kernels.reshape_and_cache`, `kernels.paged_decode_attention` and
`kernels.paged_prefill_attention`).
"""

import torch


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the caches
    at slot_mapping (slot = block_id * block_size + offset); slots < 0 are skipped."""
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[valid].to(value_cache.dtype)


def gather_context(cache, block_table, context_len):
    """Return the first context_len tokens of one sequence, [context_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:context_len]


def _attend(query, key, value, scale, query_positions, sliding_window=None, softcap=None, sinks=None):
    """Causal attention of queries at query_positions over keys at positions 0..len(key)-1.

    query [q_len, num_heads, head_dim]; key/value [context_len, num_kv_heads, head_dim].
    A window W keeps keys position - W + 1 .. position; softcap c maps logits to
    c * tanh(logits / c); sinks [num_heads] join each softmax as one extra logit
    that attends to nothing.
    """
    group = query.shape[1] // key.shape[1]
    key = key.float().repeat_interleave(group, dim=1)
    value = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    key_positions = torch.arange(key.shape[0], device=query.device)
    allowed = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed &= key_positions[None, :] > query_positions[:, None] - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, value)
    return out.to(query.dtype)


def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                           sliding_window=None, softcap=None, sinks=None):
    """One query token per sequence attending to its seq_lens[i] cached tokens (the last W with a window)."""
    out = torch.empty_like(query)
    for i, context_len in enumerate(seq_lens.tolist()):
        key = gather_context(key_cache, block_tables[i], context_len)
        value = gather_context(value_cache, block_tables[i], context_len)
        position = torch.tensor([context_len - 1], device=query.device)
        out[i] = _attend(query[i : i + 1], key, value, scale, position, sliding_window, softcap, sinks)[0]
    return out


def paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                            sliding_window=None, softcap=None, sinks=None):
    """Packed variable-length queries attending causally to their cached context."""
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    for i, context_len in enumerate(seq_lens.tolist()):
        begin, end = starts[i], starts[i + 1]
        if begin == end:
            continue
        key = gather_context(key_cache, block_tables[i], context_len)
        value = gather_context(value_cache, block_tables[i], context_len)
        positions = torch.arange(context_len - (end - begin), context_len, device=query.device)
        out[begin:end] = _attend(query[begin:end], key, value, scale, positions, sliding_window, softcap, sinks)
    return out
