"""Model families users load: greedy output equal to transformers' own generate, or a clear refusal at load.

Tiny random-weight models built from transformers' own config classes (2 layers, hidden 64), fp32. Windows of
8 tokens with 4-token blocks, prompts longer than the window, chunked prefill (16-token steps) and a pool small
enough that requests are preempted and recomputed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backend import SamplingParams
from backend.attention_options import UnsupportedAttentionError, attention_options
from backend.model_support import UnsupportedModelError, inspect_attention
from conftest import GREEDY, ReferenceModel, check_all, run_to_completion

WINDOW = 8
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)

FAMILIES = {  # name -> (model_type, config overrides beyond BASE)
    "llama": ("llama", {}),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", {}),
    "qwen2-window-all-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)),
    "qwen2-window-max-window-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                     max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    # soft-cap 1.0: small enough that ignoring it would change the text
    "gemma2-window-softcap": ("gemma2", dict(sliding_window=WINDOW, attn_logit_softcapping=1.0)),
    "gemma3-text-local-global": ("gemma3_text", dict(sliding_window=WINDOW,
                                                      layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "starcoder2-window": ("starcoder2", dict(sliding_window=WINDOW)),
    "gpt-neox": ("gpt_neox", dict(num_key_value_heads=None)),  # multi-head only: no KV-head setting
    "granite": ("granite", dict(attention_multiplier=0.3, residual_multiplier=0.5, embedding_multiplier=2.0,
                                logits_scaling=2.0)),
    "gpt-oss-sinks-window": ("gpt_oss", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),
}

UNIFORM_WINDOW = {"mistral-window", "qwen2-window-all-layers", "starcoder2-window"}  # every layer windowed alike


def build_family(directory, model_type: str, overrides: dict, tokenizer) -> str:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), max_position_embeddings=512,
                                  initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                                  **{k: v for k, v in {**BASE, **overrides}.items() if v is not None})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if model_type == "gpt_oss":  # sinks of the default init are 0; make them matter
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, tokenizer):
    built = {}

    def get(name: str) -> str:
        if name not in built:
            model_type, overrides = FAMILIES[name]
            built[name] = build_family(tmp_path_factory.mktemp(name), model_type, overrides, tokenizer)
        return built[name]

    return get


def prompts_for(tokenizer, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, len(tokenizer) - 10, (n,), generator=generator).tolist() for n in lengths]


def check_greedy(engine, model_dir, prompts, max_tokens, label):
    check_all(engine, ReferenceModel(model_dir), prompts, max_tokens, label)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers_generate_with_chunked_prefill_and_preemption(name, family_dir, tokenizer,
                                                                                   make_engine):
    model_dir = family_dir(name)
    # 3 prompts of 9-30 tokens (longer than the window), 16 new tokens each: 16-token steps split the prompts,
    # and 14 blocks of 4 tokens cannot hold all three at once, so requests are preempted and recomputed. A model
    # windowed on every layer holds at most cdiv(8 - 1 + 16, 4) + 1 = 7 blocks a request: 8 blocks then.
    uniform_window = name in UNIFORM_WINDOW
    engine = make_engine(model_dir, block_size=4, num_blocks=8 if uniform_window else 14, max_num_batched_tokens=16,
                         max_model_len=128)
    assert (engine.debug_snapshot().sliding_window is not None) == uniform_window
    check_greedy(engine, model_dir, prompts_for(tokenizer, [30, 21, 9], seed=1), 16, name)
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.kv.used_blocks == 0


@pytest.mark.parametrize("name", ["mistral-window", "gemma2-window-softcap", "gpt-oss-sinks-window"])
def test_triton_kernels_honour_window_softcap_and_sinks_end_to_end(name, family_dir, tokenizer, make_engine):
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter (set by conftest on machines without a GPU)")
    model_dir = family_dir(name)
    engine = make_engine(model_dir, block_size=4, attention_backend="triton", max_num_batched_tokens=12, max_model_len=128)
    check_greedy(engine, model_dir, prompts_for(tokenizer, [19, 5], seed=2), 8, f"{name}/kernels")


def test_sliding_window_model_stops_growing_its_kv_blocks(family_dir, tokenizer, make_engine):
    """Mistral with a window of 8 and 4-token blocks: each step frees the blocks wholly behind the window, so a
    request holds at most cdiv(8 - 1 + 1, 4) + 1 = 3 blocks however long its context."""
    model_dir = family_dir("mistral-window")
    engine = make_engine(model_dir, block_size=4, max_model_len=128)
    assert engine.debug_snapshot().sliding_window == WINDOW
    sink = engine.add_request(prompts_for(tokenizer, [6], seed=3)[0], SamplingParams(max_tokens=60, **GREEDY), "0")
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(engine.stats().kv.used_blocks)
    tokens = [t for out in run_to_completion(engine, {"0": sink})["0"] for t in out.token_ids]
    assert len(tokens) == 60  # a context of 66 tokens: 17 blocks without freeing
    assert max(used) <= 3  # bounded by the window, not growing with the context
    assert used[-2] >= 2  # (the last step's entry is after the finished request freed everything)


def test_hybrid_window_model_keeps_every_block(family_dir, tokenizer, make_engine):
    """Gemma 3's global layers need the whole context, so no block is freed (the documented cost)."""
    model_dir = family_dir("gemma3-text-local-global")
    engine = make_engine(model_dir, block_size=4, max_model_len=128)
    assert engine.debug_snapshot().sliding_window is None
    assert [layer.sliding_window for layer in engine.model_attention.layers] == [WINDOW, None]
    engine.add_request(prompts_for(tokenizer, [6], seed=3)[0], SamplingParams(max_tokens=30, **GREEDY), "0")
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats().kv.used_blocks)
    assert peak == -(-35 // 4)  # every token's block held until the end (the last token is never computed)


def test_prefix_cache_hit_on_a_window_model_matches_generate(family_dir, tokenizer, make_engine):
    """A second request sharing a long prefix reuses cached blocks, including ones behind the window."""
    model_dir = family_dir("mistral-window")
    engine = make_engine(model_dir, block_size=4, max_model_len=128)
    shared = prompts_for(tokenizer, [24], seed=4)[0]
    check_greedy(engine, model_dir, [shared + [11, 12]], 6, "first")
    check_greedy(engine, model_dir, [shared + [13, 14, 15]], 6, "second")
    assert engine.stats().kv.prefix_cache_hits >= 24


# ---------------------------------------------------------------- refusals


REFUSED = {  # name -> (model_type, overrides, words the error must contain)
    "t5-encoder-decoder": ("t5", dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16), "encoder-decoder"),
    "mamba-state-space": ("mamba", dict(hidden_size=64, num_hidden_layers=2, state_size=8), "state-space"),
    "jamba-hybrid-recurrent": ("jamba", dict(hidden_size=64, num_hidden_layers=2), "recurrent"),
    "zamba2-hybrid-recurrent": ("zamba2", dict(hidden_size=64), "recurrent"),
    "llama4-chunked-attention": ("llama4_text", dict(hidden_size=64, num_hidden_layers=2,
                                                     attention_chunk_size=16), "chunked_attention"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_architecture_is_refused_at_load(name, tmp_path, tokenizer, make_engine):
    model_type, overrides, feature = REFUSED[name]
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **overrides)
    config.save_pretrained(tmp_path)  # no weights needed: refused from the config, before they are read
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=feature) as error:
        make_engine(str(tmp_path))
    assert repr(config.model_type) in str(error.value)


