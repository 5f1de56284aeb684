"""Paged attention behind one call: ``attention(q, k, v, layer_idx, scale, meta)``.

Model code never asks which kernel runs: the step's metadata was built by the engine's attention backend
(:mod:`backend.attention.selector` picks one of ``torch``, ``cpu``, ``triton`` at load) and names that backend's
implementation. Unmodified transformers models reach the same call through ``AttentionInterface``
(:func:`paged_attention_forward`), as transformers' own continuous batching registers its attention; every model
family that uses the interface works. The compact decoder (``backend.models``) calls :func:`attention` directly.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from backend.attention.base import AttentionBackend, AttentionImpl, AttentionMetadata, MetadataBuilder, StepBatch
from backend.attention.cpu import CPUAttentionMetadata, CPUBackend
from backend.attention.selector import BACKENDS, available_backends, select_attention_backend
from backend.attention.torch_sdpa import GatherWorkspace, TorchAttentionMetadata, TorchSDPABackend, decode_attention
from backend.attention.triton import TritonAttentionMetadata, TritonBackend
from backend.attention_options import PLAIN, AttentionOptions, attention_options

ATTENTION_NAME = "paged_attention"

__all__ = ["ATTENTION_NAME", "BACKENDS", "AttentionBackend", "AttentionImpl", "AttentionMetadata", "CPUBackend",
           "CPUAttentionMetadata", "GatherWorkspace", "MetadataBuilder", "StepBatch", "TorchAttentionMetadata",
           "TorchSDPABackend", "TritonAttentionMetadata", "TritonBackend", "attention", "available_backends",
           "decode_attention", "paged_attention_forward", "select_attention_backend"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float,
              meta: AttentionMetadata, options: AttentionOptions = PLAIN) -> torch.Tensor:
    """Writes this step's K/V of layer ``layer_idx`` into the paged pool and attends over each request's blocks
    (PagedAttention, Kwon et al. SOSP 2023, sec. 4.1), through the backend that built ``meta``.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]`` (any strides).
        scale: the softmax scale, usually ``head_dim ** -0.5``.
        options: the layer's sliding window, soft-cap and sinks (:mod:`backend.attention_options`).

    Returns:
        ``[num_tokens, num_heads, head_dim]``, contiguous.
    """
    key_cache, value_cache = meta.kv_caches[layer_idx]
    return meta.impl.forward(q, k, v, key_cache, value_cache, meta, scale, options)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry point.

    Args:
        query: ``[1, num_heads, num_tokens, head_dim]`` (all scheduled tokens packed, no padding).
        key, value: ``[1, num_kv_heads, num_tokens, head_dim]``.
        kwargs: must hold ``attention_metadata`` (an :class:`AttentionMetadata`); ``sliding_window``, ``softcap``
            and ``s_aux`` (sinks) are honoured, see :mod:`backend.attention_options`.

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
    return attention(q, k, v, module.layer_idx, scale, meta, options).unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
