"""C++ kernels for CPUs, compiled on first use with the machine's C++ compiler and cached on disk.

- ``paged_decode_attention``: one query token per sequence over the paged KV cache, reading each block in
  place through the block table (no gather), fp32 softmax and accumulation.
- ``paged_prefill_attention``: the prompt (chunk) rows of several sequences at once, causal over each one's
  cached prefix and itself, reading the blocks in place too (16-token tiles shared by 16 query rows).
- ``small_gemm``: decode-sized GEMMs (at most 64 rows on AMX tiles; 256 with AVX512-BF16 or AVX-512 multiply-adds
  without AMX), the weights streamed from a tile layout.
- ``int8_gemm``: weight-only int8 GEMMs (W8A16: int8 weights per output channel with an fp32 scale, fp32 or bf16
  activations) in small_gemm's register blocking, half the weight bytes of bf16 per step; with AVX512-VNNI also
  W8A8 (the activations rounded to int8 per group of 64 k at run time, integer dot products; on AMX-INT8 tiles
  from 12 rows).
- ``write_kv``: each token's K and V rows copied to its slot (vLLM's ``reshape_and_cache``).
- ``kv_pool_zeros``: a layer's paged pool on 2 MiB transparent huge pages.
- ``argmax_rows``: greedy picks read in the logits' dtype (no fp32 copy of bf16 or fp16 logits).
- ``greedy_head``: greedy picks from an fp32 LM head through a bf16 pass with a proven error bound, the exact fp32
  logits only for the tokens the bound leaves in doubt (the same picks as the fp32 logits, in about half the time).
- ``bind_threads``: pins the OpenMP threads of the calling thread's team to given CPUs.
- ``decode_layers``: a decode step's decoder layers (as many rows as ``small_gemm`` takes, weights in its layout) in one
  call, the kernels above in the order the Python layer loop runs them.
- ``rms_norm``, ``fused_add_rms_norm``, ``rotary_embedding``, ``silu_and_mul``: the elementwise parts of a
  Llama-family layer, one pass each instead of eager torch's chains of small operations (on two cores at
  batch 64 those chains cost more than the GEMMs). Each rounds where transformers' modules round, so bf16
  results follow transformers' and fp32 results equal them up to summation order.

:func:`load` compiles once per source version (about 25 s on 2 cores) into ``$TORCH_EXTENSIONS_DIR`` (torch's
default: ``~/.cache/torch_extensions``); later processes load the cached library in well under a second. A library
already built there is imported directly, writing nothing: an image prebuilds it (docker/Dockerfile) and its
containers load it from a read-only filesystem.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = ("common.h", "paged_attention.cpp", "kv_cache.cpp", "small_gemm.cpp", "int8_gemm.cpp", "greedy_head.cpp",
           "rms_norm.cpp", "rotary.cpp", "activation.cpp", "threads.cpp", "argmax.cpp", "decoder_layers.cpp")
# -fno-trapping-math lets loops that convert floats to integers (the exp below) vectorize; 512-bit vectors
# (GCC prefers 256 on these CPUs) double the width of the elementwise kernels' loops.
# -march: the machine that compiles (native), or LLM_CPU_KERNELS_MARCH when the build runs elsewhere than the server
# (an image built once for many nodes: docker/Dockerfile). The AVX-512 / AMX paths are compiled where it allows them.
CFLAGS = ["-O3", f"-march={os.environ.get('LLM_CPU_KERNELS_MARCH') or 'native'}", "-fno-trapping-math",
          "-mprefer-vector-width=512", "-fopenmp"]
FUNCTIONS = ["paged_decode_attention", "paged_prefill_attention", "write_kv", "kv_pool_buffer",
             "small_gemm_available", "small_gemm_max_rows", "small_gemm_pack", "small_gemm", "int8_gemm_available",
             "int8_gemm_max_rows", "int8_gemm_pack", "int8_gemm_unpack", "int8_gemm", "w8a8_gemm_available",
             "w8a8_group_size", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "decode_layers",
             "bind_threads", "argmax_rows", "greedy_head_available", "greedy_head", "exit_when_orphaned"]


def _translation_unit() -> str:
    """All sources as one translation unit (one parse of torch's headers: half the compile time of five), with
    ``common.h`` inlined so that editing it changes the text torch hashes to decide on a rebuild."""
    parts = [(HERE / name).read_text(encoding="utf-8") for name in SOURCES]
    return "\n".join(part.replace('#include "common.h"', "") for part in parts)


_load_lock = threading.Lock()
_loaded: list = []  # [module or None] once load() has run in this process


def load():
    """The compiled extension module, or None (logged) when this machine cannot build it (no compiler).

    Safe to call from any thread and process at once. Builds are serialized across processes with an
    ``flock`` on the build directory, which the kernel releases when its holder dies; torch's own lock file
    (``FileBaton``) is not: a process killed while holding it (a stub killed during start-up) would make
    every later load wait forever, so under the flock a leftover one is removed.
    """
    with _load_lock:
        if not _loaded:
            _loaded.append(_build_or_load())
        return _loaded[0]


def _build_or_load():
    from torch.utils.cpp_extension import get_default_build_root, load_inline

    begin = time.perf_counter()
    source = _translation_unit()
    # The name carries the hash of the source, the flags and the interpreter's prefix (its venv: torch's headers
    # and paths): checkouts of different versions, or worktrees with venvs of their own, sharing one extensions
    # directory keep their own builds instead of rebuilding over each other.
    key = source + " ".join(CFLAGS) + sys.prefix
    name = "llm_backend_cpu_kernels_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # torch reads the same variable
    build_dir = Path(root) / f"llm_backend_py{sys.version_info[0]}{sys.version_info[1]}" / name
    prebuilt = _import_prebuilt(name, build_dir)
    if prebuilt is not None:
        log.info("CPU kernels loaded from %s in %.1f s", build_dir, time.perf_counter() - begin)
        return prebuilt
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / "build.flock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # released on close, or by the kernel if this process dies
            (build_dir / "lock").unlink(missing_ok=True)  # torch's FileBaton, left by a killed builder
            module = load_inline(
                name=name, cpp_sources=[source], functions=FUNCTIONS, build_directory=str(build_dir),
                extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler or headers: the engine falls back to gather + SDPA
        log.warning("CPU kernels unavailable (%s); using torch operations", str(exc).splitlines()[0])
        return None
    log.info("CPU kernels ready in %.1f s", time.perf_counter() - begin)
    return module


def _import_prebuilt(name: str, build_dir: Path):
    """The library a finished build left in ``build_dir`` (under a shared lock, so never one being linked), or None.

    Opens nothing for writing: the build's lock file is opened read-only, and a directory without one (never built
    here) is left to the build path.
    """
    import importlib.util

    library = build_dir / f"{name}.so"
    lock_path = build_dir / "build.flock"
    if not lock_path.exists():
        return None
    with open(lock_path) as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_SH)  # waits for a build in progress to finish
        if not library.exists():
            return None
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged cache.

    Args:
        q: ``[batch, num_heads, head_dim]``, each row's heads contiguous, any row stride (a view of the fused QKV
            output is read in place; other layouts are copied first); key_cache, value_cache:
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``q``'s dtype (fp32, bf16 or fp16).
        block_tables: ``[batch, max_blocks]`` int64; seq_lens: ``[batch]`` int64, keys ``0..seq_len-1`` attended.
        out: where to write, ``[batch, num_heads, head_dim]`` contiguous; a new tensor when None.

    Returns:
        ``out``.

    Raises:
        RuntimeError: the extension could not be built, shapes / dtypes / layouts do not match, or a seq_len or
            a block id it would read is out of range (checked before anything is read).
    """
    if q.dim() != 3 or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    _module().paged_decode_attention(out, q, key_cache, value_cache, block_tables, seq_lens, scale)
    return out


