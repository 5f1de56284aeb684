"""The building blocks of the compact decoder: few, large operations per layer.

On a CPU a decoder step at small batch is bound by the number of operations launched, and at large batch by
the GEMMs. So, as in vLLM's and nano-vllm's model code: Q, K and V are one GEMM and so are gate and up;
the residual add happens inside the norm; rotary cos/sin are looked up once per step for all layers. On
CPU the GEMMs run through oneDNN with weights reordered once at load ("prepacked", what inductor's
freezing does for vLLM's CPU path), so that no step pays ``F.linear``'s reorder of the weights.
With ``quantization="int8"`` a Linear keeps its weight as int8 per output channel instead (``cpu_ops.int8_gemm``,
weight-only "W8A16"), half the bytes a decode step reads of bf16 weights; with ``"w8a8"`` the same weights, and the
activations rounded to int8 at run time for integer dot products.
With ``cpu_kernels`` the norm, rotary and SwiGLU run as one C++ pass each (``kernels/cpu``; vLLM's CPU path
fuses them too) instead of eager torch's chains of small operations; the torch code below is the same
arithmetic, for other devices and machines without a compiler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend import cpu_ops


def _onednn_packs(weight: torch.Tensor) -> bool:
    """Whether oneDNN prepacks ``weight`` here: a CPU tensor of fp32, or of bf16 / fp16 where this CPU has
    oneDNN's instructions for them (bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: not on AVX2-only CPUs, where
    ``F.linear`` runs it)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if weight.dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return weight.dtype == torch.float32


