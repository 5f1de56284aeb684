"""KV cache events: vLLM's wire format over ZeroMQ, read back the way llm-d and Dynamo read them.

A subscriber decodes every message with vLLM 0.32.0's structs (``vllm_kv_schema``, mirrored from that release,
not imported from ``backend.kv_events``), strictly typed, and rebuilds every stored block's hash from what the
event carries, as a router that keeps its own index does.
"""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq
from vllm_kv_schema import (DECODER, AllBlocksCleared, BlockRemoved, BlockStored, apply, decode_positional, local,
                             receive_all, replay)

from backend import EngineConfig, LLMEngine, SamplingParams
from backend.block_pool import ALL_BLOCKS_CLEARED, BLOCK_STORED, sha256_block_hash
from backend.kv_cache_manager import KVCacheManager
from backend.kv_events import EventBatch, external_block_hash, to_vllm_events
from backend.request import Request


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


def rebuild_hashes(full: dict[int, bytes], event: BlockStored) -> None:
    """Recomputes each stored block's hash from the event alone (parent, token ids, extra keys) with the engine's
    hash function, checks it against the published one and records the full hash under the wire hash."""
    parent = full[event.parent_block_hash] if event.parent_block_hash is not None else None
    for i, wire_hash in enumerate(event.block_hashes):
        tokens = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
        extra = event.extra_keys[i]
        assert extra is None or (i == 0 and event.parent_block_hash is None), "a salt only on a prompt's first block"
        seed = parent if parent is not None else (extra[0].encode() if extra else None)
        parent = sha256_block_hash(seed, tokens)
        assert external_block_hash(parent) == wire_hash
        full[wire_hash] = parent


def test_replaying_the_events_reproduces_the_pools_cached_blocks(events_engine):
    engine, subscriber = events_engine
    run_workload(engine)
    snapshot = engine.debug_snapshot()
    assert snapshot.num_preemptions > 0 and snapshot.num_evictions > 0
    messages = receive_all(subscriber)
    assert [int.from_bytes(m[1], "big") for m in messages] == list(range(len(messages)))  # no gap, from 0
    assert {m[0] for m in messages} == {b"kv@10.0.0.7:9000@llm"}  # the topic, its $VAR expanded
    state: set[int] = set()
    full: dict[int, bytes] = {}
    kinds = set()
    for _, _, payload in messages:
        batch = DECODER.decode(payload)  # strict: every field has vLLM 0.32's type
        assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 600
        kinds |= {type(e).__name__ for e in batch.events}
        apply(state, batch, BLOCK_SIZE)
        for event in batch.events:
            if isinstance(event, BlockStored):
                rebuild_hashes(full, event)
            elif isinstance(event, BlockRemoved):
                assert all(h in full for h in event.block_hashes)
    assert kinds == {"BlockStored", "BlockRemoved"}
    # Each block the events leave stored is one the engine's prefix cache holds, under the same full hash.
    assert {full[h] for h in state} == snapshot.cached_block_hashes
    assert len(state) == len(snapshot.cached_block_hashes)  # 64-bit wire hashes stay distinct


def test_events_are_tagged_maps_with_vllm_0_32_fields(events_engine):
    """vLLM 0.32 encodes the batch as an array and each event as a map tagged by "type", with lora_name."""
    engine, subscriber = events_engine
    engine.add_request(PREFIX, SamplingParams(max_tokens=2, temperature=0.0), request_id="one")
    while engine.has_unfinished_requests():
        engine.step()
    ts, events, rank = msgspec.msgpack.decode(receive_all(subscriber)[0][2])  # untyped: the raw layout
    assert isinstance(ts, float) and rank == 0
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx"]
    assert events[0]["type"] == "BlockStored" and events[0]["lora_name"] is None
    assert events[0]["extra_keys"] == [None] * len(events[0]["block_hashes"])


def test_a_cache_salt_is_the_first_blocks_extra_key_and_separates_the_hashes(tokenizer):
    """vLLM puts ``cache_salt`` in the first block's extra keys; the same tokens under two salts are two blocks."""
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    manager.pool.enable_events()
    prompt = tokenizer.encode(PREFIX * 2)[:3 * BLOCK_SIZE + 1]
    assert len(prompt) == 3 * BLOCK_SIZE + 1
    requests = [Request(name, prompt, SamplingParams(max_tokens=1), (), 1, cache_salt=salt)
                for name, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("c", None))]
    for request in requests:
        assert manager.allocate_slots(request, len(prompt))
    payload = msgspec.msgpack.encode(EventBatch(time.time(), to_vllm_events(manager.pool.take_events(), BLOCK_SIZE), 0))
    events = DECODER.decode(payload).events
    assert [e.extra_keys for e in events] == [[("tenant-a",), None, None], [("tenant-b",), None, None],
                                              [None, None, None]]
    assert all(e.parent_block_hash is None and e.token_ids == prompt[:3 * BLOCK_SIZE] for e in events)
    assert len({h for e in events for h in e.block_hashes}) == 9  # no block shared across salts
    full: dict[int, bytes] = {}
    for event in events:
        rebuild_hashes(full, event)
    # The same salt finds its blocks again; another salt does not.
    again = Request("a2", prompt, SamplingParams(max_tokens=1), (), 1, cache_salt="tenant-a")
    other = Request("d", prompt, SamplingParams(max_tokens=1), (), 1, cache_salt="tenant-d")
    assert manager.get_computed_blocks(again) == manager.get_block_ids("a")[:3]
    assert manager.get_computed_blocks(other) == []


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


