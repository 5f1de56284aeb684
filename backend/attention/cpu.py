"""The ``cpu`` attention backend: the C++ kernels of ``kernels/cpu`` read the paged blocks in place (no gather).

Decodes go through ``paged_decode_attention``, prompt rows through ``paged_prefill_attention`` (head_dim 64 or 128
in fp32 or bf16; other shapes fall back to the ``torch`` backend's per-request SDPA), K/V writes through
``write_kv``. Choosing this backend also runs the model's norms, rotary, SwiGLU and decode-sized GEMMs through
``kernels/cpu`` (``cpu_ops``), and lets the compact decoder run a whole decode step in one call (``decode_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend import cpu_ops
from backend.attention.base import AttentionBackend, AttentionImpl, StepBatch
from backend.attention.torch_sdpa import TorchAttentionMetadata, TorchMetadataBuilder, prefill_spans, write_kv
from backend.attention_options import AttentionOptions, paged_variant_attention


@dataclass
class CPUAttentionMetadata(TorchAttentionMetadata):
    """The torch metadata (its prefill spans serve the shapes the C++ prefill kernel leaves out), decode tables
    contiguous, no decode mask, and the prefills in the C++ kernel's form.

    Attributes:
        prefill_block_tables / prefill_cu_seqlens / prefill_seq_lens: ``[num_prefills, max_blocks]``,
            ``[num_prefills + 1]`` (rows counted from ``num_decodes``), ``[num_prefills]``, int64, contiguous;
            None when the step has no prefill.
    """

    prefill_block_tables: torch.Tensor | None = None
    prefill_cu_seqlens: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None


class CPUImpl(AttentionImpl):
    @staticmethod
    def forward(q, k, v, key_cache, value_cache, meta: CPUAttentionMetadata, scale: float,
                options: AttentionOptions) -> torch.Tensor:
        if not cpu_ops.write_kv(k, v, key_cache, value_cache, meta.slot_mapping):
            write_kv(k, v, key_cache, value_cache, meta.slot_mapping)  # a layout write_kv does not take
        if not options.is_plain:  # the C++ kernels do plain causal attention only
            return paged_variant_attention(q, key_cache, value_cache, meta, options, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            cpu_ops.paged_decode_attention(q[:nd], key_cache, value_cache, meta.decode_block_tables,
                                           meta.decode_seq_lens, scale, out=out[:nd])
        if meta.prefills:
            rows = q[nd:]  # the compact decoder's q is a view of the fused QKV output: rows contiguous, read in place
            if rows.stride(2) != 1 or rows.stride(1) != rows.shape[2]:
                rows = rows.contiguous()
            if not cpu_ops.paged_prefill_attention(rows, key_cache, value_cache, meta.prefill_block_tables,
                                                   meta.prefill_cu_seqlens, meta.prefill_seq_lens, scale,
                                                   out=out[nd:]):
                prefill_spans(q, key_cache, value_cache, meta.prefills, scale, out)
        return out


CPUAttentionMetadata.impl = CPUImpl


class CPUMetadataBuilder(TorchMetadataBuilder):
    decode_mask = False

    def build(self, batch: StepBatch) -> CPUAttentionMetadata:
        fields = self._fields(batch)
        nd = fields["num_decodes"]
        if fields["prefills"]:
            cu = batch.cu_seqlens[nd:]
            fields.update(prefill_block_tables=batch.block_tables[nd:].contiguous(), prefill_cu_seqlens=cu - cu[0],
                          prefill_seq_lens=batch.seq_lens[nd:].contiguous())
        return CPUAttentionMetadata(**fields)


class CPUBackend(AttentionBackend):
    name = "cpu"
    builder = CPUMetadataBuilder
    impl = CPUImpl
    uses_cpu_ops = True

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim) -> str | None:
        if device.type != "cpu":
            return f"the C++ kernels run on CPU, the model is on {device}"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"dtype {dtype}"
        if not cpu_ops.available():
            return "kernels/cpu could not be built here (no C++ compiler; see the log)"
        return None

    @classmethod
    def kv_pool(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """On 2 MiB transparent huge pages where Linux grants them (``cpu_ops.kv_pool_zeros``): a decode step's
        blocks lie scattered over the whole pool, and on 4 KiB pages most block reads first miss the TLB."""
        return cpu_ops.kv_pool_zeros(shape, dtype)