class Linear(torch.nn.Module):
    """``y = x W^T + b`` with the weight prepacked for oneDNN on CPU (plain ``F.linear`` elsewhere).

    Args:
        weight: ``[out_features, in_features]``; bias: ``[out_features]`` or None. Both are kept as given
            on non-CPU devices; on CPU the weight is reordered into oneDNN's blocked layout once.
        small_batch: also keep the weight in the layout of ``kernels.cpu.small_gemm``, which runs the GEMMs of
            decode steps (at most 64 rows on AMX, 256 elsewhere: ``kernels.cpu.small_gemm_max_rows``) faster than
            oneDNN here by streaming the weights in order (bf16 on AMX or AVX512-BF16, fp32 on AVX-512; ignored
            elsewhere); a second copy of the weight. On AVX2 without AVX-512 (fp32 and bf16): ``small_gemm`` takes
            every GEMM (``cpu_ops.EVERY_GEMM``), and its layout is the only copy (``weight`` None).
        small_batch_only: with ``small_batch``, keep the weight in ``small_gemm``'s layout only (``weight`` None):
            GEMMs of more rows than it takes (prompts) run through it in slices of ``small_batch_rows`` rows. For
            models too large for two copies (:data:`backend.models.llama.SMALL_GEMM_WEIGHT_LIMIT_BYTES`).
        quantization: ``none``, or ``int8``: the weight is quantized per output channel, symmetric, to int8 with an
            fp32 scale per row (:func:`kernels.cpu.int8_gemm_pack`) and kept only in that form; every GEMM, of
            any number of rows, runs through ``cpu_ops.int8_gemm`` (``small_batch`` is then that packed weight,
            ``small_batch_rows`` its row limit per call, ``weight`` None). Weight-only per-channel quantization
            as in LLM.int8() (Dettmers et al. 2022, sec. 3.1), without its fp16 outlier columns. ``w8a8``: the same
            weights, and each GEMM rounds its activations to int8 per row and group of 64 k (``int8_activations``
            of ``cpu_ops.int8_gemm``, AVX512-VNNI).
        fp32_out: for a bf16 weight that ``small_gemm`` or ``int8_gemm`` takes, return their fp32 sums unrounded, for
            every number of rows (prompts in slices of ``small_batch_rows``): an LM head's logits. Rounded to bf16,
            logits of about 10 lie 1/16 apart, so near ties become exact ties that greedy decoding breaks to the
            lower token id, and logprobs move in steps of 1/16. Elsewhere (oneDNN, other devices) the output keeps
            the weight's dtype.

    Raises:
        ValueError: ``int8`` / ``w8a8`` where ``cpu_ops.int8_gemm`` cannot run (:func:`int8_unsupported_reason`: not
            a CPU tensor, a build without AVX-512 or AVX2 with FMA (w8a8: AVX512-VNNI), an fp16 weight, a shape it
            does not take), or an unknown ``quantization``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, small_batch: bool = False,
                 quantization: str = "none", small_batch_only: bool = False, fp32_out: bool = False) -> None:
        super().__init__()
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.packed = _onednn_packs(weight)
        self.small_batch = None  # the weight in the tile layout, when small_batch applies
        self.small_batch_rows = 0  # the most rows that go to it
        self.quantization = quantization
        self.out_dtype = None  # fp32 where the kernels return a bf16 GEMM's sums unrounded (fp32_out)
        if quantization in ("int8", "w8a8"):
            reason = int8_unsupported_reason(weight, quantization)
            if reason is not None:
                raise ValueError(f"quantization {quantization} cannot run here: {reason}")
            self.small_batch = cpu_ops.int8_gemm_pack(weight)
            self.small_batch_rows = cpu_ops.int8_gemm_max_rows()
            self.packed = False
            self.out_dtype = torch.float32 if fp32_out and weight.dtype == torch.bfloat16 else None
            self.register_buffer("weight", None, persistent=False)
            self.register_buffer("bias", None if bias is None else bias.detach().contiguous(), persistent=False)
            return
        if quantization != "none":
            raise ValueError(f"quantization must be none, int8 or w8a8, got {quantization!r}")
        if weight.device.type == "cpu" and small_batch and _small_gemm_fits(weight):
            self.small_batch = cpu_ops.small_gemm_pack(weight)
            self.small_batch_rows = cpu_ops.small_gemm_max_rows(weight.dtype)
            if fp32_out and weight.dtype == torch.bfloat16:  # every GEMM through small_gemm, in slices of rows
                self.out_dtype = torch.float32
            if self.small_batch_rows == cpu_ops.EVERY_GEMM or small_batch_only or self.out_dtype is not None:
                self.packed = False  # oneDNN never runs it: one copy
                weight = None
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]``."""
        if self.quantization != "none":
            return cpu_ops.int8_gemm(x, self.small_batch, self.bias, int8_activations=self.quantization == "w8a8",
                                     out_dtype=self.out_dtype)
        if 0 < x.shape[0] <= self.small_batch_rows:
            return cpu_ops.small_gemm(x, self.small_batch, self.bias, out_dtype=self.out_dtype)
        if self.weight is None:  # only small_gemm's copy: no rows (a step that samples nothing), or a prompt's
            out = x.new_empty((x.shape[0], self.out_features), dtype=self.out_dtype or x.dtype)
            for begin in range(0, x.shape[0], self.small_batch_rows):  # each slice of rows written in place
                end = begin + self.small_batch_rows
                cpu_ops.small_gemm(x[begin:end], self.small_batch, self.bias, out=out[begin:end])
            return out
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def int8_unsupported_reason(weight: torch.Tensor, quantization: str = "int8") -> str | None:
    """Why ``weight`` ``[out_features, in_features]`` cannot be quantized for ``cpu_ops.int8_gemm`` (None when it
    can): its kernel needs a CPU, the C++ kernels built with AVX-512 (AVX512-BF16 for bf16) or AVX2 and FMA, fp32 or bf16
    activations (the weight's dtype), out_features a multiple of 16 and in_features even; ``w8a8`` also
    AVX512-VNNI and in_features a multiple of ``cpu_ops.w8a8_group_size()`` (64)."""
    if weight.device.type != "cpu":
        return f"the int8 GEMM is a CPU kernel, the weights are on {weight.device}"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"the int8 GEMM takes float32 or bfloat16 activations, the model is {weight.dtype}"
    if weight.shape[0] % 16 or weight.shape[1] % 2:
        return f"the weight [{weight.shape[0]}, {weight.shape[1]}] needs out_features a multiple of 16 and " \
               "in_features even"
    if not cpu_ops.available():
        return "the C++ CPU kernels (kernels/cpu) did not build on this machine"
    if not cpu_ops.int8_gemm_available(weight.dtype):
        needs = "AVX512-BF16 or AVX2 with FMA" if weight.dtype == torch.bfloat16 else "AVX-512 or AVX2 with FMA"
        return f"the C++ CPU kernels were built without {needs} (needed for {weight.dtype} activations)"
    if quantization == "w8a8":
        if not cpu_ops.w8a8_gemm_available():
            return "the C++ CPU kernels were built without AVX512-VNNI (int8 activations multiply with vpdpbusd)"
        if weight.shape[1] % cpu_ops.w8a8_group_size():
            return f"the weight [{weight.shape[0]}, {weight.shape[1]}] needs in_features a multiple of " \
                   f"{cpu_ops.w8a8_group_size()} (the activations' scale groups)"
    return None


