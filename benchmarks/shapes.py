"""Model shapes beyond the default, at the sizes people serve on CPUs, with random weights.

People who serve on CPUs run 0.3-3B models and larger, where a decode step is bound by reading the weights
(memory bandwidth) and a prefill by GEMM throughput; the default 135M model is mostly per-step overhead. No
weights can be downloaded here, so each shape is a Llama-architecture config with random weights (seeded,
normal with the config's ``initializer_range``, as transformers initializes a new model), written once as
bf16 safetensors beside the default model's tokenizer. Every system then loads the very same weights (ours,
vLLM from the same directory: the same bytes, unlike vLLM's own ``load_format="dummy"``), so their greedy
tokens can be compared too; speed does not depend on what the weights are.

``python -m benchmarks --shape NAME`` runs the benchmark on one (:data:`SHAPES`). The directories live under
``$LLM_BACKEND_CACHE/shapes`` (``~/.cache/triton-llm-backend/shapes``); a 3B shape takes about 6 GB there.
"""

from __future__ import annotations

from pathlib import Path

SMOLLM2_VOCAB = 49152  # the default model's tokenizer; every shape uses it, so prompts are the same token ids

# Llama-architecture bodies of published models (hidden size, layers, heads, KV heads, MLP width).
SHAPES: dict[str, dict] = {
    "smollm2-360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                         intermediate_size=2560, tie_word_embeddings=True),  # SmolLM2-360M's config
    "smollm2-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                         intermediate_size=8192, tie_word_embeddings=True),  # SmolLM2-1.7B's config
    "llama-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                     head_dim=128, intermediate_size=8192, tie_word_embeddings=True),  # Llama 3.2 3B's body
}
COMMON = dict(vocab_size=SMOLLM2_VOCAB, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
              hidden_act="silu", initializer_range=0.02, bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"])


def shape_dir(name: str) -> Path:
    from backend.model_loader import cache_dir

    return cache_dir() / "shapes" / name


def ensure_shape(name: str) -> Path:
    """The directory of shape ``name`` (config, bf16 safetensors, tokenizer), written on first use (seed 0).

    Raises:
        ValueError: an unknown shape name.
    """
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    target = shape_dir(name)
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from backend.model_loader import resolve_model_dir, save_model_dir

    config = LlamaConfig(**COMMON, **SHAPES[name])
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)  # initialized in bf16: no fp32 copy
    save_model_dir(model, AutoTokenizer.from_pretrained(resolve_model_dir(None)), target)
    return target


def parameter_count(name: str) -> int:
    """Parameters of shape ``name`` (the tied embedding once)."""
    s = {**COMMON, **SHAPES[name]}
    head_dim = s.get("head_dim") or s["hidden_size"] // s["num_attention_heads"]
    q, kv = s["num_attention_heads"] * head_dim, s["num_key_value_heads"] * head_dim
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    return s["num_hidden_layers"] * per_layer + s["vocab_size"] * hidden + hidden
