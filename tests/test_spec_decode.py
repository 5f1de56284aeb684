"""Speculative decoding by n-gram prompt lookup: the proposer alone, the settings, and the real model giving the
same greedy tokens with speculation on and off (stop strings and max_tokens cutting inside an accepted run, a
batch mixing speculating and non-speculating requests, preemption under a tiny KV pool, prefix-cache hits), with
drafts accepted as the engine's stats count them."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import build_tiny_model, run_to_completion

from backend import EngineConfig, LLMEngine, SamplingParams
from backend.ngram_proposer import NgramProposer, can_speculate
from backend.request import Request
from backend.sampler import accept_greedy

ROOT = Path(__file__).resolve().parents[1]


# -- the proposer ----------------------------------------------------------------------------------------------
def test_proposer_continues_the_longest_matching_suffix():
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    # suffix [1, 2, 3] occurs at the start (followed by 4, 5, 6); [2, 3] alone also occurs later (followed by 9)
    tokens = [1, 2, 3, 4, 5, 6, 7, 2, 3, 9, 8, 1, 2, 3]
    assert proposer.propose(tokens) == [4, 5, 6]


def test_proposer_takes_the_most_recent_occurrence_and_at_most_k_tokens():
    proposer = NgramProposer(2, prompt_lookup_min=2, prompt_lookup_max=2)
    assert proposer.propose([5, 6, 1, 1, 5, 6, 2, 2, 2, 5, 6]) == [2, 2]
    assert proposer.propose([5, 6, 1, 1, 5, 6, 2, 2, 2, 5, 6], max_drafts=1) == [2]
    assert proposer.propose([5, 6, 1, 1, 5, 6, 2, 2, 2, 5, 6], max_drafts=0) == []


def test_proposer_proposes_nothing_below_prompt_lookup_min_or_without_a_match():
    proposer = NgramProposer(4, prompt_lookup_min=2, prompt_lookup_max=4)
    assert proposer.propose([1, 2, 3, 4, 5, 6]) == []
    assert proposer.propose([7, 1, 2, 8, 9, 2]) == []  # only a 1-token match
    assert proposer.propose([2, 2]) == []
    # a match at the very end of the sequence proposes what follows it, fewer than k tokens
    assert proposer.propose([3, 4, 3, 4]) == [3, 4]


def test_proposer_ignores_matches_across_token_boundaries():
    # token 256 packs as bytes 00 01 00 00 and token 0 as 00 00 00 00: the bytes of token 1 (01 00 00 00) occur at
    # an odd offset, which is no occurrence of the token
    proposer = NgramProposer(2, prompt_lookup_min=1, prompt_lookup_max=1)
    assert proposer.propose([256, 0, 5, 1]) == []
    assert proposer.propose([256, 0, 1, 5, 1]) == [5, 1]


def test_proposer_and_settings_refuse_bad_bounds():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0, 1, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="below max_num_batched_tokens"):
        EngineConfig(num_speculative_tokens=8, max_num_batched_tokens=8)
    config = EngineConfig.from_dict({"num_speculative_tokens": "3", "prompt_lookup_min": "1",
                                     "prompt_lookup_max": "4"})
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 1, 4)
    assert EngineConfig().num_speculative_tokens == 0  # off by default


def test_greedy_verification_keeps_the_agreeing_prefix_and_one_token_of_the_model():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, plus the bonus token
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept_greedy([4, 5, 6], [8, 5, 6, 7]) == [8]


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.0, stop=["x"], stop_token_ids=[3], prompt_logprobs=1, n=2), True),
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(temperature=0.0, logprobs=1), False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.1), False),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), False),
    (SamplingParams(temperature=0.0, logit_bias={5: 1.0}), False),
    (SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]), False),
    (SamplingParams(temperature=0.0, min_tokens=4), False),  # until 4 tokens are out
])
def test_which_requests_may_speculate(params, allowed):
    assert can_speculate(Request("r", [1, 2, 3], params, (0,), 16)) is allowed


# -- the real model ------------------------------------------------------------------------------------------
GREEDY = dict(temperature=0.0)


def code_prompt(tokenizer) -> list[int]:
    """A chat prompt asking to copy a source file with one change: the answer repeats long runs of the prompt."""
    source = (ROOT / "backend" / "stopping.py").read_text()[:1500]
    message = "Rewrite this Python code, renaming the function stop_status to check_stop. Output only the code.\n\n"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message + source}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def list_prompt(tokenizer, topic: str) -> list[int]:
    message = f"Repeat this list exactly, then stop: {topic} one, {topic} two, {topic} three, {topic} four."
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def engines(default_model_dir):
    """The real model in fp32 without speculation and with k = 4 (same pool, prefix caching on)."""
    built = {k: LLMEngine(EngineConfig(model=str(default_model_dir), dtype="float32", num_blocks=256,
                                       num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=4))
             for k in (0, 4)}
    yield built
    for engine in built.values():
        engine.shutdown()


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    sinks = {rid: engine.add_request(prompt, params, request_id=rid) for rid, (prompt, params) in requests.items()}
    return run_to_completion(engine, sinks)


def tokens_of(deltas) -> list[int]:
    return [t for out in deltas for t in out.token_ids]


@pytest.mark.real_model
def test_greedy_tokens_equal_with_and_without_speculation_in_a_mixed_batch(engines, tokenizer):
    code = code_prompt(tokenizer)
    requests = {
        "code": (code, SamplingParams(max_tokens=32, **GREEDY)),
        "list": (list_prompt(tokenizer, "apple"), SamplingParams(max_tokens=24, **GREEDY)),
        # never speculate: logprobs wanted, and a sampled request
        "logprobs": (list_prompt(tokenizer, "pear"), SamplingParams(max_tokens=12, logprobs=1, **GREEDY)),
        "sampled": (list_prompt(tokenizer, "plum"), SamplingParams(max_tokens=8, temperature=0.8, seed=3)),
    }
    stats_before = engines[4].stats()
    want, got = run(engines[0], requests), run(engines[4], requests)
    for rid in ("code", "list", "logprobs"):
        assert tokens_of(got[rid]) == tokens_of(want[rid]), rid
        assert "".join(o.text for o in got[rid]) == "".join(o.text for o in want[rid])
        assert got[rid][-1].finish_reason == want[rid][-1].finish_reason
    assert len(tokens_of(got["logprobs"])) == len([lp for o in got["logprobs"] for lp in o.logprobs])
    assert got["sampled"][-1].finish_reason in ("stop", "length")
    stats = engines[4].stats()
    accepted = stats.spec_decode_num_accepted_tokens - stats_before.spec_decode_num_accepted_tokens
    proposed = stats.spec_decode_num_draft_tokens - stats_before.spec_decode_num_draft_tokens
    assert 0 < accepted <= proposed
    # accepted drafts saved steps: the code answer came in fewer deltas than tokens
    assert len(got["code"]) < len(tokens_of(got["code"]))
    assert stats.generation_tokens - stats_before.generation_tokens == sum(len(tokens_of(d)) for d in got.values())
    assert engines[0].stats().spec_decode_num_drafts == 0


@pytest.mark.real_model
def test_stop_string_and_max_tokens_inside_an_accepted_run_end_where_plain_decoding_ends(engines, tokenizer):
    code = code_prompt(tokenizer)
    free = run(engines[4], {"free": (code, SamplingParams(max_tokens=48, **GREEDY))})["free"]
    output = tokens_of(free)
    # a step that brought several tokens: stop in its middle token, by a stop string and by max_tokens
    start = sum(len(o.token_ids) for o in free[:next(i for i, o in enumerate(free) if len(o.token_ids) >= 3)])
    cut = start + 1  # output tokens up to and including the middle of that run
    text = tokenizer.decode(output[:cut])
    stop = text[-6:]
    assert stop.strip() and text.find(stop) == len(text) - len(stop), "the stop string must first occur there"
    requests = {"stop": (code, SamplingParams(max_tokens=48, stop=[stop], **GREEDY)),
                "length": (code, SamplingParams(max_tokens=cut, **GREEDY))}
    want, got = run(engines[0], requests), run(engines[4], requests)
    for rid in requests:
        assert tokens_of(got[rid]) == tokens_of(want[rid]), rid
        assert "".join(o.text for o in got[rid]) == "".join(o.text for o in want[rid]), rid
        assert got[rid][-1].finish_reason == want[rid][-1].finish_reason, rid
    assert got["length"][-1].finish_reason == "length" and len(tokens_of(got["length"])) == cut
    assert got["stop"][-1].finish_reason == "stop" and stop not in "".join(o.text for o in got["stop"])
    assert tokens_of(got["stop"]) == output[:cut]  # nothing emitted past the token that completed the stop string


@pytest.mark.real_model
def test_speculation_under_preemption_and_prefix_hits_gives_the_plain_greedy_tokens(engines, default_model_dir,
                                                                                     tokenizer):
    # Plain text that repeats itself (no shared chat template: each request holds its own blocks).
    prompts = {f"r{i}": tokenizer.encode(f"{topic} one, {topic} two, {topic} three, {topic} one, {topic} two,")
               for i, topic in enumerate(("red", "green"))}
    requests = {rid: (p, SamplingParams(max_tokens=28, ignore_eos=True, **GREEDY)) for rid, p in prompts.items()}
    want = run(engines[0], requests)
    # A pool for one request and two blocks: the second is preempted and recomputed, drafts and all.
    tiny = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="float32", block_size=8,
                                  num_blocks=-(-(len(prompts["r0"]) + 28) // 8) + 2, num_speculative_tokens=4,
                                  prompt_lookup_min=2, prompt_lookup_max=4))
    try:
        got = run(tiny, requests)
        again = run(tiny, {"r0-again": requests["r0"]})["r0-again"]  # the prompt's blocks are prefix-cache hits
        stats = tiny.stats()
    finally:
        tiny.shutdown()
    for rid in requests:
        assert tokens_of(got[rid]) == tokens_of(want[rid]), rid
    assert tokens_of(again) == tokens_of(want["r0"]) and again[0].num_cached_tokens > 0
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.kv.used_blocks == 0  # every block back once all finished


def test_zero_cost_runner_verifies_drafts_against_its_cycle(make_engine, tiny_model_dir):
    """The serving-path runner takes drafts too: once its token cycle repeats, the proposer guesses it right."""
    outputs, stats = {}, {}
    for k in (0, 4):
        engine = make_engine(tiny_model_dir, model_runner="zero_cost", num_speculative_tokens=k)
        sink = engine.add_request([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True, **GREEDY), request_id="z")
        deltas = run_to_completion(engine, {"z": sink})["z"]
        outputs[k], stats[k] = tokens_of(deltas), engine.stats()
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 200
    assert outputs[4] == outputs[0] and len(outputs[4]) == 200
    assert stats[4].spec_decode_num_accepted_tokens > 100 and stats[4].num_steps < stats[0].num_steps / 2
    assert stats[4].generation_tokens == 200


def test_benchmark_measures_a_run_and_its_acceptance(make_engine, tiny_model_dir):
    from benchmarks.speculative import measure

    engine = make_engine(tiny_model_dir, model_runner="zero_cost", num_speculative_tokens=2)
    row = measure(engine, [5, 6, 7], 150)
    assert row["output_tokens"] == len(row["token_ids"]) == 150
    assert 0 < row["accepted_tokens"] <= row["draft_tokens"] and 0 < row["acceptance"] <= 1
    assert row["steps_after_first"] < 149 and row["tokens_per_s"] > 0 and row["itl_p50_ms"] >= 0


@pytest.fixture(scope="module")
def looping_model_dir(tmp_path_factory, tokenizer):
    """A tiny random llama whose small initial weights (range 0.02) make its greedy output fall into loops, so the
    proposer finds drafts in its own output, some right and some wrong."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-looping"), "llama", tokenizer, initializer_range=0.02)