def _module():
    module = load()
    if module is None:
        raise RuntimeError("the CPU kernels could not be built on this machine")
    return module



def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            out: torch.Tensor) -> bool:
    """Causal attention of several sequences' new rows over their blocks (cached prefix and the rows themselves,
    whose K/V are already in the cache), without gathering the blocks.

    Args:
        q, out: ``[rows, num_heads, head_dim]``, ``out`` contiguous, ``q`` contiguous within each row (a view of
            the fused QKV output is fine); sequence ``p``'s rows are ``cu_seqlens[p]..cu_seqlens[p + 1] - 1`` and
            sit at its last positions.
        block_tables: ``[num_seqs, max_blocks]`` int64; cu_seqlens: ``[num_seqs + 1]`` int64; seq_lens:
            ``[num_seqs]`` int64, each sequence's context length after this step.

    Returns:
        True when ``out`` was written; False (nothing computed) for shapes the kernel does not cover: head_dim
        other than 64 or 128, fp16, more than 16 query heads per KV head.

    Raises:
        RuntimeError: the extension could not be built, shapes / dtypes / layouts do not match, or ``cu_seqlens``,
            a seq_len or a block id it would read is out of range (checked before anything is read).
    """
    return _module().paged_prefill_attention(out, q, key_cache, value_cache, block_tables, cu_seqlens, seq_lens,
                                             scale)

