"""Picks the attention backend once, at load, from the device, dtype, head size and what is available here.

vLLM's ``vllm/attention/selector.py`` has this role. ``auto`` takes the first available of :data:`PREFERENCE` for
the device; a name (the ``attention_backend`` engine setting) takes that backend or refuses with the reason it
cannot run here. The choice is logged once per engine.
"""

from __future__ import annotations

import logging

import torch

from backend.attention.base import AttentionBackend
from backend.attention.cpu import CPUBackend
from backend.attention.torch_sdpa import TorchSDPABackend
from backend.attention.triton import TritonBackend

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {b.name: b for b in (TorchSDPABackend, CPUBackend, TritonBackend)}
"""Every backend by the name the ``attention_backend`` setting uses."""

PREFERENCE = {"cuda": ("triton", "torch"), "cpu": ("cpu", "torch")}
"""``auto``'s order per device type (the Triton interpreter on CPU is for tests, never chosen by ``auto``)."""


def available_backends(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[str]:
    """Names of the backends that can run a model of this device, dtype and head size here."""
    return [name for name, b in BACKENDS.items() if b.unavailable_reason(device, dtype, head_dim) is None]


def select_attention_backend(requested: str, device: torch.device, dtype: torch.dtype,
                             head_dim: int) -> type[AttentionBackend]:
    """The backend for a model whose weights and KV cache are ``dtype`` on ``device``, ``head_dim`` per head.

    Args:
        requested: ``auto`` or a name of :data:`BACKENDS`.

    Raises:
        ValueError: an unknown name, or a named backend that cannot run here (the message says why and lists
            the available ones).
    """
    device = torch.device(device)
    if requested == "auto":
        order = PREFERENCE.get(device.type, ("torch",))
        chosen = next(BACKENDS[n] for n in order if BACKENDS[n].unavailable_reason(device, dtype, head_dim) is None)
        how = "auto"
    else:
        if requested not in BACKENDS:
            raise ValueError(f"attention_backend must be auto or one of {', '.join(BACKENDS)}, got {requested!r}")
        chosen = BACKENDS[requested]
        reason = chosen.unavailable_reason(device, dtype, head_dim)
        if reason is not None:
            raise ValueError(f"attention backend {requested!r} is not available here: {reason} (available: "
                             f"{', '.join(available_backends(device, dtype, head_dim))})")
        how = "attention_backend setting"
    log.info("attention backend: %s (%s; %s, %s, head_dim %d)", chosen.name, how, device, dtype, head_dim)
    return chosen