@pytest.mark.parametrize("settings", [
    pytest.param(dict(attention_backend="torch"), id="torch"),
    pytest.param(dict(attention_backend="triton"), id="triton-interpreted", marks=pytest.mark.slow),
    pytest.param(dict(model_impl="transformers"), id="transformers"),
    pytest.param(dict(block_size=4, enable_prefix_caching=False), id="small-blocks-no-caching")])
def test_every_model_path_gives_the_same_greedy_tokens_with_drafts(settings, make_engine, looping_model_dir):
    """The compact decoder on the torch and Triton backends (the selector's default, ``cpu``, runs in the real-model
    tests), transformers' modules, and small blocks without prefix caching."""
    if settings.get("attention_backend") == "triton":
        pytest.importorskip("triton")
    prompts = {"a": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], "b": [9, 10, 11, 9, 10, 11, 9]}
    requests = {rid: (p, SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)) for rid, p in prompts.items()}
    outputs, stats = {}, {}
    for k in (0, 3):
        engine = make_engine(looping_model_dir, num_speculative_tokens=k, prompt_lookup_min=1, **settings)
        outputs[k] = {rid: tokens_of(d) for rid, d in run(engine, requests).items()}
        stats[k] = engine.stats()
    assert outputs[3] == outputs[0]
    assert 0 < stats[3].spec_decode_num_accepted_tokens < stats[3].spec_decode_num_draft_tokens


def test_served_config_names_the_settings_and_leaves_speculation_off():
    """``config.pbtxt``'s parameters build an EngineConfig as the Triton model builds it (adapter keys aside)."""
    import re

    text = (ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    settings = dict(re.findall(r'parameters: \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}', text))
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        assert key in settings
    settings.pop("vllm_metrics"), settings.pop("drain_grace_s")
    config = EngineConfig.from_dict(settings)
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (0, 2, 5)
