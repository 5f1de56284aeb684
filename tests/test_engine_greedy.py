"""Greedy outputs under continuous batching equal transformers' generate for each prompt alone."""

from __future__ import annotations

import random

import pytest

from backend import SamplingParams
from conftest import (GREEDY, ReferenceModel, assert_matches_reference, build_tiny_model, check_all, drain,
                      run_to_completion)



def mixed_prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = "the a cat dog runs quickly over lazy river mountain blue green seven twelve why how".split()
    prompts = []
    for n in lengths:
        ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(n)))
        prompts.append(ids[:n])
    return prompts




def test_mixed_prompt_lengths_match_solo_generate(make_engine, tiny_model_dir, tiny_reference, tokenizer):
    engine = make_engine(tiny_model_dir)
    prompts = mixed_prompts(tokenizer, [1, 3, 15, 16, 17, 40, 70])
    check_all(engine, tiny_reference, prompts, 24, "mixed")
    assert engine.stats().kv.used_blocks == 0


def test_requests_joining_mid_flight_match_solo_generate(make_engine, tiny_model_dir, tiny_reference, tokenizer):
    engine = make_engine(tiny_model_dir)
    prompts = mixed_prompts(tokenizer, [5, 33, 12, 50, 2, 21], seed=1)
    sinks = {}
    for i, prompt in enumerate(prompts):
        sinks[str(i)] = engine.add_request(prompt, SamplingParams(max_tokens=20, **GREEDY), request_id=str(i))
        for _ in range(3):  # each newcomer joins while the earlier ones are decoding
            engine.step()
    assert engine.stats().num_running > 1
    results = run_to_completion(engine, sinks)
    for i, prompt in enumerate(prompts):
        got = [t for out in results[str(i)] for t in out.token_ids]
        want, logits = tiny_reference.greedy(prompt, 20)
        assert_matches_reference(got, want, logits, f"join request {i}")


def test_preempted_requests_match_solo_generate(make_engine, tiny_model_dir, tiny_reference, tokenizer):
    # 6 requests of ~30 tokens + 30 new need ~24 blocks of 16; 10 blocks force recompute preemption.
    engine = make_engine(tiny_model_dir, num_blocks=10)
    prompts = mixed_prompts(tokenizer, [30, 25, 28, 31, 20, 27], seed=2)
    check_all(engine, tiny_reference, prompts, 30, "preempt")
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv.used_blocks == 0


@pytest.mark.parametrize("group_bytes", [1, 16 << 10])
def test_decode_in_small_groups_matches_solo_generate(group_bytes, monkeypatch, make_engine, tiny_model_dir,
                                                      tiny_reference, tokenizer):
    # Decode attention gathers a group of sequences at a time: force groups of one sequence (1 byte) and of
    # 8 blocks (16 KiB of 2 KiB blocks: 1-8 sequences by their length), on a pool small enough to preempt, so
    # groups change shape from step to step.
    from backend.attention import torch_sdpa

    monkeypatch.setattr(torch_sdpa, "DECODE_GROUP_BYTES", group_bytes)
    engine = make_engine(tiny_model_dir, num_blocks=14, attention_backend="torch")  # the gather path
    check_all(engine, tiny_reference, mixed_prompts(tokenizer, [2, 30, 9, 17, 44, 5], seed=2), 28, "groups")
    assert engine.stats().num_preemptions > 0
    assert engine.stats().kv.used_blocks == 0


def test_chunked_prefill_matches_solo_generate(make_engine, tiny_model_dir, tiny_reference, tokenizer):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=7)
    prompts = mixed_prompts(tokenizer, [45, 3, 23], seed=3)
    sinks = {str(i): engine.add_request(p, SamplingParams(max_tokens=12, **GREEDY), request_id=str(i))
             for i, p in enumerate(prompts)}
    engine.step()
    assert engine.stats().last_step_num_tokens == 7  # the 45-token prompt is split across steps
    results = run_to_completion(engine, sinks)
    for i, prompt in enumerate(prompts):
        got = [t for out in results[str(i)] for t in out.token_ids]
        want, logits = tiny_reference.greedy(prompt, 12)
        assert_matches_reference(got, want, logits, f"chunked request {i}")


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3"])
def test_other_model_families_match_solo_generate(family, make_engine, tmp_path, tokenizer):
    model_dir = build_tiny_model(tmp_path / family, family, tokenizer)
    engine = make_engine(model_dir, num_blocks=12, max_num_batched_tokens=32)
    assert engine.debug_snapshot().decoder == "LlamaDecoder"  # the compact decoder, not transformers'
    prompts = mixed_prompts(tokenizer, [9, 40, 17], seed=4)
    check_all(engine, ReferenceModel(model_dir), prompts, 16, family)


