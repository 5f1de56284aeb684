"""Model code of our own for the families that matter most; every other family runs through transformers."""

from __future__ import annotations

import logging

import torch

from backend.models.llama import LlamaDecoder, unsupported_reason

log = logging.getLogger(__name__)


def build_decoder(hf_model, max_model_len: int, cpu_kernels: bool = False,
                  quantization: str = "none") -> torch.nn.Module | None:
    """The compact decoder for ``hf_model`` (a loaded transformers causal LM), or None when its family or
    configuration needs the transformers path (the reason is logged). ``cpu_kernels``: run norms, rotary and
    SwiGLU through the C++ kernels of ``kernels/cpu`` (the caller checked that they built). ``quantization``:
    ``none``, ``int8`` (weight-only int8 linears, :class:`~backend.models.layers.Linear`) or ``w8a8`` (int8 weights
    and activations).

    Raises:
        ValueError: ``int8`` / ``w8a8`` for a model the compact decoder does not run (only it has int8 linears), or
            where the int8 kernel cannot run.
    """
    reason = unsupported_reason(hf_model, max_model_len)
    if reason is not None:
        if quantization != "none":
            raise ValueError(f"quantization {quantization} needs the compact decoder, which cannot run "
                             f"{type(hf_model).__name__}: {reason}")
        log.info("running %s through transformers' modules: %s", type(hf_model).__name__, reason)
        return None
    decoder = LlamaDecoder(hf_model, max_model_len, cpu_kernels, quantization).eval()
    if quantization != "none":
        log.info("linear weights quantized: %s (LM head %s)", quantization, decoder.lm_head.quantization)
    return decoder