def _small_gemm_fits(weight: torch.Tensor) -> bool:
    if weight.shape[0] % 16 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 32):
        return False
    return cpu_ops.small_gemm_available(weight.dtype)


def fuse_linears(*linears: torch.nn.Linear, small_batch: bool = False, quantization: str = "none",
                 small_batch_only: bool = False) -> Linear:
    """One :class:`Linear` whose output is the concatenation of ``linears``' outputs (fused QKV, gate-up)."""
    weight = torch.cat([layer.weight for layer in linears], 0)
    biases = [layer.bias for layer in linears]
    if all(b is None for b in biases):
        bias = None
    else:
        bias = torch.cat([b if b is not None else weight.new_zeros(layer.weight.shape[0])
                          for b, layer in zip(biases, linears)])
    return Linear(weight, bias, small_batch, quantization, small_batch_only)


class RMSNorm(torch.nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) computed in fp32 as transformers does, with the residual add fused in.

    ``forward(x)`` -> ``norm(x)``; ``forward(x, residual)`` adds ``x`` into ``residual`` in place and returns
    ``(norm(residual), residual)``, so a layer keeps one residual stream and never allocates a second. ``x``
    is ``[rows, d]``, or ``[rows, heads, d]`` for per-head norms (Qwen3's q/k norm); with ``cpu_kernels``
    both forms run in one C++ pass, the residual form writing the normalized rows over ``x``.
    """

    def __init__(self, weight: torch.Tensor, eps: float, cpu_kernels: bool = False) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().clone().contiguous(), persistent=False)
        self.eps = eps
        self.cpu_kernels = cpu_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, out: torch.Tensor | None = None):
        """``out`` (without ``residual``): write the result there (it may be ``x``: a per-head norm in place)."""
        if self.cpu_kernels:
            if residual is None:
                return cpu_ops.rms_norm(x, self.weight, self.eps, out=out)
            cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            residual.add_(x)
            x = residual
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * hidden.to(x.dtype)
        if residual is not None:
            return normed, residual
        return normed if out is None else out.copy_(normed)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cpu_kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021), the "rotate half" layout of Llama-family checkpoints,
    rounded as transformers' ``apply_rotary_pos_emb`` rounds.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; k: ``[num_tokens, num_kv_heads, head_dim]`` (unit stride in
            ``head_dim``); cos / sin: ``[num_tokens, head_dim]`` contiguous, each token's row of the tables.
        cpu_kernels: rotate ``q`` and ``k`` in place in one C++ pass; else new tensors from torch operations.

    Returns:
        The rotated ``(q, k)``.
    """
    if cpu_kernels:
        cpu_ops.rotary_embedding(q, k, cos, sin)
        return q, k
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(gate_up: torch.Tensor, cpu_kernels: bool = False) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``[num_tokens, 2 * d]`` (gate then up) -> ``silu(gate) * up``, ``[num_tokens, d]``
    (one C++ pass with ``cpu_kernels``)."""
    if cpu_kernels:
        return cpu_ops.silu_and_mul(gate_up)
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :half]).mul_(gate_up[:, half:])
