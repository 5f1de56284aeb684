"""C++ kernels for CPUs, compiled on first use with the machine's C++ compiler and cached on disk.

- ``paged_decode_attention``: one query token per sequence over the paged KV cache, reading each block in
  place through the block table (no gather), fp32 softmax and accumulation.

:func:`load` compiles once per source version (about 40 s on 2 cores) into ``$TORCH_EXTENSIONS_DIR`` (torch's
default: ``~/.cache/torch_extensions``); later processes load the cached library in well under a second.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("paged_attention.cpp")


@functools.cache
def load():
    """The compiled extension module, or None (logged) when this machine cannot build it (no compiler)."""
    from torch.utils.cpp_extension import load_inline

    begin = time.perf_counter()
    try:
        module = load_inline(
            name="llm_backend_cpu_kernels", cpp_sources=[SOURCE.read_text()], functions=["paged_decode_attention"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler or headers: the engine falls back to gather + SDPA
        log.warning("CPU attention kernel unavailable (%s); using gather + SDPA", str(exc).splitlines()[0])
        return None
    log.info("CPU attention kernel ready in %.1f s", time.perf_counter() - begin)
    return module


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged cache.

    Args:
        q: ``[batch, num_heads, head_dim]`` contiguous; key_cache, value_cache:
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``q``'s dtype (fp32, bf16 or fp16).
        block_tables: ``[batch, max_blocks]`` int64; seq_lens: ``[batch]`` int64, keys ``0..seq_len-1`` attended.
        out: where to write, ``[batch, num_heads, head_dim]`` contiguous; a new tensor when None.

    Returns:
        ``out``.

    Raises:
        RuntimeError: the extension could not be built, or shapes / dtypes / layouts do not match.
    """
    module = load()
    if module is None:
        raise RuntimeError("the CPU attention kernel could not be built on this machine")
    out = torch.empty_like(q) if out is None else out
    module.paged_decode_attention(out, q.contiguous(), key_cache, value_cache, block_tables, seq_lens, scale)
    return out
