"""vLLM's KV cache event schema, mirrored from vLLM 0.32.0 (PyPI release ``vllm==0.32.0``, its
``vllm/distributed/kv_events.py``: ``EventBatch``, ``KVCacheEvent``, ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``, ``KVEventBatch``; ``ExternalBlockHash`` from ``vllm/v1/core/kv_cache_utils.py``), field
for field, with the same msgspec options, independently of ``backend.kv_events``; and a replay client and an
index as a router keeps one. Shared by the KV events tests.

In that release the batch is ``array_like`` but the events are not: each event is a msgpack map tagged by
``"type"``, so a decoder of this schema refuses array-encoded events (what vLLM 0.11 sent).
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

ExternalBlockHash = bytes | int  # vllm/v1/core/kv_cache_utils.py


def local(endpoint: str) -> str:
    """A bound wildcard address as a local client reaches it."""
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def replay(endpoint: str, start: int) -> list[list[bytes]]:
    """vLLM's replay protocol from a DEALER: [b"", start] -> [b"", topic, seq, payload]... then the end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(local(endpoint))
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    frames = []
    while True:
        assert dealer.poll(5000), "no replay answer"
        message = dealer.recv_multipart()
        assert message[0] == b""
        if message[2] == (-1).to_bytes(8, "big", signed=True):
            assert message[1] == b"" and message[3] == b""
            break
        frames.append(message[1:])
    dealer.close(linger=0)
    return frames


def apply(state: set[int], batch: KVEventBatch, block_size: int) -> None:
    """What a router's index does with one batch; checks each event is self-consistent on the way."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            assert event.block_size == block_size and event.medium == MEDIUM_GPU
            assert event.lora_id is None and event.lora_name is None and event.group_idx == 0
            assert len(event.token_ids) == block_size * len(event.block_hashes)
            assert event.extra_keys is not None and len(event.extra_keys) == len(event.block_hashes)
            # llm-d drops a store whose parent it does not know: the parent must be cached already.
            assert event.parent_block_hash is None or event.parent_block_hash in state
            assert not state & set(event.block_hashes), "a block stored twice without a removal"
            state.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert event.medium == MEDIUM_GPU and event.group_idx == 0
            assert set(event.block_hashes) <= state, "a block removed that was never stored"
            state.difference_update(event.block_hashes)
        else:
            state.clear()


def receive_all(socket: zmq.Socket, idle_s: float = 0.5) -> list[list[bytes]]:
    messages = []
    while socket.poll(int(idle_s * 1000)):
        messages.append(socket.recv_multipart())
    return messages


def decode_positional(payload: bytes) -> list[tuple]:
    """A batch decoded the way llm-d-kv-cache's vLLM adapter reads positional events
    (pkg/kvevents/engineadapter/vllm_adapter.go at commit 7be76e1: ``[tag, ...]``, fields by position, trailing
    ones optional): ("BlockStored", hashes, parent, tokens, block_size, extra_keys, group_idx),
    ("BlockRemoved", hashes, medium, group_idx) or ("AllBlocksCleared",)."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 0
    out = []
    for fields in events:
        assert isinstance(fields, list) and isinstance(fields[0], str), fields
        if fields[0] == "BlockStored":
            assert len(fields) >= 5 and fields[6] == "GPU" and fields[5] is None and fields[7] is None
            out.append(("BlockStored", fields[1], fields[2], fields[3], fields[4], fields[8], fields[9]))
        elif fields[0] == "BlockRemoved":
            assert len(fields) >= 2
            out.append(("BlockRemoved", fields[1], fields[2], fields[3]))
        else:
            assert fields == ["AllBlocksCleared"] or fields[0] == "AllBlocksCleared"
            out.append(("AllBlocksCleared",))
    return out
