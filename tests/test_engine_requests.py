"""Request lifecycle: stopping rules, seeds, aborts, bad input, and every block back in the pool."""

from __future__ import annotations

import time

import pytest
import torch

from backend import EngineConfig, LLMEngine, SamplingParams
from backend.sampling_params import generator_seed
from conftest import build_tiny_model, drain, run_to_completion


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One engine for the tests that leave it idle and need no settings of their own."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, num_blocks=256, dtype="float32"))
    yield engine
    engine.shutdown()


def tokens(outs):
    return [t for o in outs for t in o.token_ids]


def text(outs):
    return "".join(o.text for o in outs)


def test_exact_max_tokens_with_ignore_eos(engine):
    sinks = {str(n): engine.add_request([3, 4, 5, n], SamplingParams(max_tokens=n, temperature=0.8, seed=n,
                                                                     ignore_eos=True), request_id=str(n))
             for n in (1, 7, 33)}
    results = run_to_completion(engine, sinks)
    for n in (1, 7, 33):
        outs = results[str(n)]
        assert len(tokens(outs)) == n
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == n
        assert [o.finished for o in outs].count(True) == 1


def test_stop_token_id_stops_and_min_tokens_holds_it_off(engine):
    prompt = [10, 11, 12]
    first = tokens(run_to_completion(engine, {"a": engine.add_request(prompt, SamplingParams(
        max_tokens=1, temperature=0.0), request_id="a")})["a"])[0]
    # Declare the greedy first token a stop token: without min_tokens the request ends at once ...
    outs = run_to_completion(engine, {"b": engine.add_request(prompt, SamplingParams(
        max_tokens=10, temperature=0.0, stop_token_ids=[first]), request_id="b")})["b"]
    assert tokens(outs) == [first] and outs[-1].finish_reason == "stop"
    # ... with min_tokens=4 it cannot be sampled for the first 4 tokens.
    outs = run_to_completion(engine, {"c": engine.add_request(prompt, SamplingParams(
        max_tokens=10, temperature=0.0, stop_token_ids=[first], min_tokens=4), request_id="c")})["c"]
    assert first not in tokens(outs)[:4]
    assert len(tokens(outs)) >= 4


def test_stop_string_is_cut_and_never_streamed(engine, tokenizer):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = text(run_to_completion(engine, {"a": engine.add_request([7, 8, 9], params, request_id="a")})["a"])
    assert len(full) > 20
    stop = full[10:16]  # a stop string in the middle, likely spanning several tokens
    outs = run_to_completion(engine, {"b": engine.add_request(
        [7, 8, 9], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop, "\x00never"]),
        request_id="b")})["b"]
    streamed = text(outs)
    assert streamed == full[: full.index(stop)]
    assert outs[-1].finish_reason == "stop"
    for i in range(len(outs)):  # no prefix of the stream ever ends with a piece of the stop string past the cut
        assert stop not in text(outs[: i + 1])


def test_min_tokens_holds_off_stop_strings(engine):
    base = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = run_to_completion(engine, {"a": engine.add_request([1, 2, 3], base, request_id="a")})["a"]
    first_text = outs[0].text
    assert first_text
    stop = first_text[:2]
    held = run_to_completion(engine, {"b": engine.add_request([1, 2, 3], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=12), request_id="b")})["b"]
    assert held[-1].finish_reason == "length" and text(held) == text(outs)


def add_sampled_mates(engine, max_tokens: int) -> dict:
    """Three unseeded sampled requests (``mate0``..``mate2``) as batch mates; returns their sinks."""
    return {f"mate{i}": engine.add_request([9, i + 1], SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                       ignore_eos=True), request_id=f"mate{i}")
            for i in range(3)}


def test_seeded_sampling_is_reproducible_alone_and_with_batch_mates(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = tokens(run_to_completion(engine, {"s": engine.add_request([4, 5, 6], params, request_id="s")})["s"])
    sinks = add_sampled_mates(engine, max_tokens=20)
    sinks["s"] = engine.add_request([4, 5, 6], params, request_id="s")
    crowded = run_to_completion(engine, sinks)
    assert tokens(crowded["s"]) == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    different = tokens(run_to_completion(engine, {"t": engine.add_request([4, 5, 6], other_seed,
                                                                          request_id="t")})["t"])
    assert different != alone
    negative = SamplingParams(max_tokens=16, temperature=1.0, seed=-1234, ignore_eos=True)
    runs = [tokens(run_to_completion(engine, {"n": engine.add_request([4, 5, 6], negative, request_id="n")})["n"])
            for _ in range(2)]
    assert runs[0] == runs[1] != alone
    # torch's CPU generator keeps 32 bits of a seed: the upper half is mixed in, seeds under 2**32 stay as given.
    assert [generator_seed(s) for s in (0, 1234, 2**32 - 1)] == [0, 1234, 2**32 - 1]
    assert len({generator_seed(s) for s in (1234, 1234 + 2**32, 1234 - 2**32, -1, 2**32 - 1, 2**63 - 1)}) == 6
    wrapped = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234 + 2**32,
                             ignore_eos=True)
    assert tokens(run_to_completion(engine, {"w": engine.add_request([4, 5, 6], wrapped, request_id="w")})["w"]) \
        != alone
    # -1 is vLLM's "no seed": each run draws afresh.
    unseeded = SamplingParams(max_tokens=16, temperature=1.0, seed=-1, ignore_eos=True)
    assert unseeded.seed is None
    runs = [tokens(run_to_completion(engine, {f"u{i}": engine.add_request([4, 5, 6], unseeded, request_id=f"u{i}")})[
        f"u{i}"]) for i in range(2)]
    assert runs[0] != runs[1]