@pytest.mark.real_model
def test_real_model_greedy_matches_solo_generate(make_engine, default_model_dir, tokenizer):
    engine = make_engine(str(default_model_dir), num_blocks=64)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is the capital of France?", "Write a haiku about rivers.", "Count to five.")]
    prompts.append(tokenizer.encode("The quick brown fox"))
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    results = check_all(engine, ReferenceModel(str(default_model_dir)), prompts, 24, "smollm2")
    text = "".join(out.text for out in results["0"])
    assert "Paris" in text


@pytest.mark.real_model
def test_real_model_in_bf16_keeps_its_logits_in_fp32(make_engine, default_model_dir, tokenizer):
    """The bf16 LM head's logits stay fp32 on the C++ kernels: rounded to bf16 (1/16 apart near 10) the README's
    question tied "The" with "L" (-1.9102 both), greedy took the lower id and answered "L'Étoile, la Marseillaise,
    ...". The answer is the fp32 one, the first token's logprobs are within bf16 arithmetic of fp32's (0.01-0.16
    here, by CPU), and their gap is no multiple of bf16's 1/16 step at these logits."""
    import torch

    import kernels.cpu

    if not kernels.cpu.small_gemm_available(torch.bfloat16):
        pytest.skip("no bf16 small_gemm here: the LM head runs through oneDNN in bf16")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    answers = {}
    for dtype in ("float32", "bfloat16"):
        engine = make_engine(str(default_model_dir), dtype=dtype, attention_backend="cpu", num_blocks=16)
        outs = run_to_completion(engine, {"q": engine.add_request(prompt, params, request_id="q")})["q"]
        answers[dtype] = ("".join(out.text for out in outs), outs[0].logprobs[0].top)
    (text32, top32), (text16, top16) = answers["float32"], answers["bfloat16"]
    assert text16 == text32 and text16.startswith("The capital of France is Paris")
    assert top16.keys() == top32.keys() and all(abs(top16[t] - top32[t]) < 0.25 for t in top32)
    first, second = sorted(top16.values(), reverse=True)
    steps = (first - second) * 16
    assert abs(steps - round(steps)) > 1e-3, (first, second)