def small_gemm_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :func:`small_gemm` runs here for ``dtype``: bf16 needs AMX (built for it: the compiler targets this
    CPU; and allowed by Linux), AVX512-BF16, or AVX2 with FMA on a CPU without AVX-512 (the weights widened to fp32
    in registers; an AVX2 build on an AVX-512 CPU leaves bf16 to oneDNN); fp32 needs AVX-512 or AVX2 with FMA."""
    module = load()
    return dtype in (torch.bfloat16, torch.float32) and module is not None \
        and module.small_gemm_available(dtype == torch.bfloat16)


def small_gemm_max_rows(dtype: torch.dtype = torch.bfloat16) -> int:
    """The most rows :func:`small_gemm` takes for ``dtype`` here (it must be available): 64 on AMX tiles, 256 on
    AVX-512 units (built for decode batches; above them oneDNN's blocking for large GEMMs takes over,
    ``python -m benchmarks.profile_engine`` shows the split on a machine), and :data:`EVERY_GEMM` on AVX2 without
    AVX-512, where its register-blocked path is ahead of oneDNN's fp32 GEMM at every row count measured
    (docs/kernels.md), prompts included, and oneDNN has no bf16 GEMM."""
    return _module().small_gemm_max_rows(dtype == torch.bfloat16)


EVERY_GEMM = sys.maxsize  # small_gemm_max_rows where small_gemm takes GEMMs of any number of rows


def small_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` weight (N a multiple of 16) -> bf16 (K a multiple of 32): ``[N / 16, K / 2, 16, 2]``, the AMX
    tile layout; fp32: ``[N / 16, K, 16]``."""
    return _module().small_gemm_pack(weight.contiguous())


def small_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for at most :func:`small_gemm_max_rows` rows: bf16 on AMX tiles (or with AVX512-BF16
    dot products where there is no AMX), fp32 with AVX-512 multiply-adds, both with AVX2 multiply-adds on a CPU
    without AVX-512 (bf16 widened to fp32), the weights streamed in order from :func:`small_gemm_pack`'s layout.

    Args:
        x: ``[M, K]`` bf16 or fp32, 1 <= M <= ``small_gemm_max_rows(x.dtype)``; packed: from
            :func:`small_gemm_pack`; bias: ``[N]`` or None; out: a contiguous ``[M, N]`` to write into (e.g. a
            slice of rows of a larger result), or None; out_dtype: the result's dtype when ``out`` is None: ``x``'s
            (the default), or fp32 for bf16 ``x`` (an LM head's logits: the sums unrounded).

    Returns:
        ``[M, N]`` accumulated in fp32, in ``x``'s dtype (bf16: rounded once, as oneDNN's bf16 GEMM) or fp32 (the
        same sums before that rounding): ``out`` when given.

    Raises:
        RuntimeError: the kernel is unavailable for the dtype, or shapes / dtypes do not match.
    """
    if out is None:
        out = torch.empty(x.shape[0], packed.shape[0] * 16, dtype=out_dtype or x.dtype)
    _module().small_gemm(out, x.contiguous(), packed, bias)
    return out


def int8_gemm_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :func:`int8_gemm` runs here for activations of ``dtype``: the kernels built, with AVX-512 or AVX2 and
    FMA (fp32), AVX512-BF16 or AVX2 and FMA (bf16; on AVX2 through the fp32 path, the result rounded once)."""
    module = load()
    return dtype in (torch.float32, torch.bfloat16) and module is not None \
        and module.int8_gemm_available(dtype == torch.bfloat16)


def int8_gemm_max_rows() -> int:
    """The most rows one kernel call of :func:`int8_gemm` takes (256)."""
    return _module().int8_gemm_max_rows()


