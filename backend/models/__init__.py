"""Model code of our own for the families that matter most; every other family runs through transformers."""

from __future__ import annotations

import logging

import torch

from backend.models.llama import LlamaDecoder, unsupported_reason

log = logging.getLogger(__name__)


def build_decoder(hf_model, max_model_len: int, cpu_kernels: bool = False) -> torch.nn.Module | None:
    """The compact decoder for ``hf_model`` (a loaded transformers causal LM), or None when its family or
    configuration needs the transformers path (the reason is logged). ``cpu_kernels``: run norms, rotary and
    SwiGLU through the C++ kernels of ``kernels/cpu`` (the caller checked that they built)."""
    reason = unsupported_reason(hf_model, max_model_len)
    if reason is not None:
        log.info("running %s through transformers' modules: %s", type(hf_model).__name__, reason)
        return None
    return LlamaDecoder(hf_model, max_model_len, cpu_kernels).eval()
