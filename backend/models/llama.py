"""A compact decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3), built from a loaded transformers model.

The same weights and the same arithmetic as transformers' modules, in fewer and larger operations: per layer
one QKV GEMM, one gate-up GEMM, the residual added inside the norm, and paged attention called directly on
packed tokens ``[num_tokens, heads, head_dim]`` (no batch dimension, no transposes) through the one
``attention`` call, whichever backend built the step's metadata. nano-vllm's
``models/qwen3.py`` and vLLM's ``model_executor/models/llama.py`` have this shape.
"""

from __future__ import annotations

import torch

from backend import cpu_ops
from backend.attention import AttentionMetadata, attention
from backend.models.greedy_head import GreedyHead
from backend.models.layers import Linear, RMSNorm, apply_rotary, fuse_linears, silu_and_mul

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only


def unsupported_reason(hf_model, max_model_len: int) -> str | None:
    """Why the compact decoder cannot run ``hf_model`` exactly (None when it can)."""
    config = hf_model.config
    name = type(hf_model).__name__
    if name not in ARCHITECTURES:
        return f"architecture {name} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    window = getattr(config, "sliding_window", None)
    if window is not None and (getattr(config, "use_sliding_window", True) and window < max_model_len):
        return f"sliding window {window} < max_model_len {max_model_len}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type}"
    if getattr(config, "mlp_bias", False):
        return "MLP bias"
    return None


# Up to this many bytes of bf16 weights, the CPU decoder also keeps them in AMX's tile layout for decode-sized GEMMs
# (cpu_ops.small_gemm: AMX, or AVX512-BF16 on the same layout): that doubles the weights' memory, worth it for the
# small models CPUs serve. Past it, on AVX-512 without AMX, the tile layout is the only copy (prompts go through
# small_gemm in slices); with AMX, oneDNN runs every GEMM. fp32 weights on AVX-512 keep the tile layout only, at
# any size (prompts in slices: one summation order for any number of rows). (On AVX2 without AVX-512, fp32 and
# bf16: small_gemm runs every GEMM from the one copy, at any size.)
SMALL_GEMM_WEIGHT_LIMIT_BYTES = 4 << 30
# Past that limit, the tile layout is the only copy where small_gemm takes slices of at least this many rows: prompts
# run through it slice by slice (docs/kernels.md).
PROMPT_SLICE_ROWS = 256


# With quantization int8, whether the LM head is quantized too: it is read every decode step and is a fifth of
# SmolLM2-135M's weights (a sixteenth of SmolLM2-1.7B's), and it adds less than a tenth of a percent to that model's
# perplexity over the other linears' int8 (docs/configuration.md#quantization).
QUANTIZE_LM_HEAD = True


class DecoderLayer(torch.nn.Module):
    def __init__(self, hf_layer, config, layer_idx: int, cpu_kernels: bool, small_batch: bool = False,
                 quantization: str = "none", small_batch_only: bool = False) -> None:
        super().__init__()
        self.cpu_kernels = cpu_kernels
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = attn.scaling
        only = dict(small_batch_only=small_batch_only)
        self.qkv_proj = fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj, small_batch=small_batch, **only,
                                     quantization=quantization)
        self.o_proj = Linear(attn.o_proj.weight, attn.o_proj.bias, small_batch, quantization, **only)
        self.q_norm = self.k_norm = None
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head on q and k before the rotary embedding
            self.q_norm = RMSNorm(attn.q_norm.weight, attn.q_norm.variance_epsilon, cpu_kernels)
            self.k_norm = RMSNorm(attn.k_norm.weight, attn.k_norm.variance_epsilon, cpu_kernels)
        self.gate_up_proj = fuse_linears(mlp.gate_proj, mlp.up_proj, small_batch=small_batch, quantization=quantization,
                                         **only)
        self.down_proj = Linear(mlp.down_proj.weight, small_batch=small_batch, quantization=quantization, **only)
        self.input_layernorm = RMSNorm(hf_layer.input_layernorm.weight, hf_layer.input_layernorm.variance_epsilon,
                                       cpu_kernels)
        self.post_attention_layernorm = RMSNorm(hf_layer.post_attention_layernorm.weight,
                                                hf_layer.post_attention_layernorm.variance_epsilon, cpu_kernels)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: the embeddings are the residual stream
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, out=q), self.k_norm(k, out=k)
        q, k = apply_rotary(q, k, cos, sin, self.cpu_kernels)
        attn = attention(q, k, v, self.layer_idx, self.scale, meta)
        hidden = self.o_proj(attn.view(num_tokens, q_size))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.down_proj(silu_and_mul(self.gate_up_proj(hidden), self.cpu_kernels))
        return hidden, residual


