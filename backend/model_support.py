"""Which models the engine can serve exactly, decided at load: refused models fail with the reason, never run.

Two checks, both before the engine takes requests:

- :func:`check_config` (before the weights are read): architectures the engine cannot drive at all. The engine
  runs decoder-only transformers whose every layer is attention over a KV cache; an encoder-decoder (T5, BART),
  a state-space model (Mamba) or a hybrid with recurrent / linear-attention layers (Jamba, Zamba, Bamba,
  Qwen3-Next, ...) keeps other state per sequence and is refused.
- :func:`inspect_attention` (after loading): one short forward pass with a recording function registered in
  transformers' ``AttentionInterface`` collects, layer by layer, what the model asks of attention
  (``sliding_window``, ``softcap``, ``s_aux``, any other keyword). Every layer must call it, and every keyword
  must be one :mod:`backend.attention_options` honours; the per-layer result tells the KV cache manager whether
  blocks may be freed behind a sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from backend.attention_options import PLAIN, AttentionOptions, UnsupportedAttentionError, attention_options

RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid",
    "nemotron_h", "recurrent_gemma", "rwkv", "xlstm", "lfm2", "lfm2_moe", "lfm2_vl", "qwen3_next", "plamo2",
    "minimax", "olmo_hybrid", "kimi_linear"})
"""State-space, recurrent or linear-attention families (their per-sequence state is not a KV cache)."""

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
"""The ``config.layer_types`` entries the engine implements; anything else (``chunked_attention``,
``linear_attention``, ``mamba``, ``conv``...) is refused."""

PROBE_NAME = "model_support_probe"


class UnsupportedModelError(ValueError):
    """The model needs something the engine does not do; the message names the model type and the feature."""


@dataclass(frozen=True)
class ModelAttention:
    """What a loaded model asks of attention, per layer.

    Attributes:
        layers: one :class:`~backend.attention_options.AttentionOptions` per decoder layer, in layer order.
    """

    layers: tuple[AttentionOptions, ...]

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer has the same one (Mistral, Qwen2 with all layers windowed), else None
        (full-attention layers, or a hybrid such as Gemma 2/3, need every block)."""
        windows = {layer.sliding_window for layer in self.layers}
        return windows.pop() if len(windows) == 1 else None

    def describe(self) -> str:
        kinds = {}
        for layer in self.layers:
            kinds[layer.describe()] = kinds.get(layer.describe(), 0) + 1
        return "; ".join(f"{count} layer(s) {kind}" for kind, count in kinds.items())


def check_config(config) -> None:
    """Refuses, from its config alone, an architecture the engine cannot drive.

    Args:
        config: a transformers ``PretrainedConfig``.

    Raises:
        UnsupportedModelError: encoder-decoder; a state-space, recurrent or hybrid-recurrent family; layer types
            other than full or sliding-window attention; no causal-LM architecture.
    """
    model_type = getattr(config, "model_type", "unknown")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model type {model_type!r} is an encoder-decoder; this engine serves "
                                    f"decoder-only causal LMs")
    if model_type in RECURRENT_MODEL_TYPES or getattr(text_config, "model_type", None) in RECURRENT_MODEL_TYPES:
        raise UnsupportedModelError(f"model type {model_type!r} has state-space / recurrent layers, which keep "
                                    f"per-sequence state this engine does not manage (it pages a KV cache only)")
    layer_types = getattr(text_config, "layer_types", None) or ()
    others = sorted({str(t) for t in layer_types} - ATTENTION_LAYER_TYPES)
    if others:
        raise UnsupportedModelError(f"model type {model_type!r} has layers of type {', '.join(others)}; this engine "
                                    f"implements {', '.join(sorted(ATTENTION_LAYER_TYPES))}")
    for name in ("attention_chunk_size", "layers_block_type", "hybrid_override_pattern"):
        if getattr(text_config, name, None):
            raise UnsupportedModelError(f"model type {model_type!r} sets {name} (chunked attention or "
                                        f"non-attention layers), which this engine does not implement")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnsupportedModelError(f"model type {model_type!r} has no causal-LM class in transformers "
                                    f"(AutoModelForCausalLM); this engine serves causal LMs")


def max_positions(config) -> int | None:
    """The longest context a model's config declares (None where it declares none): ``max_position_embeddings``,
    times the factor of linear, dynamic or YaRN rotary scaling (YaRN's from its original length), as vLLM derives
    its largest ``max_model_len``."""
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if limit and rope_type in ("linear", "dynamic", "yarn") and rope.get("factor"):
        base = rope.get("original_max_position_embeddings", limit) if rope_type == "yarn" else limit
        limit = int(base * rope["factor"])
    return limit


MAX_MODEL_LEN_CAP = 8192  # the default max_model_len never exceeds this: the KV one sequence may hold


def default_max_model_len(config) -> int:
    """``max_model_len`` where none is set: the model's positions (:func:`max_positions`), capped at
    :data:`MAX_MODEL_LEN_CAP` (and that cap for a model that declares none). The engine, the OpenAI frontend's
    bounds and the benchmark's peers all take it from here."""
    return min(max_positions(config) or MAX_MODEL_LEN_CAP, MAX_MODEL_LEN_CAP)


def inspect_attention(model: torch.nn.Module) -> ModelAttention:
    """Runs one 2-token forward pass of ``model`` with a recording attention function and returns what each
    layer asked for; the model's attention implementation is restored afterwards.

    Raises:
        UnsupportedModelError: the model does not route attention through ``AttentionInterface``; some layers
            never called it (recurrent or otherwise non-attention layers); a layer passed a keyword this engine
            does not implement (see :func:`backend.attention_options.attention_options`); bidirectional layers.
    """
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    if hasattr(model, "is_backend_compatible") and not model.is_backend_compatible():
        raise UnsupportedModelError(f"model type {model_type!r} ({type(model).__name__}) does not route attention "
                                    f"through transformers' AttentionInterface, so paged attention cannot run it")
    calls: dict[int, AttentionOptions] = {}
    errors: list[str] = []

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        try:
            options = attention_options(module, {"dropout": dropout, **kwargs})
        except UnsupportedAttentionError as exc:
            errors.append(str(exc))
            options = PLAIN
        calls.setdefault(getattr(module, "layer_idx", -1), options)
        return torch.zeros_like(query).transpose(1, 2).contiguous(), None

    AttentionInterface.register(PROBE_NAME, record)
    previous = config._attn_implementation
    try:
        model.set_attn_implementation(PROBE_NAME)
        token = getattr(config, "bos_token_id", None)
        token = token if isinstance(token, int) and 0 <= token < config.get_text_config().vocab_size else 0
        with torch.inference_mode():
            model(input_ids=torch.tensor([[token, token]], device=model.device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    if errors:
        raise UnsupportedModelError(f"model type {model_type!r}: {errors[0]}")
    num_layers = config.get_text_config().num_hidden_layers
    missing = sorted(set(range(num_layers)) - set(calls))
    if missing:
        raise UnsupportedModelError(f"model type {model_type!r}: layers {missing} of {num_layers} do not attend "
                                    f"through AttentionInterface (recurrent or other non-attention layers)")
    return ModelAttention(tuple(calls[i] for i in range(num_layers)))