def test_bidirectional_attention_is_refused_at_load(tmp_path, tokenizer, make_engine):
    model_dir = build_family(tmp_path, "gemma3_text", dict(use_bidirectional_attention=True), tokenizer)
    with pytest.raises(UnsupportedModelError, match="'gemma3_text'.*bidirectionally"):
        make_engine(model_dir)


def test_unknown_attention_keyword_is_refused_at_load(family_dir, monkeypatch):
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(family_dir("llama"))
    original = modeling_llama.LlamaAttention.forward
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward",
                        lambda self, *args, **kwargs: original(self, *args, position_bias=torch.ones(1), **kwargs))
    with pytest.raises(UnsupportedModelError, match="'llama'.*'position_bias'.*refusing"):
        inspect_attention(model)


def test_attention_keywords_are_honoured_or_refused():
    module = torch.nn.Module()
    assert attention_options(module, dict(dropout=0.0, scaling=0.1, sliding_window=None, position_ids=1)).is_plain
    options = attention_options(module, dict(sliding_window=8, softcap=30.0, s_aux=torch.zeros(4)))
    assert (options.sliding_window, options.softcap, tuple(options.sinks.shape)) == (8, 30.0, (4,))
    assert attention_options(module, dict(some_new_flag=False, other=None)).is_plain  # defaults are harmless
    for kwargs, message in [(dict(some_new_flag=True), "'some_new_flag'"), (dict(dropout=0.1), "dropout"),
                            (dict(is_causal=False), "bidirectionally"), (dict(sliding_window=0), "positive")]:
        with pytest.raises(UnsupportedAttentionError, match=message):
            attention_options(module, kwargs)


@pytest.mark.server
def test_server_refuses_to_start_with_an_unsupported_model(tmp_path, tokenizer):
    """tritonserver with a Mamba model configured exits with the reason instead of serving half-working."""
    import shutil
    import subprocess

    from serve.launch import DEFAULT_MODEL_REPOSITORY, build_command
    from triton_server import free_ports

    model_dir = tmp_path / "mamba"
    AutoConfig.for_model("mamba", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2).save_pretrained(
        model_dir)
    tokenizer.save_pretrained(model_dir)
    repository = tmp_path / "repository"
    (repository / "llm" / "1").mkdir(parents=True)
    shutil.copy(DEFAULT_MODEL_REPOSITORY / "llm" / "config.pbtxt", repository / "llm")
    shutil.copy(DEFAULT_MODEL_REPOSITORY / "llm" / "2" / "model.py", repository / "llm" / "1")
    (repository / "llm" / "1" / "engine.json").write_text(json.dumps({"model": str(model_dir)}))
    command = build_command(repository, *free_ports(3))
    result = subprocess.run(command.argv, env=command.env, capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    log = result.stdout + result.stderr
    assert "'mamba'" in log and "state-space" in log
