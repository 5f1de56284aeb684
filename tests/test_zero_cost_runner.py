"""The zero-cost model runner (benchmarks only): the real scheduler, KV cache manager and output processor
around a runner that emits a fixed token cycle without computing."""

from __future__ import annotations

import pytest

from backend import EngineConfig, SamplingParams
from backend.zero_cost_runner import ZeroCostModelRunner, zero_cost_token
from conftest import run_to_completion


def expected_ids(prompt_len: int, max_tokens: int, vocab_size: int, eos=(2,)) -> list[int]:
    return [zero_cost_token(p, vocab_size, eos) for p in range(prompt_len, prompt_len + max_tokens)]


def test_zero_cost_token_cycles_and_skips_eos():
    assert [zero_cost_token(p, 49152) for p in (0, 1, 63, 64, 130)] == [1000, 1001, 1063, 1000, 1002]
    assert zero_cost_token(5, 49152, eos_token_ids=(1005,)) == 1006
    assert zero_cost_token(7, 10) == 5 + 7 % 5  # a tiny vocabulary: the upper half
    with pytest.raises(ValueError, match="vocab_size"):
        ZeroCostModelRunner(1)
    with pytest.raises(ValueError, match="model_runner must be default or zero_cost"):
        EngineConfig(model_runner="fast")


def test_engine_streams_each_request_its_tokens_to_max_tokens(make_engine, tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, model_runner="zero_cost", max_num_batched_tokens=64)
    assert engine.debug_snapshot().model_runner == ZeroCostModelRunner.__name__
    vocab = engine.model_config.vocab_size
    prompts = {"short": [5, 6, 7], "chunked": list(range(100, 200)), "eos_kept": [9] * 20}  # 100 > 64: two chunks
    params = {"short": SamplingParams(max_tokens=70, ignore_eos=True),
              "chunked": SamplingParams(max_tokens=5, temperature=0.7, seed=3),
              "eos_kept": SamplingParams(max_tokens=40)}  # no EOS ever comes: runs to max_tokens all the same
    sinks = {rid: engine.add_request(prompts[rid], params[rid], request_id=rid) for rid in prompts}
    results = run_to_completion(engine, sinks)
    for rid, outs in results.items():
        want = expected_ids(len(prompts[rid]), params[rid].max_tokens, vocab, engine.eos_token_ids)
        assert [t for o in outs for t in o.token_ids] == want, rid
        assert all(len(o.token_ids) == 1 for o in outs)  # one delta per step, as with the real runner
        assert outs[-1].finish_reason == "length" and outs[-1].done
        assert "".join(o.text for o in outs) == tokenizer.decode(want)
    assert engine.stats().kv.used_blocks == 0


def test_stop_strings_still_end_requests_through_the_output_processor(make_engine, tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, model_runner="zero_cost")
    vocab = engine.model_config.vocab_size
    stop = tokenizer.decode([zero_cost_token(10, vocab)])  # the 8th token of a 3-token prompt's output
    sink = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, stop=[stop]), request_id="s")
    outs = run_to_completion(engine, {"s": sink})["s"]
    assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens == 8
    assert "".join(o.text for o in outs) == tokenizer.decode(expected_ids(3, 7, vocab))


def test_preempted_requests_get_the_same_tokens_and_free_every_block(make_engine, tiny_model_dir):
    # 6 requests of 30 + 40 tokens need 6 x 5 blocks of 16; a pool of 12 blocks forces recompute preemption.
    engine = make_engine(tiny_model_dir, model_runner="zero_cost", num_blocks=12)
    vocab = engine.model_config.vocab_size
    prompts = {str(i): [10 + i] * 30 for i in range(6)}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    results = run_to_completion(engine, {rid: engine.add_request(p, params, request_id=rid)
                                         for rid, p in prompts.items()})
    stats = engine.stats()
    assert stats.num_preemptions > 0
    for rid, outs in results.items():
        assert [t for o in outs for t in o.token_ids] == expected_ids(30, 40, vocab), rid
    assert stats.kv.used_blocks == 0 and stats.num_running == stats.num_waiting == 0
