"""The ``triton`` attention backend: the Triton kernels of ``kernels/``, the whole batch in varlen form.

Decode rows go through the decode kernel (split-K over the context, Flash-Decoding), the rest through the prefill
kernel with their own slices of the tensors; sliding windows, soft-caps and sinks are kernel parameters. On CPU it
runs only under ``TRITON_INTERPRET=1`` (tests). Pure-decode steps of the compact decoder can be captured as CUDA
graphs (:mod:`backend.cuda_graphs`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from backend.attention.base import AttentionBackend, AttentionImpl, AttentionMetadata, MetadataBuilder, StepBatch
from backend.attention_options import AttentionOptions


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """All int32, as the kernels require.

    Attributes:
        decode_seq_lens / decode_block_tables: ``[num_decodes]`` / ``[num_decodes, max_blocks]`` int32.
        cu_seqlens_q: ``[num_prefills + 1]`` int32, packed query rows of each later request, counted from row
            ``num_decodes``.
        seq_lens: ``[num_prefills]`` int32, context length of each later request after this step.
        block_tables: ``[num_prefills, max_blocks]`` int32.
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


class TritonImpl(AttentionImpl):
    @staticmethod
    def forward(q, k, v, key_cache, value_cache, meta: TritonAttentionMetadata, scale: float,
                options: AttentionOptions) -> torch.Tensor:
        import kernels  # imports Triton: only where this backend runs

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


TritonAttentionMetadata.impl = TritonImpl


class TritonMetadataBuilder(MetadataBuilder):
    def build(self, batch: StepBatch) -> TritonAttentionMetadata:
        device, i32, nd = self.device, torch.int32, batch.num_decodes
        return TritonAttentionMetadata(
            kv_caches=self.kv_caches, slot_mapping=batch.slot_mapping.to(device), num_decodes=nd,
            decode_seq_lens=batch.seq_lens[:nd].to(device=device, dtype=i32),
            decode_block_tables=batch.block_tables[:nd].to(device=device, dtype=i32),
            cu_seqlens_q=(batch.cu_seqlens[nd:] - nd).to(device=device, dtype=i32),
            seq_lens=batch.seq_lens[nd:].to(device=device, dtype=i32),
            block_tables=batch.block_tables[nd:].to(device=device, dtype=i32))

    def decode(self, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
               block_tables: torch.Tensor) -> TritonAttentionMetadata:
        """A pure-decode step over tensors already on the device, in the kernels' dtypes (the static buffers of
        :mod:`backend.cuda_graphs`): ``[n]`` int64 slots, ``[n]`` int32 lengths, ``[n, max_blocks]`` int32."""
        return TritonAttentionMetadata(
            kv_caches=self.kv_caches, slot_mapping=slot_mapping, num_decodes=seq_lens.shape[0],
            decode_seq_lens=seq_lens, decode_block_tables=block_tables, cu_seqlens_q=seq_lens.new_zeros(1),
            seq_lens=seq_lens[:0], block_tables=block_tables[:0])


class TritonBackend(AttentionBackend):
    name = "triton"
    builder = TritonMetadataBuilder
    impl = TritonImpl
    graphs = True

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim) -> str | None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return f"the Triton kernels need a CUDA device (the model is on {device}), or TRITON_INTERPRET=1"
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        if head_dim < 16 or head_dim & (head_dim - 1):
            return f"head_dim {head_dim} (the kernels take powers of two >= 16)"
        if device.type != "cuda" and dtype != torch.float32:
            # Under the interpreter bf16/fp16 are emulated on the CPU: their results diverge from transformers'
            # beyond rounding (seen: greedy picks apart by 6 bf16 ulps of the logit), so only fp32 is offered.
            return f"the Triton interpreter on CPU runs the kernels in float32 only (got {dtype})"
        return None
