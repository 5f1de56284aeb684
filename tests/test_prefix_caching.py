"""Prefix caching and parallel sampling on shared KV blocks."""

from __future__ import annotations

import pytest

from backend import SamplingParams
from conftest import drain, run_to_completion

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BLOCK = 16


def tokens(outs, index=0):
    return [t for o in outs if o.index == index for t in o.token_ids]


def run_one(engine, prompt, params=GREEDY, request_id="r"):
    return run_to_completion(engine, {request_id: engine.add_request(prompt, params, request_id=request_id)})[
        request_id]


@pytest.fixture
def engines(make_engine, tiny_model_dir):
    return (make_engine(tiny_model_dir, num_blocks=64),
            make_engine(tiny_model_dir, num_blocks=64, enable_prefix_caching=False))


@pytest.mark.parametrize("shared", [BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK])
def test_cache_hits_give_the_same_greedy_output_as_no_cache(engines, shared):
    cached, plain = engines
    prefix = list(range(100, 100 + shared))
    prompts = [prefix + [i, 7, 8, 9] for i in range(3)]  # they differ right after the shared prefix
    # sequential: the first request fills the cache, the next ones hit it
    for i, prompt in enumerate(prompts):
        out = run_one(cached, prompt, request_id=f"s{i}")
        assert tokens(out) == tokens(run_one(plain, prompt, request_id=f"s{i}"))
        expected_hit = 0 if i == 0 else (shared // BLOCK) * BLOCK
        assert out[-1].num_cached_tokens == expected_hit
    # concurrent: all at once (they share the cache as soon as blocks are full)
    sinks = {f"c{i}": cached.add_request(p, GREEDY, request_id=f"c{i}") for i, p in enumerate(prompts)}
    results = run_to_completion(cached, sinks)
    for i, prompt in enumerate(prompts):
        assert tokens(results[f"c{i}"]) == tokens(run_one(plain, prompt, request_id=f"c{i}"))
    assert cached.stats().kv.used_blocks == 0


def test_same_prompt_three_times_computes_only_the_last_partial_block(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64)
    prompt = list(range(200, 200 + 3 * BLOCK + 5))  # 53 tokens: 3 full blocks and 5 more
    outputs, computed = [], []
    for i in range(3):
        sink = engine.add_request(prompt, GREEDY, request_id=f"same{i}")
        engine.step()  # the prefill step
        computed.append(engine.stats().last_step_num_tokens)
        outputs.append(run_to_completion(engine, {"x": sink})["x"])
    assert tokens(outputs[0]) == tokens(outputs[1]) == tokens(outputs[2])
    assert computed == [len(prompt), 5, 5]
    assert [o[-1].num_cached_tokens for o in outputs] == [0, 3 * BLOCK, 3 * BLOCK]
    kv = engine.stats().kv
    assert kv.prefix_cache_queries == 3 * len(prompt) and kv.prefix_cache_hits == 2 * 3 * BLOCK


def test_reset_prefix_cache_forgets_every_block_but_only_while_none_is_in_use(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64)
    prompt = list(range(300, 300 + 2 * BLOCK + 3))
    first = run_one(engine, prompt, request_id="a")
    sink = engine.add_request(prompt, GREEDY, request_id="b")
    engine.step()  # "b" holds its blocks (two of them found in the cache): no reset now
    assert engine.reset_prefix_cache() is False
    second = run_to_completion(engine, {"b": sink})["b"]
    assert second[-1].num_cached_tokens == 2 * BLOCK
    assert engine.reset_prefix_cache() is True
    third = run_one(engine, prompt, request_id="c")
    assert third[-1].num_cached_tokens == 0  # computed again, to the same tokens
    assert tokens(first) == tokens(second) == tokens(third)


def test_whole_prompt_cached_still_computes_its_last_token(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64)
    prompt = list(range(300, 300 + 2 * BLOCK))  # exactly two full blocks
    first, second = run_one(engine, prompt, request_id="a"), run_one(engine, prompt, request_id="b")
    assert tokens(first) == tokens(second)
    assert second[-1].num_cached_tokens == BLOCK  # the last block is recomputed for the last token's logits


def test_forced_hash_collision_never_returns_wrong_kv(make_engine, tiny_model_dir, engines):
    _, plain = engines
    engine = make_engine(tiny_model_dir, num_blocks=64)
    engine.engine_core.kv_cache_manager.pool.hash_fn = lambda parent, token_ids: b"every block collides"
    a = list(range(400, 400 + 2 * BLOCK + 3))
    b = list(range(500, 500 + BLOCK)) + a[BLOCK:]  # same second block, different first block
    for i, prompt in enumerate([a, b, a]):
        assert tokens(run_one(engine, prompt, request_id=f"h{i}")) == tokens(run_one(plain, prompt, request_id=f"h{i}"))
    assert engine.stats().kv.used_blocks == 0


def test_evicted_blocks_are_reused_and_nothing_leaks(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=12, max_num_batched_tokens=40)
    for i in range(10):  # each request caches ~3 blocks: the pool must evict old prefixes
        run_one(engine, list(range(1000 + 40 * i, 1000 + 40 * i + 40)), request_id=f"e{i}")
    snapshot = engine.debug_snapshot()
    assert snapshot.num_evictions > 0
    assert engine.stats().kv.used_blocks == 0 and snapshot.num_free_blocks == 12


def test_parallel_sampling_streams_each_completion_with_its_index(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64)
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    outs = run_one(engine, list(range(1, 2 * BLOCK + 4)), params)
    assert {o.index for o in outs} == {0, 1, 2}
    assert [o.done for o in outs].count(True) == 1 and outs[-1].done
    finals = [o for o in outs if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2] and all(o.finish_reason == "length" for o in finals)
    completions = [tokens(outs, i) for i in range(3)]
    assert all(len(c) == 10 for c in completions)
    assert len({tuple(c) for c in completions}) == 3  # each completion draws its own tokens
    assert engine.stats().kv.used_blocks == 0


@pytest.mark.parametrize("prompt_len", [2 * BLOCK, 2 * BLOCK + 5])
def test_greedy_completions_share_prompt_blocks_and_match_a_single_request(make_engine, tiny_model_dir, prompt_len):
    engine = make_engine(tiny_model_dir, num_blocks=64, enable_prefix_caching=False)
    prompt = list(range(50, 50 + prompt_len))
    single = tokens(run_one(engine, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    sink = engine.add_request(prompt, SamplingParams(n=4, max_tokens=20, temperature=0.0, ignore_eos=True),
                              request_id="fork")
    engine.step()  # all 4 admitted: 1-3 share completion 0's full prompt blocks (salted: caching is off)
    engine.step()  # decodes
    assert engine.stats().kv.prefix_cache_hits == 0  # sharing among completions is not prefix caching
    used = engine.stats().kv.used_blocks
    per_request = -(-(prompt_len + 2) // BLOCK)
    assert used < 4 * per_request
    outs = run_to_completion(engine, {"fork": sink})["fork"]
    for i in range(4):
        assert tokens(outs, i) == single, f"completion {i}"
    assert engine.stats().kv.used_blocks == 0


def test_cancelling_parallel_sampling_stops_all_and_frees_every_block(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=16, max_num_batched_tokens=32)
    sink = engine.add_request(list(range(1, 40)), SamplingParams(n=4, max_tokens=200, ignore_eos=True),
                              request_id="many")
    other = engine.add_request(list(range(60, 90)), SamplingParams(max_tokens=100, ignore_eos=True),
                               request_id="other")
    for _ in range(40):
        engine.step()
    assert engine.stats().num_preemptions > 0  # 16 blocks cannot hold 5 sequences growing to ~240 tokens
    engine.abort("many")
    engine.step()
    outs = drain(sink)
    finals = [o for o in outs if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2, 3]
    assert all(o.finish_reason == "abort" for o in finals) and outs[-1].done
    engine.abort("other")
    run_to_completion(engine, {"other": other})
    assert engine.stats().kv.used_blocks == 0
    assert engine.debug_snapshot().num_free_blocks == 16


def test_abort_during_the_prompt_ends_every_completion(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64, max_num_batched_tokens=8)
    sink = engine.add_request(list(range(1, 40)), SamplingParams(n=3, max_tokens=5), request_id="early")
    engine.step()  # a first prefill chunk only
    engine.abort("early")
    engine.step()
    outs = drain(sink)
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2] and outs[-1].done
    assert not engine.has_unfinished_requests() and engine.stats().kv.used_blocks == 0


def test_completions_do_not_share_with_other_requests_when_caching_is_off(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64, enable_prefix_caching=False)
    prompt = list(range(50, 50 + 3 * BLOCK))
    run_one(engine, prompt, SamplingParams(n=2, max_tokens=2, temperature=0.0, ignore_eos=True))
    outs = run_one(engine, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert outs[-1].num_cached_tokens == 0


def test_failed_forward_pass_leaves_no_blocks_in_the_prefix_cache(make_engine, tiny_model_dir, monkeypatch):
    """Blocks are registered when allocated, before the forward pass writes them: a failed pass must unregister
    them, or the next request with the prompt would read K/V that were never written."""
    engine = make_engine(tiny_model_dir, num_blocks=64)
    prompt = list(range(100, 100 + 3 * BLOCK))

    def fail(sched):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.engine_core.model_runner, "execute", fail)
    outs = run_one(engine, prompt, request_id="failed")
    assert [o.finish_reason for o in outs] == ["error"] and "device lost" in outs[0].error and outs[0].done
    monkeypatch.undo()
    again = run_one(engine, prompt, request_id="again")
    assert again[-1].finish_reason == "length" and again[-1].num_cached_tokens == 0
    assert engine.stats().kv.used_blocks == 0


def test_a_reset_block_pool_finds_nothing_and_says_so_in_its_events():
    from backend.block_pool import ALL_BLOCKS_CLEARED, BLOCK_STORED, BlockPool

    pool = BlockPool(4)
    pool.enable_events()
    (block,) = pool.allocate(1)
    key = (None, (1, 2), None)
    pool.cache(block, b"h", key)
    assert pool.reset_prefix_cache() is False and pool.lookup(b"h", key) == block  # in use: kept
    pool.free([block])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(b"h", key) is None and pool.cached_hashes() == set()
    assert [event[0] for event in pool.take_events()] == [BLOCK_STORED, ALL_BLOCKS_CLEARED]