class LlamaDecoder(torch.nn.Module):
    """Token ids in, logits of chosen rows out, over the paged KV cache.

    Built from a transformers ``*ForCausalLM`` of :data:`ARCHITECTURES` (check :func:`unsupported_reason`
    first); the transformers model can be dropped afterwards (its embedding table is shared, not copied).
    ``quantization``: ``none``, or ``int8``: every layer's QKV, O, gate-up and down weights (and the LM head when
    :data:`QUANTIZE_LM_HEAD`) are int8 per output channel (:class:`~backend.models.layers.Linear`); ``w8a8``: the
    same, and their GEMMs round the activations to int8 too.

    Raises:
        ValueError: ``int8`` / ``w8a8`` where it cannot run (see :func:`backend.models.layers.int8_unsupported_reason`).
    """

    def __init__(self, hf_model, max_model_len: int, cpu_kernels: bool = False, quantization: str = "none") -> None:
        super().__init__()
        config = hf_model.config
        inner = hf_model.model
        self.config = config
        self.embed_tokens = inner.embed_tokens
        weight_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
        # int8 weights are packed for their own kernel only: no second copy in the tile layout. Where small_gemm
        # takes every GEMM (AVX2 without AVX-512), its layout is the only copy, whatever the size; past the limit,
        # where it takes prompts in slices, too (SMALL_GEMM_WEIGHT_LIMIT_BYTES).
        # An fp32 model keeps that layout only, at any size: small_gemm sums each row in one order whatever the
        # number of rows, so a request's tokens do not depend on what shares its step (oneDNN's order for a step
        # of over small_gemm's rows differs), at oneDNN's rate for prompts (docs/kernels.md).
        head = hf_model.lm_head.weight
        too_large = weight_bytes > SMALL_GEMM_WEIGHT_LIMIT_BYTES
        small_batch_only = cpu_kernels and quantization == "none" and (
            (too_large and _small_gemm_slices_prompts(head)) or _small_gemm_slices_fp32(head))
        small_batch = cpu_kernels and quantization == "none" and (
            not too_large or _small_gemm_takes_every_gemm(head) or small_batch_only)
        self.quantization = quantization
        self.layers = torch.nn.ModuleList(DecoderLayer(layer, config, i, cpu_kernels, small_batch, quantization,
                                                       small_batch_only) for i, layer in enumerate(inner.layers))
        self.norm = RMSNorm(inner.norm.weight, inner.norm.variance_epsilon, cpu_kernels)
        lm_bias = getattr(hf_model.lm_head, "bias", None)
        head_quantization = quantization if QUANTIZE_LM_HEAD else "none"
        # A bf16 head always takes small_gemm's layout on the C++ kernels, whatever the model's size: its fp32 sums
        # are the logits (bf16 logits would tie near-equal tokens: Linear's fp32_out), and it keeps no other copy.
        head_small_batch = small_batch or (cpu_kernels and head_quantization == "none" and head.dtype == torch.bfloat16)
        self.lm_head = Linear(head, lm_bias, head_small_batch, head_quantization, small_batch_only, fp32_out=True)
        # Greedy rows of an fp32 head: bf16 with a proven bound, exact fp32 logits for the few tokens in doubt.
        self.greedy_head = None
        # Not past the limit: its bf16 copy (and an untied head's fp32 weight) would add to a model kept in one copy.
        if (self.lm_head.small_batch is not None and self.lm_head.quantization == "none" and lm_bias is None
                and not too_large and _greedy_head_fits(hf_model.lm_head.weight)):
            self.greedy_head = GreedyHead(hf_model.lm_head.weight, max_rows=self.lm_head.small_batch_rows)
        dtype = self.embed_tokens.weight.dtype
        device = self.embed_tokens.weight.device
        with torch.no_grad():  # transformers' own rotary module, so every static rope variant matches exactly
            positions = torch.arange(max_model_len, device=device)[None]
            cos, sin = inner.rotary_emb(torch.empty(0, dtype=dtype, device=device), positions)
        self.register_buffer("cos_cache", cos[0].contiguous(), persistent=False)  # [max_model_len, head_dim]
        self.register_buffer("sin_cache", sin[0].contiguous(), persistent=False)
        # Decode steps that small_gemm takes (at most 64 rows on AMX, 256 elsewhere; int8_gemm: 256) run every layer
        # in one C++ call (cpu_ops.decode_layers) when every GEMM has its small-batch layout (or is int8), of one
        # shape across the layers, and the layers have nothing it leaves out (Qwen3's q/k norms).
        layers = list(self.layers)
        projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        self.decode_in_one_call = (
            cpu_kernels and (small_batch or quantization != "none") and all(layer.q_norm is None for layer in layers)
            and all(getattr(layer, name).small_batch is not None for layer in layers for name in projections)
            and all(len({getattr(layer, name).small_batch.shape for layer in layers}) == 1 for name in projections)
            and len({norm.eps for layer in layers
                     for norm in (layer.input_layernorm, layer.post_attention_layernorm)}) == 1
            and len({layer.scale for layer in layers}) == 1)
        self._decode_tensors: tuple[object, list[torch.Tensor]] | None = None  # (kv_caches, their list)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """
        Args:
            input_ids / positions: ``[num_tokens]`` int64, the step's packed tokens and their positions.
            logits_rows: ``[num_logits]`` int64, the packed rows whose logits are wanted.

        Returns:
            ``[num_logits, vocab_size]`` logits: fp32 where the C++ kernels run the LM head (``Linear``'s
            ``fp32_out``), else in the model's dtype.
        """
        return self.lm_head(self.final_hidden(input_ids, positions, meta, logits_rows))

    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     logits_rows: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` up to the LM head: ``[num_logits, hidden_size]``, the final norm's output."""
        hidden = self.embed_tokens(input_ids)
        cos = self.cos_cache.index_select(0, positions)  # [num_tokens, head_dim]
        sin = self.sin_cache.index_select(0, positions)
        if self._decodes_in_one_call(meta, hidden.shape[0]):
            first = self.layers[0]
            hidden, residual = cpu_ops.decode_layers(
                hidden, cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens,
                self._decode_layer_tensors(meta.kv_caches), first.num_heads, first.num_kv_heads, first.head_dim,
                first.input_layernorm.eps, first.scale, int8_activations=self.quantization == "w8a8")
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, cos, sin, meta)
        hidden = hidden.index_select(0, logits_rows)
        hidden, _ = self.norm(hidden, residual.index_select(0, logits_rows))
        return hidden

    def _decodes_in_one_call(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A step for ``cpu_ops.decode_layers``: only single-token rows, as many as ``small_gemm`` takes (the
        decoder was built for the ``cpu`` backend, whose metadata has int64 contiguous decode tables)."""
        return (self.decode_in_one_call and meta.num_decodes == num_tokens
                and 0 < num_tokens <= self.layers[0].qkv_proj.small_batch_rows)

    def _decode_layer_tensors(self, kv_caches) -> list[torch.Tensor]:
        """The per-layer tensors ``cpu_ops.decode_layers`` takes, built once per KV pool."""
        if self._decode_tensors is None or self._decode_tensors[0] is not kv_caches:
            none = self.embed_tokens.weight.new_empty(0)
            tensors = []
            for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
                tensors += [layer.input_layernorm.weight, layer.qkv_proj.small_batch,
                            none if layer.qkv_proj.bias is None else layer.qkv_proj.bias, layer.o_proj.small_batch,
                            none if layer.o_proj.bias is None else layer.o_proj.bias,
                            layer.post_attention_layernorm.weight, layer.gate_up_proj.small_batch,
                            layer.down_proj.small_batch, key_cache, value_cache]
            self._decode_tensors = (kv_caches, tensors)
        return self._decode_tensors[1]


def _small_gemm_takes_every_gemm(weight: torch.Tensor) -> bool:
    """Whether ``cpu_ops.small_gemm`` runs GEMMs of any number of rows for ``weight``'s dtype here (fp32 and bf16 on
    AVX2 without AVX-512)."""
    return (weight.device.type == "cpu" and cpu_ops.small_gemm_available(weight.dtype)
            and cpu_ops.small_gemm_max_rows(weight.dtype) == cpu_ops.EVERY_GEMM)


def _small_gemm_slices_prompts(weight: torch.Tensor) -> bool:
    """Whether prompts run through ``cpu_ops.small_gemm`` in slices here for ``weight``'s dtype: on AVX-512 vector
    units without AMX (slices of at least :data:`PROMPT_SLICE_ROWS` rows, about oneDNN's rate on a Zen 4 EPYC).
    Not with AMX tiles (64 rows a call); fp32: :func:`_small_gemm_slices_fp32`."""
    return (weight.device.type == "cpu" and cpu_ops.small_gemm_available(weight.dtype)
            and cpu_ops.small_gemm_max_rows(torch.bfloat16) >= PROMPT_SLICE_ROWS  # no AMX tiles
            and PROMPT_SLICE_ROWS <= cpu_ops.small_gemm_max_rows(weight.dtype) < cpu_ops.EVERY_GEMM)


def _small_gemm_slices_fp32(weight: torch.Tensor) -> bool:
    """Whether an fp32 ``weight``'s prompts run through ``cpu_ops.small_gemm`` in slices here: its fp32 kernel
    (AVX-512 vector units, with or without AMX, which has no fp32 tiles) takes at least :data:`PROMPT_SLICE_ROWS`
    rows a call."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and cpu_ops.small_gemm_available(weight.dtype)
            and PROMPT_SLICE_ROWS <= cpu_ops.small_gemm_max_rows(weight.dtype) < cpu_ops.EVERY_GEMM)


def _greedy_head_fits(weight: torch.Tensor) -> bool:
    """An fp32 head ``GreedyHead`` takes, on a CPU whose kernels have AVX512-BF16."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and cpu_ops.greedy_head_available())