def test_single_token_stream_has_one_final_delta(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    sink = engine.add_request([5, 6, 7], SamplingParams(max_tokens=1, **GREEDY), request_id="one")
    outs = run_to_completion(engine, {"one": sink})["one"]
    assert [o.finish_reason for o in outs] == ["length"]
    assert outs[0].num_output_tokens == 1 and len(outs[0].token_ids) == 1
    assert drain(sink) == []


def test_triton_kernel_path_matches_the_torch_path(monkeypatch, make_engine, tiny_model_dir, tiny_reference,
                                                   tokenizer):
    """The triton attention backend (here under TRITON_INTERPRET) gives the same tokens;
    decode rows go through the decode kernel, the other rows of a mixed step through the prefill kernel."""
    import os

    import kernels

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (set by conftest on machines without a GPU)")
    calls = {"decode": 0, "prefill": 0}

    def counting(name, kernel):
        def wrapper(query, *args, **kwargs):
            calls[name] += query.shape[0]
            return kernel(query, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(kernels, "paged_decode_attention", counting("decode", kernels.paged_decode_attention))
    monkeypatch.setattr(kernels, "paged_prefill_attention", counting("prefill", kernels.paged_prefill_attention))
    engine = make_engine(tiny_model_dir, attention_backend="triton", max_num_batched_tokens=24)
    prompts = mixed_prompts(tokenizer, [3, 30, 17], seed=5)
    check_all(engine, tiny_reference, prompts, 6, "kernels")
    assert calls["decode"] > 0 and calls["prefill"] > 0


def _backends_here() -> list:
    """(backend, dtype) for every attention backend the selector can choose for the tiny model on this machine;
    the fp32 torch and cpu backends run in the fast suite, the rest (Triton interpreted, bf16) are slow."""
    import torch

    from backend.attention import available_backends

    cases = []
    for dtype in ("float32", "bfloat16"):
        for name in available_backends(torch.device("cpu"), getattr(torch, dtype), 16):
            fast = dtype == "float32" and name != "triton"
            cases.append(pytest.param(name, dtype, marks=() if fast else pytest.mark.slow, id=f"{name}-{dtype}"))
    return cases


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
@pytest.mark.parametrize("backend,dtype", _backends_here())
def test_every_attention_backend_matches_solo_generate(backend, dtype, model_impl, make_engine, tiny_model_dir,
                                                       tiny_reference, tokenizer):
    """Each backend the selector can choose here, in each dtype, with the compact decoder and with transformers'
    modules, gives transformers' generate's greedy tokens (in the same dtype)."""
    import torch

    engine = make_engine(tiny_model_dir, attention_backend=backend, dtype=dtype, model_impl=model_impl,
                         max_num_batched_tokens=20)
    snapshot = engine.debug_snapshot()
    assert snapshot.attention_backend == backend
    assert (snapshot.decoder is None) == (model_impl == "transformers")
    reference = tiny_reference if dtype == "float32" else ReferenceModel(tiny_model_dir, getattr(torch, dtype))
    check_all(engine, reference, mixed_prompts(tokenizer, [5, 33, 18], seed=9), 20, f"{backend}/{dtype}/{model_impl}")


def test_selector_logs_its_choice_once_and_the_setting_overrides_it(caplog, make_engine, tiny_model_dir):
    """``auto`` picks the cpu backend on a CPU where kernels/cpu builds (torch elsewhere) and says so once in the
    log, not per step; ``attention_backend`` forces another; an unavailable or unknown one is refused."""
    import logging

    import torch

    from backend import EngineConfig, cpu_ops
    from backend.attention import select_attention_backend

    with caplog.at_level(logging.INFO, logger="backend.attention.selector"):
        engine = make_engine(tiny_model_dir)
        check = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY), request_id="r")
        run_to_completion(engine, {"r": check})
    choices = [r.getMessage() for r in caplog.records if r.name == "backend.attention.selector"]
    auto = "cpu" if cpu_ops.available() else "torch"
    assert len(choices) == 1 and choices[0].startswith(f"attention backend: {auto} (auto"), choices
    assert engine.debug_snapshot().attention_backend == auto
    assert make_engine(tiny_model_dir, attention_backend="torch").debug_snapshot().attention_backend == "torch"
    with pytest.raises(ValueError, match="'cpu' is not available here: the C.. kernels run on CPU.*available: torch"):
        select_attention_backend("cpu", torch.device("meta"), torch.float32, 16)
    with pytest.raises(ValueError, match="'triton' is not available here: head_dim 24"):
        select_attention_backend("triton", torch.device("cpu"), torch.float32, 24)
    with pytest.raises(ValueError, match="attention_backend must be auto, torch, cpu or triton"):
        EngineConfig(attention_backend="flash")
    for device in ("tpu", "cpu:0", "cuda:x"):  # refused when read, not at the first forward pass
        with pytest.raises(ValueError, match="device must be cpu or cuda"):
            EngineConfig(device=device)


def test_cpu_prefill_kernel_through_chunked_prefill_and_prefix_hits_matches_solo_generate(
        monkeypatch, make_engine, tmp_path, tokenizer):
    """With head_dim 64 the prompt rows take kernels/cpu's prefill kernel (blocks read in place): whole prompts,
    chunks after a computed prefix (max_num_batched_tokens 20) and prompts whose prefix blocks come from the
    prefix cache all give solo generate's greedy tokens (fp32)."""
    from backend import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ compiler on this machine")
    model_dir = build_tiny_model(tmp_path / "tiny-hd64", "llama", tokenizer, head_dim=64)
    rows = []
    kernel = cpu_ops.paged_prefill_attention
    monkeypatch.setattr(cpu_ops, "paged_prefill_attention",
                        lambda q, *args, **kwargs: rows.append(q.shape[0]) or kernel(q, *args, **kwargs))
    engine = make_engine(model_dir, max_num_batched_tokens=20)
    reference = ReferenceModel(model_dir)
    prompts = mixed_prompts(tokenizer, [5, 33, 18, 47], seed=11)
    check_all(engine, reference, prompts, 12, "hd64")
    again = check_all(engine, reference, [p + [11, 12, 13] for p in prompts], 8, "hd64 prefix hits")
    assert sum(rows) > 0
    assert any(out.num_cached_tokens > 0 for outs in again.values() for out in outs)


@pytest.mark.parametrize("family,dtype,num_requests", [("llama", "float32", 5), ("llama", "bfloat16", 5),
                                                        ("qwen2", "bfloat16", 5), ("llama", "float32", 80),
                                                        ("llama", "bfloat16", 80)])
