"""Paged attention plugged into unmodified transformers models through ``AttentionInterface``.

The model computes Q/K/V and RoPE as usual; this function, called once per layer, writes the step's
K/V into the paged pool through the slot mapping and attends over each request's blocks through its
block table (PagedAttention, Kwon et al. SOSP 2023, sec. 4.1). transformers' own continuous batching
registers its attention the same way, so every model family that uses the interface works. The compact
decoder (``backend.models``) calls :func:`paged_attention` directly.

The model runner builds one metadata type per step: :class:`TorchAttentionMetadata` (decodes batched through
gather + SDPA or the C++ kernel of ``kernels/cpu``, prefills one by one) or :class:`KernelAttentionMetadata`
(the Triton kernels of ``kernels/``, the whole batch at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from backend.attention_options import PLAIN, AttentionOptions, attention_options, paged_variant_attention

ATTENTION_NAME = "paged_attention"


@dataclass
class PrefillSpan:
    """One request with several query tokens: packed rows ``[q_start, q_end)``, ``seq_len`` tokens of context
    (cached prefix + the new ones), its block table ``[num_blocks]`` and, when the prefix is not empty, a
    boolean mask ``[q_len, seq_len]`` (True = may attend)."""

    q_start: int
    q_end: int
    seq_len: int
    block_table: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """What every layer needs to write the paged KV cache this step; the model runner builds one of the two
    subclasses, :class:`TorchAttentionMetadata` or :class:`KernelAttentionMetadata`, never both.

    Attributes:
        kv_caches: per layer, (key_cache, value_cache), each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64, the cache slot of each packed token.
        use_kernels: True on :class:`KernelAttentionMetadata` (a class constant).
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor
    use_kernels: ClassVar[bool] = False


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The torch path: decodes batched (gather + SDPA, or the C++ kernel), then one SDPA per prefill.

    Attributes:
        num_decodes: the first ``num_decodes`` packed tokens are single-token queries, one per request.
        decode_block_tables: ``[num_decodes, max_blocks]`` int64 (contiguous with ``cpu_kernel``).
        decode_mask: ``[num_decodes, 1, 1, max_blocks * block_size]`` bool, True for keys within each seq_len
            (None with ``cpu_kernel``, which takes ``decode_seq_lens``).
        decode_seq_lens: ``[num_decodes]`` int64, context length including the new token.
        prefills: the multi-token requests, after the decodes.
        workspace: the model runner's reused gather buffers.
        cpu_kernel: decodes and prefills through the C++ kernels of ``kernels/cpu`` (blocks read in place)
            instead of gather + SDPA.
        prefill_block_tables / prefill_cu_seqlens / prefill_seq_lens: with ``cpu_kernel``, the prefills for the
            C++ kernel: ``[num_prefills, max_blocks]``, ``[num_prefills + 1]`` (rows counted from
            ``num_decodes``), ``[num_prefills]``, int64, contiguous.
    """

    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_mask: torch.Tensor | None
    decode_seq_lens: torch.Tensor
    prefills: list[PrefillSpan]
    workspace: GatherWorkspace
    cpu_kernel: bool = False
    prefill_block_tables: torch.Tensor | None = None
    prefill_cu_seqlens: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None


@dataclass
class KernelAttentionMetadata(AttentionMetadata):
    """The Triton kernels of ``kernels/``: the batch in varlen form, all int32 as the kernels require. The
    first ``num_decodes`` requests have one query row each and go through the decode kernel (split-K over the
    context, Flash-Decoding); the rest through the prefill kernel, with their own slices of the tensors.

    Attributes:
        num_decodes: requests (and packed rows) at the front with a single query token.
        decode_seq_lens / decode_block_tables: ``[num_decodes]`` / ``[num_decodes, max_blocks]`` int32.
        cu_seqlens_q: ``[num_prefills + 1]`` int32, packed query rows of each later request, counted from row
            ``num_decodes``.
        seq_lens: ``[num_prefills]`` int32, context length of each later request after this step.
        block_tables: ``[num_prefills, max_blocks]`` int32.
    """

    num_decodes: int
    decode_seq_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    use_kernels: ClassVar[bool] = True
    cpu_kernel: ClassVar[bool] = False


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry point.

    Args:
        query: ``[1, num_heads, num_tokens, head_dim]`` (all scheduled tokens packed, no padding).
        key, value: ``[1, num_kv_heads, num_tokens, head_dim]``.
        kwargs: must hold ``attention_metadata`` (an :class:`AttentionMetadata` subclass); ``sliding_window``,
            ``softcap`` and ``s_aux`` (sinks) are honoured, see :mod:`backend.attention_options`.

    Returns:
        ``([1, num_tokens, num_heads, head_dim], None)``.

    Raises:
        RuntimeError: called without ``attention_metadata`` (the model was run outside the engine).
        UnsupportedAttentionError: a keyword this engine does not implement (never silently ignored).
    """
    meta: AttentionMetadata | None = kwargs.get("attention_metadata")
    if meta is None:
        raise RuntimeError(f"{ATTENTION_NAME} needs attention_metadata; run the model through the engine")
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    options = attention_options(module, {"dropout": dropout, **kwargs})
    return paged_attention(q, k, v, module.layer_idx, scale, meta, options).unsqueeze(0), None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float,
                    meta: AttentionMetadata, options: AttentionOptions = PLAIN) -> torch.Tensor:
    """Writes this step's K/V of layer ``layer_idx`` into the paged pool and attends over each request's blocks.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]`` (any strides).
        scale: the softmax scale, usually ``head_dim ** -0.5``.
        meta: :class:`KernelAttentionMetadata` (Triton kernels) or :class:`TorchAttentionMetadata`.
        options: the layer's sliding window, soft-cap and sinks; layers with any of them take the Triton kernels'
            parameters or, on the torch path, :func:`backend.attention_options.paged_variant_attention` (the C++
            decode kernel does plain causal attention only).

    Returns:
        ``[num_tokens, num_heads, head_dim]``, contiguous.
    """
    key_cache, value_cache = meta.kv_caches[layer_idx]
    if meta.use_kernels:
        import kernels

        kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        variant = {"sliding_window": options.sliding_window, "softcap": options.softcap, "sinks": options.sinks}
        nd = meta.num_decodes
        if nd == q.shape[0]:
            return kernels.paged_decode_attention(q, key_cache, value_cache, meta.decode_block_tables,
                                                  meta.decode_seq_lens, scale, **variant)
        prefill = kernels.paged_prefill_attention(q[nd:], key_cache, value_cache, meta.block_tables,
                                                  meta.cu_seqlens_q, meta.seq_lens, scale, **variant)
        if nd == 0:
            return prefill
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        out[:nd] = kernels.paged_decode_attention(q[:nd], key_cache, value_cache, meta.decode_block_tables,
                                                  meta.decode_seq_lens, scale, **variant)
        out[nd:] = prefill
        return out

    written = False
    if meta.cpu_kernel:
        import kernels.cpu

        written = kernels.cpu.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
    if not written:
        write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
    if not options.is_plain:
        return paged_variant_attention(q, key_cache, value_cache, meta, options, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.num_decodes and meta.cpu_kernel:
        import kernels.cpu

        kernels.cpu.paged_decode_attention(q[: meta.num_decodes], key_cache, value_cache, meta.decode_block_tables,
                                           meta.decode_seq_lens, scale, out=out[: meta.num_decodes])
    elif meta.num_decodes:
        out[: meta.num_decodes] = decode_attention(q[: meta.num_decodes], key_cache, value_cache,
                                                   meta.decode_block_tables, meta.decode_mask, scale,
                                                   meta.workspace)
    if meta.prefills and meta.cpu_kernel:
        import kernels.cpu

        nd = meta.num_decodes
        rows = q[nd:]  # the compact decoder's q is a view of the fused QKV output: rows contiguous, read in place
        if rows.stride(2) != 1 or rows.stride(1) != rows.shape[2]:
            rows = rows.contiguous()
        if kernels.cpu.paged_prefill_attention(rows, key_cache, value_cache, meta.prefill_block_tables,
                                               meta.prefill_cu_seqlens, meta.prefill_seq_lens, scale, out=out[nd:]):
            return out
    for span in meta.prefills:
        out[span.q_start:span.q_end] = prefill_attention(q[span.q_start:span.q_end], key_cache, value_cache,
                                                         span, scale)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` at their slots of the pool."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, mask: torch.Tensor, scale: float,
                     workspace: GatherWorkspace) -> torch.Tensor:
    """One query token per request, requests in groups small enough that their gathered K/V stay in cache.

    Grouped-query attention without copying K/V per head: the ``num_heads // num_kv_heads`` query heads
    that share a KV head become that head's query rows. Each group's blocks are gathered into one reused
    workspace (no fresh allocation per layer: large ones cost a page fault per 4 KiB on every step) and
    attended at once, while still in the CPU's cache.

    Args:
        q: ``[batch, num_heads, head_dim]``; block_tables ``[batch, max_blocks]``; mask ``[batch, 1, 1, keys]``.

    Returns:
        ``[batch, num_heads, head_dim]``.
    """
    batch, num_heads, head_dim = q.shape
    max_blocks = block_tables.shape[1]
    block_size, num_kv_heads = key_cache.shape[1:3]
    q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(q)
    block_bytes = block_size * num_kv_heads * head_dim * key_cache.element_size()
    group = max(1, min(batch, DECODE_GROUP_BYTES // (max_blocks * block_bytes)))
    keys_ws = workspace.get(0, key_cache, group * max_blocks)
    values_ws = workspace.get(1, value_cache, group * max_blocks)
    for begin in range(0, batch, group):
        end = min(batch, begin + group)
        rows = end - begin
        tables = block_tables[begin:end].reshape(-1)
        keys = torch.index_select(key_cache, 0, tables, out=keys_ws[: rows * max_blocks])
        values = torch.index_select(value_cache, 0, tables, out=values_ws[: rows * max_blocks])
        keys = keys.view(rows, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
        values = values.view(rows, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
        out[begin:end] = F.scaled_dot_product_attention(q[begin:end], keys, values, attn_mask=mask[begin:end],
                                                        scale=scale)
    return out.reshape(batch, num_heads, head_dim)


DECODE_GROUP_BYTES = 4 << 20
"""Gathered keys per decode group (values as much again): both fit a server CPU's last-level cache. Measured on
2 cores, 32 MiB L3, decode at batch 256: one gather of the whole batch 610-920 ms a step, 4 MiB groups 545 ms."""


class GatherWorkspace:
    """Reused buffers for gathered blocks, one for keys and one for values; they grow and never shrink.
    Owned by one model runner (one engine thread), so never shared between concurrent forward passes."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def get(self, which: int, like: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """A ``[>= num_blocks, *like.shape[1:]]`` buffer of ``like``'s dtype and device (``which``: 0 keys, 1 values)."""
        buffer = self._buffers.get(which)
        if (buffer is None or buffer.shape[0] < num_blocks or buffer.shape[1:] != like.shape[1:]
                or buffer.dtype != like.dtype or buffer.device != like.device):
            buffer = torch.empty((num_blocks, *like.shape[1:]), dtype=like.dtype, device=like.device)
            self._buffers[which] = buffer
        return buffer


def prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      span: PrefillSpan, scale: float) -> torch.Tensor:
    """Several query tokens of one request, causal, over its cached prefix and themselves.

    Args:
        q: ``[q_len, num_heads, head_dim]``.

    Returns:
        ``[q_len, num_heads, head_dim]``.
    """
    keys = _gather(key_cache, span.block_table[None])[:, :, : span.seq_len]  # [1, num_kv_heads, seq_len, head_dim]
    values = _gather(value_cache, span.block_table[None])[:, :, : span.seq_len]
    q = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=span.mask, is_causal=span.mask is None,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, kv_heads, head_dim]`` -> ``[batch, kv_heads, max_blocks * block_size, head_dim]``."""
    batch, max_blocks = block_tables.shape
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    blocks = cache.index_select(0, block_tables.reshape(-1))
    return blocks.view(batch, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