def int8_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """Quantizes ``weight`` ``[N, K]`` (fp32 or bf16, N a multiple of 16, K even) per output channel, symmetric, to
    int8: ``q = round(w / scale)``, ``scale = max_k |w[n, k]| / 127`` in fp32 (LLM.int8()'s vector-wise
    quantization, Dettmers et al. 2022, weights only). Returns int8 ``[N / 16, 16 K + 64]``: per block of 16
    outputs, K / 2 runs of 16 outputs x 2 consecutive k (small_gemm's bf16 tile layout, one byte per weight), then
    the 16 scales as fp32 bytes.

    Raises:
        RuntimeError: the extension could not be built, or the shape / dtype is not one of the above.
    """
    return _module().int8_gemm_pack(weight.contiguous())


def int8_gemm_unpack(packed: torch.Tensor, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight :func:`int8_gemm_pack` stored, dequantized: ``[N, K]`` of ``dtype`` (fp32 or bf16, rounded once),
    ``scale[n] * q[n, k]``.

    Raises:
        RuntimeError: the extension could not be built, or ``packed`` is not a packing of K = ``in_features``.
    """
    out = torch.empty(packed.shape[0] * 16, in_features, dtype=dtype)
    _module().int8_gemm_unpack(out, packed)
    return out


def w8a8_gemm_available() -> bool:
    """Whether :func:`int8_gemm` runs here with ``int8_activations`` (W8A8): the kernels built with AVX512-VNNI. The
    activations' dtype needs :func:`int8_gemm_available` too (bf16: AVX512-BF16)."""
    module = load()
    return module is not None and module.w8a8_gemm_available()


def w8a8_group_size() -> int:
    """The k that share one activation scale in :func:`int8_gemm` with ``int8_activations`` (64): ``K`` must be a
    multiple of it."""
    return _module().w8a8_group_size()


def int8_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None, int8_activations: bool = False,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ dequant(weight)^T (+ bias)`` with the int8 weights of :func:`int8_gemm_pack`, widened in registers
    (bf16 ``x``: to bf16, with AVX512-BF16 dot products; fp32 ``x``: to fp32, with multiply-adds, or on AVX2 without
    AVX-512 to int16 with ``vpmaddwd``, each row of ``x`` rounded to int16 with its own scale, ``max |x| / 32767``;
    bf16 ``x`` on AVX2 goes the fp32 way, widened first, and the result is rounded to bf16 once unless ``out`` is
    fp32);
    the sums are scaled per output once, at the end. Rows past :func:`int8_gemm_max_rows` go in chunks.

    With ``int8_activations`` (W8A8, :func:`w8a8_gemm_available`) ``x`` is rounded to int8 too, symmetric, with an
    fp32 scale per row and group of :func:`w8a8_group_size` k (``max |x| / 127`` over the group; llama.cpp's Q8_0
    activations use groups of 32), and multiplied with AVX512-VNNI's ``vpdpbusd``: each group's sum is exact in
    int32, scaled by its activation scale and added in fp32 in k order, then scaled per output. Each row is rounded
    on its own, so a row's result does not depend on the others. An infinite activation gives +-inf (or NaN) as the
    float product would (a group of 64 k holding both +inf and -inf gives NaN); activations past about 1e34 in magnitude overflow a group's scaled sum (inf) before the
    weights' scale is applied, where the float product might not (hidden states are many orders below that).

    Args:
        x: ``[M, K]`` fp32 or bf16, M >= 1; packed: from :func:`int8_gemm_pack`; bias: ``[N]`` of ``x``'s dtype, or
            None.
        out: ``[M, N]`` contiguous of ``x``'s dtype (or fp32 for bf16 ``x``) to write into, or None for a new tensor.
        int8_activations: round ``x`` to int8 too (W8A8, above).
        out_dtype: the new tensor's dtype when ``out`` is None: ``x``'s (the default), or fp32 for bf16 ``x`` (an LM
            head's logits: the sums unrounded).

    Returns:
        ``[M, N]`` accumulated in fp32, in ``x``'s dtype (bf16: rounded once) or fp32 (the sums before rounding).

    Raises:
        RuntimeError: the kernel is unavailable for the dtype (:func:`int8_gemm_available`) or for int8 activations
            (:func:`w8a8_gemm_available`; K not a multiple of :func:`w8a8_group_size`), or shapes / dtypes do not
            match.
    """
    module = _module()
    x = x.contiguous()
    rows = module.int8_gemm_max_rows()
    if out is None:
        out = torch.empty(x.shape[0], packed.shape[0] * 16, dtype=out_dtype or x.dtype)
    for begin in range(0, x.shape[0], rows):
        module.int8_gemm(out[begin:begin + rows], x[begin:begin + rows], packed, bias, int8_activations)
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Stores each token's K and V rows at its slot of the paged pool (vLLM's ``reshape_and_cache``), in place.

    Args:
        key, value: ``[tokens, num_kv_heads, head_dim]``; key_cache, value_cache: ``[num_blocks, block_size,
            num_kv_heads, head_dim]`` contiguous, same dtype; slot_mapping: ``[tokens]`` int64, slots < 0 skipped.

    Returns:
        True when written; False (nothing written) when a token's heads are not contiguous in ``key`` or
        ``value`` (e.g. transformers' ``[heads, tokens, dim]`` transposed views): the caller copies instead.

    Raises:
        RuntimeError: the extension could not be built, shapes / dtypes do not match, or a slot is out of range.
    """
    for x in (key, value):
        if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            return False
    _module().write_kv(key, value, key_cache, value_cache, slot_mapping)
    return True


def kv_pool_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor for one layer's K or V pool, on 2 MiB transparent huge pages where Linux grants them
    (``madvise``; 4 KiB pages where it does not). A decode step reads its sequences' blocks scattered over the
    whole pool: on 4 KiB pages most of those reads first miss the TLB. Every page is touched here, so the pool is
    resident from the start, as ``torch.zeros`` would make it.

    Args:
        shape: the pool's shape, ``[num_blocks, block_size, num_kv_heads, head_dim]``; dtype: its dtype.

    Returns:
        A contiguous tensor of ``shape`` and ``dtype``, all zeros.

    Raises:
        RuntimeError: the extension could not be built.
    """
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffer = _module().kv_pool_buffer(count * itemsize)
    return buffer.view(dtype).view(shape).zero_()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the last dimension, as transformers' ``LlamaRMSNorm`` computes it.

    Args:
        x: ``[rows, d]`` or ``[rows, heads, d]``, unit stride in ``d`` (views into a fused QKV output work).
        weight: ``[d]`` contiguous, ``x``'s dtype. eps: added to the mean square.
        out: where to write, ``x``'s shape and dtype (may be ``x`` itself); a new tensor when None.

    Returns:
        ``out``.

    Raises:
        RuntimeError: the extension could not be built, or shapes / dtypes / strides do not match.
    """
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    unsqueeze = x.dim() == 2
    _module().rms_norm(out.unsqueeze(1) if unsqueeze else out, x.unsqueeze(1) if unsqueeze else x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight`` (vLLM's ``fused_add_rms_norm``).

    Args:
        x, residual: ``[rows, d]``, unit stride in ``d``, one dtype; weight ``[d]`` contiguous.

    Raises:
        RuntimeError: the extension could not be built, or shapes / dtypes / strides do not match.
    """
    _module().fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary position embedding (Su et al. 2021), rotate-half layout, in place on ``query`` and ``key``.

    Args:
        query: ``[tokens, num_heads, head_dim]``; key: ``[tokens, num_kv_heads, head_dim]``; both with unit
            stride in ``head_dim`` (views into the fused QKV output work).
        cos, sin: ``[tokens, head_dim]`` contiguous, each token's row of the rotary tables; one dtype throughout.

    Raises:
        RuntimeError: the extension could not be built, or shapes / dtypes / strides do not match.
    """
    _module().rotary_embedding(query, key, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``[tokens, 2 * d]`` (gate, then up; unit stride in the last dimension) ->
    ``silu(gate) * up``, ``[tokens, d]`` contiguous.

    Raises:
        RuntimeError: the extension could not be built, or shapes / dtypes / strides do not match.
    """
    out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
    _module().silu_and_mul(out, gate_up)
    return out


DECODE_LAYER_TENSORS = 10  # decoder_layers.cpp


def decode_layers(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, layers: list[torch.Tensor], num_heads: int,
                  num_kv_heads: int, head_dim: int, eps: float, scale: float,
                  int8_activations: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's decoder layers in one call (Llama family, ``backend.models.llama``): per layer the residual
    add and RMSNorm, QKV GEMM, rotary, KV write, paged decode attention, O GEMM, add and RMSNorm, gate-up GEMM,
    SwiGLU and down GEMM, in the Python loop's order and with its kernels' arithmetic (bit-identical results).
    Rotary and the KV write run as one pass over the rows, the attention reads the queries in place in the fused
    QKV rows, and the step's activations are allocated once for all layers.

    Args:
        hidden: ``[rows, hidden_size]`` contiguous, the token embeddings, 1 <= rows <= :func:`small_gemm_max_rows`.
        cos, sin: ``[rows, head_dim]`` contiguous; slot_mapping ``[rows]``, block_tables ``[rows, max_blocks]``,
            seq_lens ``[rows]`` (context including the new token): int64, contiguous.
        layers: :data:`DECODE_LAYER_TENSORS` per layer: input norm weight, QKV packed (:func:`small_gemm_pack`),
            QKV bias (empty tensor: none), O packed, O bias (empty: none), post-attention norm weight, gate-up
            packed, down packed, key cache, value cache. A packed weight of dtype int8 (:func:`int8_gemm_pack`)
            runs through :func:`int8_gemm`, 1 <= rows <= :func:`int8_gemm_max_rows`. Every layer has the first
            one's shapes.
        eps: the norms' epsilon; scale: the attention's softmax scale.
        int8_activations: the int8 weights' GEMMs round their activations to int8 (W8A8, :func:`int8_gemm`).

    Returns:
        ``(hidden, residual)`` after the last layer, ``[rows, hidden_size]`` each.

    Raises:
        RuntimeError: the extension could not be built, shapes / dtypes / layouts do not match, a layer's shapes
            differ from the first one's, or a slot is past a layer's KV pool (all checked before any layer writes
            its KV cache).
    """
    return _module().decode_layers(hidden, cos, sin, slot_mapping, block_tables, seq_lens, layers, num_heads,
                                   num_kv_heads, head_dim, eps, scale, int8_activations)


def bind_threads(cpus: list[int]) -> None:
    """Pins the torch (OpenMP) threads that the calling thread's parallel regions use, thread ``i`` to CPU
    ``cpus[i]`` (the calling thread is thread 0), as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` does. Call it from the
    thread that runs the forward passes, with ``len(cpus) == torch.get_num_threads()``.

    Raises:
        RuntimeError: the extension could not be built, or a CPU id is not one this process may use.
    """
    failed = _module().bind_threads(list(cpus))
    if failed:
        raise RuntimeError(f"could not pin {failed} of {len(cpus)} threads to CPUs {cpus}")


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index, as ``torch.argmax(logits, -1)`` for finite logits.

    Args:
        logits: ``[rows, vocab]`` fp32, bf16 or fp16, unit stride in ``vocab``.

    Returns:
        ``[rows]`` int64.

    Raises:
        RuntimeError: the extension could not be built, or shapes / dtypes / strides do not match.
    """
    out = torch.empty(logits.shape[0], dtype=torch.long)
    _module().argmax_rows(out, logits)
    return out


def greedy_head_available() -> bool:
    """Whether :func:`greedy_head` runs on this CPU (AVX512-BF16) and the kernels built."""
    module = load()
    return module is not None and module.greedy_head_available()


def greedy_head(x: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, error_norms: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The argmax of each row of the fp32 logits ``x @ weight.T``, without computing all of them.

    A bf16 GEMM over the vocabulary gives each logit within a proven bound; only the tokens whose bound reaches
    the best lower bound get their exact fp32 logit, summed in ``small_gemm``'s order, so the picks equal
    ``argmax(small_gemm(x, small_gemm_pack(weight)))`` (the first index on ties). The bound is derived in
    ``greedy_head.cpp``.

    Args:
        x: ``[rows, K]`` fp32 hidden states (K % 32 == 0).
        packed: ``small_gemm_pack(weight.bfloat16())``.
        norms / error_norms: ``[V]`` fp32, at least ``|bf16(W_i)|`` and ``|W_i - bf16(W_i)|`` (see
            :class:`backend.models.greedy_head.GreedyHead`).
        weight: ``[V, K]`` fp32 contiguous.

    Returns:
        (``[rows]`` int64 token ids, -1 where a row is not finite or too large to bound; the number of exact
        logits computed).

    Raises:
        RuntimeError: no AVX512-BF16, or shapes / dtypes do not match.
    """
    out = torch.empty(x.shape[0], dtype=torch.long)
    exact = _module().greedy_head(out, x.contiguous(), packed, norms, error_norms, weight)
    return out, exact


def exit_when_orphaned(parent_pid: int, interval_s: float) -> bool:
    """Starts a native thread (no GIL needed) that ends this process once its parent is not ``parent_pid``;
    False (nothing started) when the extension could not be built."""
    module = load()
    if module is None:
        return False
    module.exit_when_orphaned(parent_pid, max(1, int(interval_s * 1000)))
    return True