def test_a_top_p_that_is_0_in_fp32_samples_the_top_token_beside_its_batch_mates(engine):
    """top_p 1e-300 is in (0, 1] but 0 in the sampler's fp32: it once dropped every token, and the out-of-vocabulary
    pick failed the next forward pass for every request in it. Now it keeps only the most likely token (greedy's
    tokens), and its batch mates finish."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = tokens(run_to_completion(engine, {"g": engine.add_request([4, 5, 6], greedy, request_id="g")})["g"])
    tiny = SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-300, ignore_eos=True)
    sinks = add_sampled_mates(engine, max_tokens=12)
    sinks["tiny"] = engine.add_request([4, 5, 6], tiny, request_id="tiny")
    results = run_to_completion(engine, sinks)
    assert tokens(results["tiny"]) == want
    assert all(outs[-1].finish_reason == "length" and len(tokens(outs)) == 12 for outs in results.values())


@pytest.fixture(scope="module")
def tiny_model_dir_head_dim_64(tmp_path_factory, tokenizer):
    """The tiny llama with heads of 64 dimensions, which the C++ attention kernels take in tiles (as SmolLM2's)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-64"), "llama", tokenizer, head_dim=64)


@pytest.mark.parametrize("case", ["wide step", "chunked prompt"])
def test_fp32_numbers_do_not_depend_on_what_shares_the_step(make_engine, default_model_dir, tiny_model_dir_head_dim_64,
                                                            case):
    """In fp32 a request's logprobs, prompt logprobs and seeded draws are bit for bit the same alone and (1) in a
    step of more rows than small_gemm takes a call (a long prompt beside it: oneDNN, which ran such steps, sums
    SmolLM2's 576- and 1536-long rows in another order), (2) with its prompt split into chunks by the step's token
    budget, the last token in a chunk of its own (the decode kernel, which took such a chunk, rounds differently
    from the prefill kernel)."""
    model = default_model_dir if case == "wide step" else tiny_model_dir_head_dim_64
    want = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    seeded = SamplingParams(max_tokens=8, temperature=1.3, seed=2, ignore_eos=True, logprobs=0)
    prompt = list(range(40, 56))  # 16 tokens

    def run(engine, mates, late: bool):
        """``prompt`` greedy and seeded, after ``mates`` (added a step earlier when ``late``)."""
        sinks = {f"m{i}": engine.add_request(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                             request_id=f"m{i}") for i, p in enumerate(mates)}
        if late:
            engine.step()
        sinks.update(g=engine.add_request(prompt, want, request_id="g"),
                     s=engine.add_request(prompt, seeded, request_id="s"))
        results = run_to_completion(engine, sinks)
        greedy, sampled = results["g"], results["s"]
        return ([(t, lp.logprob, sorted(lp.top.items())) for o in greedy for t, lp in zip(o.token_ids, o.logprobs)],
                [(lp.logprob, sorted(lp.top.items())) if lp else None for lp in greedy[0].prompt_logprobs],
                [(t, lp.logprob) for o in sampled for t, lp in zip(o.token_ids, o.logprobs)])

    wide = make_engine(model, enable_prefix_caching=False)
    alone = run(wide, [], late=False)
    if case == "wide step":
        assert run(wide, [list(range(3, 3 + 300))], late=False) == alone  # 300 + 32 rows in one step
        return
    for budget in (17, 9, 4):  # the mate decodes, so each prompt gets budget - 1 tokens a step
        assert run(make_engine(model, enable_prefix_caching=False, max_num_batched_tokens=budget),
                   [[5, 6, 7]], late=True) == alone, budget


def test_abort_frees_blocks_and_ends_with_one_final(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    sink = engine.add_request(list(range(1, 60)), SamplingParams(max_tokens=100, ignore_eos=True),
                              request_id="x")
    other = engine.add_request([5, 6], SamplingParams(max_tokens=10, temperature=0.0), request_id="y")
    for _ in range(3):
        engine.step()
    assert engine.stats().kv.used_blocks > 0
    engine.abort("x")
    engine.abort("no-such-request")
    engine.step()
    outs = drain(sink)
    assert outs[-1].finish_reason == "abort" and [o.finished for o in outs].count(True) == 1
    done = run_to_completion(engine, {"y": other})["y"]
    assert done[-1].finish_reason in ("length", "stop")
    assert engine.stats().kv.used_blocks == 0 and engine.stats().finished.get("abort") == 1


def test_no_block_leaks_after_mixed_endings_and_preemption(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=8, max_num_batched_tokens=24)
    sinks = {}
    for i in range(8):
        params = SamplingParams(max_tokens=20 + i, temperature=0.7, seed=i, ignore_eos=True,
                                stop=["zz"] if i % 3 == 0 else [])
        sinks[str(i)] = engine.add_request(list(range(1, 12 + 3 * i)), params, request_id=str(i))
    for _ in range(6):
        engine.step()
    engine.abort("1")
    engine.abort("6")
    results = run_to_completion(engine, sinks)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv.used_blocks == 0 and stats.kv.free_blocks == 8
    assert all(len([o for o in outs if o.finished]) == 1 for outs in results.values())
    assert results["1"][-1].finish_reason == "abort"


@pytest.mark.parametrize("prompt, params, message", [
    ("", {}, "prompt is empty"),
    ([], {}, "prompt is empty"),
    (b"\xff\xfe bad bytes", {}, "not valid UTF-8"),
    ([1, 2, 10**9], {}, "token ids"),
    ("word " * 1100, {}, "max_model_len"),
    ("hello", {"max_tokens": 1000, "min_tokens": 1024}, "min_tokens"),
    ("hello", {"max_tokens": 300}, "whole KV cache"),
])
def test_bad_request_fails_alone_with_clear_error(make_engine, tiny_model_dir, prompt, params, message):
    engine = make_engine(tiny_model_dir, num_blocks=16)
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0), request_id="good")
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, SamplingParams(**params), request_id="bad")
    outs = run_to_completion(engine, {"good": good})["good"]
    assert outs[-1].finish_reason == "length" and len(tokens(outs)) == 5


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.5, r"temperature must be in \[0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, r"top_k must be in \[-1"),
    ("top_k", 2.5, "top_k must be an integer"),
    ("max_tokens", 0, r"max_tokens must be in \[1"),
    ("max_tokens", -3, r"max_tokens must be in \[1"),
    ("min_p", 2.0, "min_p"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("presence_penalty", 3.0, "presence_penalty"),
    ("logprobs", 50, "logprobs"),
    ("stop", [""], "stop must be"),
    ("seed", 2**63, "seed"),
    ("ignore_eos", "yes", "ignore_eos must be true or false"),
])
def test_invalid_sampling_params_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_unknown_sampling_parameter_is_rejected():
    with pytest.raises(ValueError, match="unknown sampling parameter.*tempreature"):
        SamplingParams.from_dict({"tempreature": 0.5})


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request([1, 2], SamplingParams(max_tokens=3), request_id="same")
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request([1, 2], SamplingParams(max_tokens=3), request_id="same")
    engine.abort("same")
    run_to_completion(engine, {})
    assert not engine.has_unfinished_requests()


