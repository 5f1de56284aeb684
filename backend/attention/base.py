"""The attention-backend interface: a backend names its metadata builder and its implementation.

vLLM v1 has this shape (``vllm/v1/attention/backends/``): the model calls one attention function per layer with the
step's metadata, and the metadata's backend decides which kernel runs. Here each backend is a class with
``name``, ``builder`` (turns the step's batch into the backend's :class:`AttentionMetadata`) and ``impl`` (writes the
step's K/V into the paged pool and attends: PagedAttention, Kwon et al. SOSP 2023, sec. 4.1). The selector
(:mod:`backend.attention.selector`) picks one per engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from backend.attention_options import AttentionOptions


@dataclass
class AttentionMetadata:
    """What every layer needs this step; each backend's builder makes its own subclass.

    Attributes:
        kv_caches: per layer, (key_cache, value_cache), each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64, the cache slot of each packed token.
        num_decodes: the first ``num_decodes`` packed tokens are decodes, one per request (the scheduler puts
            them first: ``backend.scheduler_output.is_decode``).
        decode_seq_lens: ``[num_decodes]``, context length including the new token.
        decode_block_tables: ``[num_decodes, max_blocks]``.
        impl: the backend implementation that attends with this metadata (a class constant of each subclass).
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_seq_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    impl: ClassVar[type[AttentionImpl]]


@dataclass
class StepBatch:
    """The step's batch as the model runner packs it (CPU tensors), the input of every metadata builder.

    Attributes:
        counts / starts: per request, query tokens this step and tokens computed before it.
        seq_lens: ``[num_reqs]`` int64, context length after this step; cu_seqlens: ``[num_reqs + 1]`` int64, packed
            rows of each request; block_tables: ``[num_reqs, max_blocks]`` int64; slot_mapping: ``[num_tokens]``
            int64.
    """

    counts: list[int]
    starts: list[int]
    seq_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int  # the requests at the front that decode (one query token each), the rest prefill


class AttentionImpl:
    """One backend's attention: ``forward`` writes K/V and attends (static: the state lives in the metadata)."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                options: AttentionOptions) -> torch.Tensor:
        """Args: q ``[num_tokens, num_heads, head_dim]``; k, v ``[num_tokens, num_kv_heads, head_dim]`` (any
        strides); caches ``[num_blocks, block_size, num_kv_heads, head_dim]``. Returns ``[num_tokens, num_heads,
        head_dim]``, contiguous."""
        raise NotImplementedError


class MetadataBuilder:
    """Builds one backend's metadata per step.

    Args:
        kv_caches: the model runner's per-layer pools; block_size: tokens per block; device: the model's.
    """

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device) -> None:
        self.kv_caches, self.block_size, self.device = kv_caches, block_size, device

    def build(self, batch: StepBatch) -> AttentionMetadata:
        raise NotImplementedError


class AttentionBackend:
    """A backend: its name (the ``attention_backend`` setting's value), metadata builder and implementation.

    Attributes:
        uses_cpu_ops: the model's norms, rotary, SwiGLU and decode-sized GEMMs also run through ``kernels/cpu``
            (:mod:`backend.cpu_ops`), and a whole decode step may go through ``decode_layers`` in one call.
        graphs: pure-decode steps can be captured as CUDA graphs (:mod:`backend.cuda_graphs`).
    """

    name: ClassVar[str]
    builder: ClassVar[type[MetadataBuilder]]
    impl: ClassVar[type[AttentionImpl]]
    uses_cpu_ops: ClassVar[bool] = False
    graphs: ClassVar[bool] = False

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this backend cannot run here (None when it can)."""
        raise NotImplementedError

    @classmethod
    def kv_pool(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One layer's K or V pool, zeroed: ``shape`` ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return torch.zeros(shape, dtype=dtype, device=device)
