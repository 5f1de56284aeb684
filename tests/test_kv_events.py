"""KV cache events: vLLM's wire format over ZeroMQ, read back the way llm-d and Dynamo read them.

A subscriber decodes every message with vLLM's schema (``vllm_kv_schema``, written from vLLM's documented
structs, not imported from ``backend.kv_events``), strictly typed.
"""

from __future__ import annotations

import time

import pytest
import zmq
from vllm_kv_schema import DECODER, AllBlocksCleared, BlockStored, apply, local, receive_all, replay

from backend import EngineConfig, LLMEngine, SamplingParams
from backend.kv_events import external_block_hash


BLOCK_SIZE = 4
PREFIX = "You are a careful assistant who answers questions about rivers. "


@pytest.fixture
def events_engine(tiny_model_dir, monkeypatch):
    """An engine with a pool small enough that 8 requests preempt and evict, publishing KV events."""
    monkeypatch.setenv("KV_TEST_POD", "10.0.0.7:9000")
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", block_size=BLOCK_SIZE, num_blocks=40,
                                    max_num_seqs=8, kv_events_endpoint="tcp://*:0",
                                    kv_events_replay_endpoint="tcp://127.0.0.1:0",
                                    kv_events_topic="kv@${KV_TEST_POD}@llm"))
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
    subscriber.connect(local(engine.kv_events.endpoint))
    time.sleep(0.5)  # a SUB socket receives only what is published after it has joined
    yield engine, subscriber
    engine.shutdown()
    subscriber.close(linger=0)


def run_workload(engine: LLMEngine) -> None:
    """Shared prefixes (one system prompt, two follow-ups asked twice), more KV than the pool holds."""
    prompts = [PREFIX + f"Tell me about river number {i % 4} and its delta." for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    while engine.has_unfinished_requests():
        engine.step()
    for i, prompt in enumerate(prompts[:3]):  # after the evictions: prefix hits on what is left
        engine.add_request(prompt, params, request_id=f"again-{i}")
    while engine.has_unfinished_requests():
        engine.step()


def test_replaying_the_events_reproduces_the_pools_cached_blocks(events_engine):
    engine, subscriber = events_engine
    run_workload(engine)
    pool = engine.kv_cache_manager.pool
    assert engine.scheduler.make_stats().num_preemptions > 0 and pool.num_evictions > 0
    messages = receive_all(subscriber)
    assert [int.from_bytes(m[1], "big") for m in messages] == list(range(len(messages)))  # no gap, from 0
    assert {m[0] for m in messages} == {b"kv@10.0.0.7:9000@llm"}  # the topic, its $VAR expanded
    state: set[int] = set()
    kinds = set()
    for _, _, payload in messages:
        batch = DECODER.decode(payload)  # strict: every field has vLLM's type
        assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 600
        kinds |= {type(e).__name__ for e in batch.events}
        apply(state, batch, BLOCK_SIZE)
    assert kinds == {"BlockStored", "BlockRemoved"}
    assert state == {external_block_hash(h) for h in pool.cached_hashes()}
    assert len(state) == len(pool.cached_hashes())  # 64-bit wire hashes stay distinct


def test_replay_socket_returns_the_buffered_batches_from_any_sequence(events_engine):
    engine, subscriber = events_engine
    run_workload(engine)
    live = receive_all(subscriber)
    assert len(live) > 3
    assert replay(engine.kv_events.replay_endpoint, 0) == live
    assert replay(engine.kv_events.replay_endpoint, 3) == live[3:]
    assert replay(engine.kv_events.replay_endpoint, len(live) + 5) == []


def test_shutdown_publishes_all_blocks_cleared(events_engine):
    engine, subscriber = events_engine
    engine.add_request(PREFIX, SamplingParams(max_tokens=4, temperature=0.0), request_id="one")
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    batches = [DECODER.decode(m[2]) for m in receive_all(subscriber)]
    assert isinstance(batches[0].events[0], BlockStored)
    assert isinstance(batches[-1].events[-1], AllBlocksCleared)


def test_stored_blocks_of_one_prompt_form_one_chained_event(tiny_model_dir, tokenizer):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", block_size=BLOCK_SIZE, num_blocks=64,
                                    kv_events_endpoint="inproc://kv-events-chain"))
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect("inproc://kv-events-chain")
    time.sleep(0.2)
    try:
        prompt_ids = tokenizer.encode(PREFIX)
        engine.add_request(prompt_ids, SamplingParams(max_tokens=1, temperature=0.0), request_id="a")
        while engine.has_unfinished_requests():
            engine.step()
        first = DECODER.decode(receive_all(subscriber)[0][2]).events
        assert len(first) == 1 and first[0].parent_block_hash is None
        assert first[0].token_ids == prompt_ids[:len(prompt_ids) // BLOCK_SIZE * BLOCK_SIZE]
        # The same prompt plus more: only the new blocks, chained to the last cached one.
        engine.add_request(prompt_ids + prompt_ids, SamplingParams(max_tokens=1, temperature=0.0), request_id="b")
        while engine.has_unfinished_requests():
            engine.step()
        second = DECODER.decode(receive_all(subscriber)[0][2]).events
        assert len(second) == 1 and second[0].parent_block_hash == first[0].block_hashes[-1]
    finally:
        engine.shutdown()
        subscriber.close(linger=0)


@pytest.mark.parametrize("settings, message", [
    ({"kv_events_endpoint": "localhost:5557"}, "ZeroMQ address"),
    ({"kv_events_replay_endpoint": "tcp://*:5558"}, "needs kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://*:5557", "enable_prefix_caching": "false"}, "enable_prefix_caching"),
])
def test_bad_kv_events_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict(settings)