def test_array_encoding_is_read_by_position_as_llm_d_reads_it(tiny_model_dir, monkeypatch):
    """``kv_events_encoding: array`` (the deployment's, for llm-d's picker): the same events as positional
    arrays; replayed by position they leave exactly the engine's cached blocks."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", block_size=BLOCK_SIZE, num_blocks=40,
                                    max_num_seqs=8, kv_events_endpoint="tcp://*:0", kv_events_encoding="array"))
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(local(engine.kv_events.endpoint))
    time.sleep(0.5)
    try:
        run_workload(engine)
        snapshot = engine.debug_snapshot()
        state: set[int] = set()
        kinds = set()
        for _, _, payload in receive_all(subscriber):
            for event in decode_positional(payload):
                kinds.add(event[0])
                if event[0] == "BlockStored":
                    _, hashes, parent, tokens, block_size, extra_keys, group_idx = event
                    assert (parent is None or parent in state) and block_size == BLOCK_SIZE and group_idx == 0
                    assert len(tokens) == len(hashes) * BLOCK_SIZE and len(extra_keys) == len(hashes)
                    state |= set(hashes)
                elif event[0] == "BlockRemoved":
                    assert set(event[1]) <= state and event[2] == "GPU"
                    state -= set(event[1])
        assert kinds == {"BlockStored", "BlockRemoved"}
        assert state == {external_block_hash(h) for h in snapshot.cached_block_hashes}
    finally:
        engine.shutdown()
        subscriber.close(linger=0)


@pytest.mark.parametrize("settings, message", [
    ({"kv_events_endpoint": "localhost:5557"}, "ZeroMQ address"),
    ({"kv_events_replay_endpoint": "tcp://*:5558"}, "needs kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://*:5557", "enable_prefix_caching": "false"}, "enable_prefix_caching"),
    ({"kv_events_encoding": "json"}, "map or array"),
])
def test_bad_kv_events_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict(settings)


def _free_port() -> int:
    with socket.socket() as probe:  # closed at once (a ZeroMQ socket lets its port go later, on its own thread)
        probe.bind(("", 0))
        return probe.getsockname()[1]


def test_a_reloaded_instance_takes_the_addresses_over_when_the_old_one_closes():
    # Triton loads a model's new instance before unloading the old one: the new publisher starts while the old one
    # holds both addresses, binds them once they are closed, and publishes from sequence 0.
    from backend.kv_events import KVEventPublisher

    port, replay_port = _free_port(), _free_port()
    old = KVEventPublisher(f"tcp://*:{port}", f"tcp://*:{replay_port}", "kv", BLOCK_SIZE)
    new = KVEventPublisher(f"tcp://*:{port}", f"tcp://*:{replay_port}", "kv", BLOCK_SIZE)
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)
    stored = (BLOCK_STORED, b"\x01" * 32, None, (1, 2, 3, 4), None)
    old.publish([stored, (ALL_BLOCKS_CLEARED,)])  # as the engine's shutdown sends
    time.sleep(0.3)
    assert [DECODER.decode(m[2]).events[-1].__class__ for m in receive_all(subscriber)] == [AllBlocksCleared]
    old.shutdown()
    deadline = time.monotonic() + 10
    while new._pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not new._pending
    received: list = []  # the subscriber reconnects by itself: what the new instance sends before then is not seen
    while not received and time.monotonic() < deadline:
        new.publish([stored])
        received = receive_all(subscriber, idle_s=0.2)
    assert received, "nothing from the new instance"
    replayed = replay(f"tcp://127.0.0.1:{replay_port}", 0)
    assert [int.from_bytes(m[1], "big") for m in replayed] == list(range(len(replayed)))  # from 0, no gaps
    assert replayed[-len(received):] == received
    assert DECODER.decode(received[0][2]).events[0].token_ids == [1, 2, 3, 4]
    new.shutdown()
    subscriber.close(linger=0)


def test_an_address_in_use_by_anything_else_is_refused():
    from backend.kv_events import KVEventPublisher, _AddressLock

    # Only a TCP address with a fixed port is handed over: a port of the system's choosing is never the same twice,
    # and an ipc or inproc bind takes an address over without an error.
    assert [_AddressLock(a).path is not None for a in ("tcp://*:5557", "tcp://127.0.0.1:5558", "tcp://*:0",
                                                       "tcp://*:*", "ipc:///tmp/kv", "inproc://kv")] == [
        True, True, False, False, False, False]

    other = zmq.Context.instance().socket(zmq.PUB)
    port = other.bind_to_random_port("tcp://*")
    try:
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            KVEventPublisher(f"tcp://*:{port}", None, "kv", BLOCK_SIZE)
    finally:
        other.close(linger=0)