def test_logprobs_are_the_model_distribution(engine, tiny_reference):
    prompt = [1, 2, 3]
    outs = run_to_completion(engine, {"a": engine.add_request(prompt, SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3), request_id="a")})["a"]
    want_ids, want_logits = tiny_reference.greedy(prompt, 5)
    assert len(outs) == 5
    for out, want_id, logits in zip(outs, want_ids, want_logits):  # each step's distribution, as transformers'
        (lp,) = out.logprobs
        want = torch.log_softmax(logits.float(), dim=-1).topk(3)
        assert lp.token_id == out.token_ids[0] and lp.logprob == pytest.approx(float(want.values[0]), abs=1e-4)
        assert sorted(lp.top) == sorted(want.indices.tolist())
        for token_id, value in zip(want.indices.tolist(), want.values.tolist()):
            assert lp.top[token_id] == pytest.approx(value, abs=1e-4)
        if out.token_ids[0] != want_id:  # a near-tie went the other way: later contexts differ
            break


def test_background_loop_streams_concurrent_requests(make_engine, tiny_model_dir):
    import threading

    engine = make_engine(tiny_model_dir)
    engine.start()
    results = {}

    def run(i):
        results[i] = list(engine.generate([i + 1, i + 2], SamplingParams(max_tokens=8 + i, temperature=0.0,
                                                                       ignore_eos=True), request_id=f"r{i}"))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == list(range(6))
    for i, outs in results.items():
        assert len(tokens(outs)) == 8 + i and outs[-1].finish_reason == "length"
    engine.shutdown()
    assert engine.stats().kv.used_blocks == 0


