"""vLLM's KV cache event schema, written from vLLM's documented structs (``vllm/distributed/kv_events.py`` as
of vLLM 0.11, and its ``examples/online_serving/kv_events_subscriber.py``), independently of
``backend.kv_events``; and a replay client and an index as a router keeps one. Shared by the KV events tests."""

from __future__ import annotations

import msgspec
import zmq


def local(endpoint: str) -> str:
    """A bound wildcard address as a local client reaches it."""
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VllmKVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(VllmKVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(VllmKVCacheEvent):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=VllmKVEventBatch)


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




def apply(state: set[int], batch: VllmKVEventBatch, block_size: int) -> None:
    """What a router's index does with one batch; checks each event is self-consistent on the way."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            assert event.block_size == block_size and event.medium == "GPU" and event.lora_id is None
            assert len(event.token_ids) == block_size * len(event.block_hashes)
            # llm-d drops a store whose parent it does not know: the parent must be cached already.
            assert event.parent_block_hash is None or event.parent_block_hash in state
            assert not state & set(event.block_hashes), "a block stored twice without a removal"
            state.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert event.medium == "GPU"
            assert set(event.block_hashes) <= state, "a block removed that was never stored"
            state.difference_update(event.block_hashes)
        else:
            state.clear()


def receive_all(socket: zmq.Socket, idle_s: float = 0.5) -> list[list[bytes]]:
    messages = []
    while socket.poll(int(idle_s * 1000)):
        messages.append(socket.recv_multipart())
    return messages