def test_decode_layers_in_one_call_equal_the_python_layer_loop(family, dtype, num_requests, monkeypatch, make_engine,
                                                              tmp_path, tokenizer):
    """Decode steps run every layer in one C++ call (cpu_ops.decode_layers): each such step is also run through
    the Python layer loop first (its KV writes are the same values to the same slots), and the final hidden states
    (the LM head's input) must be equal bit for bit; with a QKV bias (qwen2), in fp32 and bf16, over steps whose batch grows and shrinks, and
    (80 requests) over 64 rows, where the GEMMs' rows take many passes over each group of weights."""
    import torch

    from backend import cpu_ops

    model_dir = build_tiny_model(tmp_path / family, family, tokenizer)
    engine = make_engine(model_dir, dtype=dtype, num_blocks=64 if num_requests < 64 else 512,
                         max_num_batched_tokens=64 if num_requests < 64 else 4096)
    decoder = engine.engine_core.model_runner.decoder  # patched below: the core itself
    if not decoder.decode_in_one_call:
        pytest.skip("no C++ kernels or small-batch GEMMs on this machine")
    if num_requests > 64 and cpu_ops.small_gemm_max_rows(getattr(torch, dtype)) < 16:
        pytest.skip("the small-batch GEMMs take a few rows here (AVX2): steps of many rows never run in one call")
    forward, steps = type(decoder).final_hidden, []

    def both(self, input_ids, positions, meta, logits_rows):
        if not self._decodes_in_one_call(meta, input_ids.shape[0]):
            return forward(self, input_ids, positions, meta, logits_rows)
        self.decode_in_one_call = False
        want = forward(self, input_ids, positions, meta, logits_rows)
        self.decode_in_one_call = True
        got = forward(self, input_ids, positions, meta, logits_rows)
        steps.append((input_ids.shape[0], torch.equal(got, want)))
        return got

    monkeypatch.setattr(type(decoder), "final_hidden", both)
    prompts = mixed_prompts(tokenizer, [3, 30, 12, 47, 5] * (num_requests // 5), seed=5)
    sinks = {str(i): engine.add_request(p, SamplingParams(max_tokens=6 + 5 * (i % 5), **GREEDY), request_id=str(i))
             for i, p in enumerate(prompts)}
    run_to_completion(engine, sinks)
    assert len({rows for rows, _ in steps}) >= 3, steps  # decode batches of several sizes went through it
    if num_requests > 64 and cpu_ops.small_gemm_max_rows(getattr(torch, dtype)) > 64:
        assert max(rows for rows, _ in steps) == num_requests, steps
    assert all(equal for _, equal in steps), steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_too_large_for_two_copies_keeps_the_tile_layout_only_and_decodes_the_same(
        dtype, monkeypatch, make_engine, tiny_model_dir, tiny_reference, tokenizer):
    """Past ``SMALL_GEMM_WEIGHT_LIMIT_BYTES`` (0 here, so the tiny model is past it), where small_gemm runs prompts in
    slices (AVX-512 vector units), every linear keeps only the tile layout, decode steps still run in one call, and
    a step whose prompts exceed one slice's rows gives the reference's greedy tokens (fp32; bf16: those of
    transformers' bf16 model up to bf16's near-ties)."""
    import torch

    from backend.models import llama

    monkeypatch.setattr(llama, "SMALL_GEMM_WEIGHT_LIMIT_BYTES", 0)
    engine = make_engine(tiny_model_dir, dtype=dtype, max_num_batched_tokens=1024)
    decoder = engine.engine_core.model_runner.decoder
    head = decoder.lm_head
    if head.small_batch is None or not llama._small_gemm_slices_prompts(decoder.embed_tokens.weight):
        pytest.skip("small_gemm does not take prompts in slices here (AVX2 takes every GEMM; AMX slices of 64)")
    linears = [head, *(getattr(layer, name) for layer in decoder.layers
                       for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
    assert all(linear.weight is None and linear.small_batch is not None for linear in linears)
    assert decoder.decode_in_one_call
    rows = head.small_batch_rows
    prompts = mixed_prompts(tokenizer, [120, 90, 70, 40], seed=8)
    assert sum(map(len, prompts)) > rows  # the first step's GEMMs take more rows than one slice
    reference = tiny_reference if dtype == "float32" else ReferenceModel(tiny_model_dir, torch.bfloat16)
    check_all(engine, reference, prompts, 8, f"tile layout only, {dtype}")