# -- finish reasons: one rule (vLLM's order: EOS and stop tokens, then stop strings, then length) -----------
def test_stop_token_as_the_last_allowed_token_finishes_with_stop(engine):
    prompt = [10, 11, 12]
    greedy = tokens(run_to_completion(engine, {"a": engine.add_request(prompt, SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True), request_id="a")})["a"])
    outs = run_to_completion(engine, {"b": engine.add_request(prompt, SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, stop_token_ids=[greedy[2]]), request_id="b")})["b"]
    assert tokens(outs) == greedy and outs[-1].finish_reason == "stop"


def test_a_stop_tokens_text_is_left_out_unless_include_stop_str_in_output(engine, tokenizer):
    prompt = tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    params = dict(max_tokens=3, temperature=0.0, ignore_eos=True)
    greedy = tokens(run_to_completion(engine, {"a": engine.add_request(prompt, SamplingParams(**params),
                                                                       request_id="a")})["a"])
    assert tokenizer.decode(greedy[2:]).strip(), "the stop token must spell something for this test"
    for include, spelled in ((False, greedy[:2]), (True, greedy)):
        outs = run_to_completion(engine, {"b": engine.add_request(prompt, SamplingParams(
            **params, stop_token_ids=[greedy[2]], include_stop_str_in_output=include), request_id="b")})["b"]
        # The token stays in token_ids (and logprobs); only its text goes, as in vLLM's detokenizer.
        assert tokens(outs) == greedy and outs[-1].finish_reason == "stop"
        assert text(outs) == tokenizer.decode(spelled), include


def test_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(engine):
    params = dict(temperature=0.0, ignore_eos=True, max_tokens=12)
    full = text(run_to_completion(engine, {"a": engine.add_request([7, 8, 9], SamplingParams(**params),
                                                                   request_id="a")})["a"])
    stop = next(full[-k:] for k in range(2, len(full)) if full.find(full[-k:]) == len(full) - k)
    outs = run_to_completion(engine, {"b": engine.add_request([7, 8, 9], SamplingParams(**params, stop=[stop]),
                                                              request_id="b")})["b"]
    assert text(outs) == full[: -len(stop)] and outs[-1].finish_reason == "stop"
    assert outs[-1].num_output_tokens == 12


def test_bad_words_are_never_generated(engine, tokenizer):
    params = dict(temperature=0.0, ignore_eos=True, max_tokens=8)
    first = tokens(run_to_completion(engine, {"a": engine.add_request([4, 5, 6], SamplingParams(**params),
                                                                      request_id="a")})["a"])[0]
    word = tokenizer.decode([first])
    outs = run_to_completion(engine, {"b": engine.add_request([4, 5, 6], SamplingParams(**params, bad_words=[word]),
                                                              request_id="b")})["b"]
    assert first not in tokens(outs) and len(tokens(outs)) == 8


# -- input limits ------------------------------------------------------------------------------------------
def test_oversized_prompt_is_rejected_by_bytes_before_tokenizing(make_engine, tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, max_model_len=512)
    assert engine.max_prompt_bytes == 511 * 81  # the default tokenizer's longest token: 81 bytes
    calls = []
    monkeypatch.setattr("backend.llm_engine.encode_prompt", lambda tokenizer, text, *a, **k: calls.append(text) or [1])
    for prompt in ("x" * (engine.max_prompt_bytes + 1), "é" * (engine.max_prompt_bytes // 2 + 1),
                   b"y" * 16_000_000):
        with pytest.raises(ValueError, match=f"prompt is over {engine.max_prompt_bytes} bytes"):
            engine.add_request(prompt, SamplingParams(max_tokens=1))
    assert calls == []
    engine.add_request("z" * engine.max_prompt_bytes, SamplingParams(max_tokens=1))  # at the bound: tokenized
    assert len(calls) == 1


# -- cancellation ------------------------------------------------------------------------------------------
def one_running_one_waiting(make_engine, tiny_model_dir):
    """An engine of one slot: request "run" running, "wait" waiting; (engine, run's sink, wait's sink)."""
    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    running = engine.add_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), request_id="run")
    engine.step()
    waiting = engine.add_request([4, 5, 6, 7], SamplingParams(max_tokens=5), request_id="wait")
    engine.step()
    assert engine.stats().num_waiting == 1
    return engine, running, waiting


def test_request_aborted_while_waiting_is_never_scheduled(make_engine, tiny_model_dir):
    engine, running, waiting = one_running_one_waiting(make_engine, tiny_model_dir)
    queries = engine.debug_snapshot().prefix_cache_queries  # admission looks the prompt up first
    engine.abort("wait")
    engine.step()
    outs = drain(waiting)
    assert [o.finish_reason for o in outs] == ["abort"] and outs[0].num_output_tokens == 0
    assert outs[0].metrics.first_token_time is None
    snapshot = engine.debug_snapshot()
    assert "wait" not in snapshot.requests_with_blocks and "run" in snapshot.requests_with_blocks
    assert snapshot.prefix_cache_queries == queries and engine.stats().num_waiting == 0
    engine.abort("run")
    run_to_completion(engine, {"run": running})


def test_running_and_waiting_aborted_in_one_call_leave_the_waiting_one_unscheduled(make_engine, tiny_model_dir):
    """Aborts of several ids land together: the slot the running request frees is not given to the waiting one
    aborted with it (the Triton model's cancellation sweep aborts what it found cancelled in one call)."""
    engine, running, waiting = one_running_one_waiting(make_engine, tiny_model_dir)
    prompt_tokens = engine.stats().prompt_tokens
    engine.abort(["run", "wait", "no-such-request"])
    engine.step()
    assert [o.finish_reason for o in drain(waiting)] == ["abort"]
    assert drain(running)[-1].finish_reason == "abort"
    stats = engine.stats()
    assert stats.prompt_tokens == prompt_tokens and stats.num_waiting == 0 and stats.num_running == 0
    assert stats.kv.used_blocks == 0 and stats.finished.get("abort") == 2


def test_stream_interval_sends_the_first_token_then_every_n_and_loses_nothing(engine, tiny_model_dir):
    """``stream_interval`` 4: the first token alone, then deltas of 4 tokens, the rest with the final one; the
    tokens, text and logprobs joined are those of the every-token stream; an abort delivers the held tokens."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    want = run_to_completion(engine, {"r": engine.add_request([3, 4, 5, 6], params, request_id="r")})["r"]
    held = LLMEngine(EngineConfig(model=tiny_model_dir, num_blocks=256, dtype="float32", stream_interval=4))
    try:
        got = run_to_completion(held, {"r": held.add_request([3, 4, 5, 6], params, request_id="r")})["r"]
        assert [len(o.token_ids) for o in got] == [1, 4, 4, 1]
        assert tokens(got) == tokens(want) and text(got) == text(want)
        assert [lp.logprob for o in got for lp in o.logprobs] == [lp.logprob for o in want for lp in o.logprobs]
        assert [o.num_output_tokens for o in got] == [1, 5, 9, 10] and got[-1].finish_reason == "length"

        held_want = tokens(got)
        sink = held.add_request([3, 4, 5, 6], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
                                request_id="a")
        for _ in range(4):  # prefill + first token, then 3 tokens held back
            held.step()
        first = drain(sink)
        assert [len(o.token_ids) for o in first] == [1]
        held.abort("a")
        outs = run_to_completion(held, {"a": sink})["a"]
        assert outs[-1].finish_reason == "abort" and len(tokens(outs)) == 3  # the held tokens, with the abort
        assert tokens(first + outs) == held_want[:4] and outs[-1].num_output_tokens == 4
    finally:
        held.shutdown()


def test_shutdown_aborts_what_is_left_on_the_loop_thread(make_engine, tiny_model_dir):
    """The loop thread owns the core: told to stop, it ends the running and the waiting request with ``abort``
    itself; ``shutdown`` finds nothing left to end."""
    import threading

    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    core, calls = engine.engine_core, []
    abort_all = core.abort_all

    def recorded():
        ended = abort_all()
        calls.append((threading.current_thread().name, sorted(r.request_id for r in ended)))
        return ended

    core.abort_all = recorded
    engine.start()
    params = SamplingParams(temperature=0.0, ignore_eos=True)  # max_tokens: up to max_model_len
    running = engine.add_request([1, 2, 3], params, request_id="running")
    waiting = engine.add_request([4, 5, 6], params, request_id="waiting")
    first = running.get(timeout=30)
    engine.shutdown()
    outs = {"running": [first] + drain(running), "waiting": drain(waiting)}
    assert outs["running"][-1].finish_reason == "abort" and outs["running"][-1].done
    assert [(o.finish_reason, o.done, o.num_output_tokens) for o in outs["waiting"]] == [("abort", True, 0)]
    assert calls[0] == ("llm-engine-loop", ["running", "waiting"])
    assert all(ended == [] for _, ended in calls[1:])
    assert engine.stats().kv.used_blocks == 0 and not engine.has_unfinished_requests()
    assert engine.debug_snapshot().running == engine.debug_snapshot().waiting == ()


def test_max_model_len_beyond_the_models_positions_is_refused(make_engine, tiny_model_dir):
    from types import SimpleNamespace

    from backend.model_support import max_positions

    with pytest.raises(ValueError, match="max_model_len 1025 is beyond the model's 1024 positions"):
        make_engine(tiny_model_dir, max_model_len=1025)
    assert make_engine(tiny_model_dir, max_model_len=1024).max_model_len == 1024
    assert max_positions(SimpleNamespace(max_position_embeddings=4096)) == 4096
    assert max_positions(SimpleNamespace(max_position_embeddings=32768, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})) == 131072
    assert max_positions(SimpleNamespace(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0})) == 131072  # the extended length is declared already
    assert max_positions(SimpleNamespace()) is None


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)


@pytest.mark.parametrize("settings, message", [
    (dict(enable_prefix_caching="false"), "^enable_prefix_caching must be true or false, got 'false'$"),
    (dict(cpu_threads_bind=5), "^cpu_threads_bind must be a string, got int 5$"),
    (dict(model=123), "^model must be a string, got int 123$"),
    (dict(kv_events_topic=5), "^kv_events_topic must be a string"),
    (dict(num_threads=10**6), "^num_threads must be at most 1024, got 1000000$"),
    (dict(block_size=10**9), "^block_size must be at most 1024"),
    (dict(cpu_threads_bind="4096"), "names CPUs outside this process's"),
])
def test_engine_settings_of_the_wrong_type_or_size_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)
    from pathlib import Path

    assert EngineConfig(model=Path("/models/x")).model == "/models/x"  # a path is its text


def test_an_engine_json_that_is_not_an_object_is_refused_naming_the_file(tmp_path):
    from backend.config import read_settings_file

    path = tmp_path / "engine.json"
    for text, message in [("[1, 2]", "must hold a JSON object of engine settings, got list"),
                          ("null", "got NoneType"), ('{"max_num_seqs": 4,}', "is not valid JSON: Expecting")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=f"^{path}.*{message}"):
            read_settings_file(path)
    path.write_text('{"max_num_seqs": 4}')
    assert EngineConfig.from_dict(read_settings_file(path)).max_num_seqs == 4


def test_an_unknown_setting_is_refused_listing_the_adapters_settings_too():
    """The served model takes drain_grace_s and vllm_metrics out before the engine reads the rest: a typo's
    message still lists them."""
    with pytest.raises(ValueError, match="^unknown engine setting 'max_num_seq'; known: .*drain_grace_s.*"
                                         "max_num_seqs.*vllm_metrics$"):
        EngineConfig.from_dict({"max_num_seq": "2"}, also_known=("drain_grace_s", "vllm_metrics"))


def test_settings_that_would_do_nothing_or_cannot_be_allocated_stop_the_engine(make_engine, tiny_model_dir):
    with pytest.raises(ValueError, match="cpu_threads_bind '0' pins threads through the C\\+\\+ CPU kernels, which this "
                                         "engine does not run"):
        make_engine(tiny_model_dir, attention_backend="torch", cpu_threads_bind="0")
    with pytest.raises(ValueError, match="^kv_cache_memory_bytes asks for a KV cache of .* more than this machine's"):
        make_engine(tiny_model_dir, num_blocks=None, kv_cache_memory_bytes=10**15)


def test_empty_settings_mean_the_defaults_and_typed_values_must_have_the_settings_type():
    import dataclasses

    from serve.drain import DEFAULT_GRACE_S, pop_grace
    from serve.metrics import pop_metric_settings

    names = [f.name for f in dataclasses.fields(EngineConfig)]
    assert EngineConfig.from_dict({name: "" for name in names}) == EngineConfig()
    assert EngineConfig.from_dict({name: "  " for name in names}) == EngineConfig()
    settings = {"vllm_metrics": "", "drain_grace_s": ""}
    assert pop_metric_settings(settings) == {} and pop_grace(settings) == DEFAULT_GRACE_S and settings == {}
    assert EngineConfig.from_dict({"num_blocks": "auto", "max_model_len": None, "model": "none"}) == EngineConfig()
    assert EngineConfig.from_dict({"max_step_ms": 5, "enable_prefix_caching": False}).max_step_ms == 5
    for setting, kind in [({"enable_prefix_caching": 5}, "bool"), ({"enable_prefix_caching": "none"}, "bool"),
                          ({"model": 5}, "str or null"), ({"kv_events_topic": 7}, "str"),
                          ({"block_size": True}, "int"), ({"block_size": 16.0}, "int"),
                          ({"max_step_ms": "auto"}, "float"), ({"max_step_ms": "1ms"}, "float")]:
        (key,) = setting
        with pytest.raises(ValueError, match=f"engine setting {key} must be {kind}, got"):
            EngineConfig.from_dict(setting)
    for raw in ("yes", "on", 3):
        with pytest.raises(ValueError, match="vllm_metrics must be true or false"):
            pop_metric_settings({"vllm_metrics": raw})
    with pytest.raises(ValueError, match="drain_grace_s must be a number of seconds"):
        pop_grace({"drain_grace_s": True})
    with pytest.raises(ValueError, match="device cuda:99: torch .* here sees .* CUDA device"):  # not torch's assert
        LLMEngine(EngineConfig(device="cuda:99"))
    for raw in ("inf", "nan", "-1"):  # a grace that never ends would never abort what is in flight
        with pytest.raises(ValueError, match="drain_grace_s must be a finite number >= 0"):
            pop_grace({"drain_grace_s": raw})


def _greedy(engine, prompt, request_id, **params):
    sink = engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True, **params),
                              request_id=request_id)
    return run_to_completion(engine, {request_id: sink})[request_id]


def test_logit_bias_and_allowed_token_ids_steer_every_token(engine):
    base = tokens(_greedy(engine, [11, 12, 13], "base", max_tokens=6))
    forced = tokens(_greedy(engine, [11, 12, 13], "forced", max_tokens=6, logit_bias={"777": 100}))
    assert forced == [777] * 6
    banned = tokens(_greedy(engine, [11, 12, 13], "banned", max_tokens=6, logit_bias={base[0]: -100}))
    assert banned[0] != base[0]
    allowed = tokens(_greedy(engine, [11, 12, 13], "allowed", max_tokens=8, allowed_token_ids=[5, 6]))
    assert set(allowed) <= {5, 6} and len(allowed) == 8


def test_settings_that_mask_every_token_end_that_request_alone_with_a_clear_error(engine):
    """allowed_token_ids that are all EOS or stop tokens while min_tokens holds those off leave no token: that
    request ends with finish_reason error and says why (no token id outside the vocabulary, no failed step)."""
    eos = engine.eos_token_ids[0]
    alone = tokens(_greedy(engine, [11, 12, 13], "alone", max_tokens=12))
    masked = {"greedy": SamplingParams(temperature=0.0, allowed_token_ids=[eos], min_tokens=3, max_tokens=5),
              "sampled": SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[eos], min_tokens=3, max_tokens=5),
              "logprobs": SamplingParams(temperature=1.0, logprobs=2, allowed_token_ids=[5], stop_token_ids=[5],
                                         min_tokens=1, max_tokens=5),
              "penalized": SamplingParams(temperature=0.0, allowed_token_ids=[eos], min_tokens=3, max_tokens=5,
                                          repetition_penalty=1.2, presence_penalty=1.0)}
    sinks = {"good": engine.add_request([11, 12, 13], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12),
                                        request_id="good")}
    sinks.update((rid, engine.add_request([11, 12, 13], params, request_id=rid)) for rid, params in masked.items())
    outs = run_to_completion(engine, sinks)
    assert tokens(outs["good"]) == alone and outs["good"][-1].finish_reason == "length"
    for rid in masked:
        assert tokens(outs[rid]) == [] and outs[rid][-1].finish_reason == "error", rid
        assert outs[rid][-1].error.startswith("no token can be sampled"), outs[rid][-1].error
    assert engine.engine_core.num_consecutive_failed_steps == 0


def test_include_stop_str_in_output_keeps_the_stop_string(engine):
    full = text(_greedy(engine, [7, 8, 9], "full", max_tokens=40))
    stop = full[10:16]
    kept = _greedy(engine, [7, 8, 9], "kept", max_tokens=40, stop=[stop], include_stop_str_in_output=True)
    assert text(kept) == full[: full.index(stop) + len(stop)] and kept[-1].finish_reason == "stop"


def test_truncate_prompt_tokens_keeps_the_prompts_end(engine):
    cut = _greedy(engine, list(range(20, 60)), "cut", max_tokens=5, truncate_prompt_tokens=8)
    assert cut[-1].num_prompt_tokens == 8
    assert tokens(cut) == tokens(_greedy(engine, list(range(52, 60)), "short", max_tokens=5))


@pytest.mark.parametrize("params", [dict(logit_bias={"1000000": 1}), dict(allowed_token_ids=[10**7]),
                                    dict(logit_bias={"5": 101}), dict(logit_bias={"x": 1}),
                                    dict(allowed_token_ids=[])])
def test_token_id_parameters_outside_their_range_are_refused(engine, params):
    with pytest.raises(ValueError, match="logit_bias|allowed_token_ids"):
        engine.add_request([1, 2], SamplingParams(**params))


def test_n_is_bounded_by_the_engines_max_n(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_n=20)
    sink = engine.add_request([1, 2, 3], SamplingParams(n=20, max_tokens=2, temperature=1.0, seed=0), request_id="20")
    assert sorted({o.index for o in run_to_completion(engine, {"20": sink})["20"]}) == list(range(20))
    with pytest.raises(ValueError, match="max_n"):
        engine.add_request([1, 2, 3], SamplingParams(n=21))


def test_cache_salt_limits_prefix_sharing_to_requests_with_the_same_salt(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, block_size=16)
    prompt = list(range(400, 450))

    def cached(request_id, salt):
        sink = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=request_id,
                                  cache_salt=salt)
        return run_to_completion(engine, {request_id: sink})[request_id][-1].num_cached_tokens

    assert cached("a1", "tenant-a") == 0
    assert cached("b1", "tenant-b") == 0  # same prompt, another tenant: nothing shared
    assert cached("none", None) == 0
    assert cached("a2", "tenant-a") == 48
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt, SamplingParams(), cache_salt="")


def test_a_fairness_key_is_given_to_every_completion_and_checked(make_engine, tiny_model_dir):
    """The engine's requests carry the caller's fairness_key (every one of n completions), or the caller's id;
    an empty or oversized key is refused before anything is queued."""
    engine = make_engine(tiny_model_dir)
    engine.add_request([1, 2, 3], SamplingParams(n=3, max_tokens=2), request_id="multi", fairness_key="client-7")
    engine.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=2), request_id="own")
    engine.engine_core.take_inbox()
    keys = {r.request_id: r.fairness_key for r in engine.engine_core.scheduler.waiting}
    assert keys == {"multi#0": "client-7", "multi#1": "client-7", "multi#2": "client-7", "own#0": "own", "own#1": "own"}
    for bad in ("", "k" * 257):
        with pytest.raises(ValueError, match="fairness_key"):
            engine.add_request([1, 2, 3], SamplingParams(), fairness_key=bad)


def test_a_request_racing_shutdown_is_answered_or_refused_never_lost(make_engine, tiny_model_dir):
    """Threads keep adding requests while the engine shuts down: each add either raises
    EngineUnavailableError or its sink gets a final (``done``) output; none is queued after the last abort."""
    import threading

    from backend import EngineOverloadedError, EngineUnavailableError

    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    engine.start()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64)
    sinks, refused, stop = [], [], threading.Event()

    def add_until_stopped(worker: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                sinks.append(engine.add_request([1 + worker, 2, 3], params, request_id=f"w{worker}-{i}"))
            except EngineOverloadedError:
                pass
            except EngineUnavailableError as exc:
                refused.append(str(exc))
                if len(refused) > 20:
                    return
            i += 1
            time.sleep(0.002)

    threads = [threading.Thread(target=add_until_stopped, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    engine.shutdown()
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(10)
    assert sinks and refused and all(r == "the engine is shutting down" for r in refused)
    for sink in sinks:
        assert drain(sink)[-1].done


def test_a_schema_limit_beyond_what_the_sampling_parameters_input_holds_is_refused():
    from backend.config import MAX_SCHEMA_BYTES_SETTING, EngineConfig
    from serve.request_parsing import MAX_SAMPLING_PARAMETERS_BYTES

    assert 3 * MAX_SCHEMA_BYTES_SETTING < MAX_SAMPLING_PARAMETERS_BYTES  # a schema within it fits, even escaped
    assert EngineConfig(structured_outputs_max_schema_bytes=MAX_SCHEMA_BYTES_SETTING)
    with pytest.raises(ValueError, match=f"structured_outputs_max_schema_bytes must be at most {MAX_SCHEMA_BYTES_SETTING}"):
        EngineConfig(structured_outputs_max_schema_bytes=MAX_SCHEMA_BYTES_SETTING + 1)


def test_max_tokens_past_the_context_ends_the_reply_at_max_model_len(make_engine, tiny_model_dir):
    # max_tokens is a bound (vLLM caps it at the context); min_tokens is a promise, refused where it cannot fit.
    engine = make_engine(tiny_model_dir, max_model_len=64)
    engine.start()
    outs = list(engine.generate(list(range(1, 41)), SamplingParams(max_tokens=1000, temperature=0.0,
                                                                   ignore_eos=True), request_id="long"))
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 64 - 40
    with pytest.raises(ValueError, match=r"min_tokens \(30\) does not fit: prompt \(40 tokens\) \+ min_tokens "
                                         r"exceeds max_model_len \(64\)"):
        list(engine.generate(list(range(1, 41)), SamplingParams(max_tokens=1000, min_tokens=30), request_id="min"))
    with pytest.raises(ValueError, match="max_model_len is 64"):
        list(engine.generate(list(range(1, 65)), SamplingParams(max_tokens=1), request_id="full"))
