"""KV cache events in vLLM's wire format, published over ZeroMQ for KV-cache-aware routers.

A router that knows which blocks each replica holds can send a request where its prompt's prefix is
cached: llm-d's precise prefix-cache scorer (the Gateway API Inference Extension's endpoint picker) and
NVIDIA Dynamo's KV router subscribe to vLLM's events for that. This module speaks that protocol as vLLM 0.32.0
publishes it (``vllm/distributed/kv_events.py``, ``vllm/v1/core/block_pool.py`` and
``vllm/v1/core/kv_cache_utils.py`` of the 0.32.0 release; ``tests/vllm_kv_schema.py`` mirrors those structs):

- **Live stream** (PUB): one multipart message per engine step that changed the cache:
  ``[topic, sequence (8-byte big-endian, from 0), payload]``.
- **Payload**: a msgpack ``KVEventBatch``, an ``array_like`` struct:
  ``[timestamp (float seconds since the epoch), [event, ...], data_parallel_rank (0)]``. The events are tagged
  msgspec structs that are *not* ``array_like``: each is a msgpack map whose ``"type"`` key names it
  (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``), fields at their default value left out
  (``omit_defaults``). ``BlockStored`` always carries ``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium`` and ``lora_name`` (nil where unset), and, as vLLM fills them for
  an engine with one KV cache group, ``extra_keys`` and ``group_idx`` (0). ``BlockRemoved`` carries
  ``block_hashes``, ``medium`` and ``group_idx``.
- **Block hashes** are unsigned 64-bit integers: the last 8 bytes (big-endian) of this engine's SHA-256
  block hash, as vLLM does by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). ``parent_block_hash`` is
  the hash of the block before the first one stored (None at the start of a prompt); ``token_ids`` holds
  ``block_size`` tokens per stored block; ``medium`` is ``"GPU"`` (vLLM's name for the engine's own pool,
  on a CPU too); ``lora_id`` and ``lora_name`` are None (no LoRA adapters here).
- **extra_keys**: one entry per stored block, untagged as vLLM publishes them (``to_event_extra_keys``):
  ``[cache_salt]`` for the first block of a request with a ``cache_salt`` (the salt seeds that block's hash,
  and so every later block's), None for every other block.
- **Encoding** (``kv_events_encoding``): ``map`` (default) is the layout above, vLLM 0.32.0's. ``array`` sends
  each event as a positional msgpack array ``[tag, field, ...]`` in the same field order (vLLM's KV event
  structs were ``array_like`` until they moved to maps in mid-2026): the layout the vLLM adapter of
  llm-d-kv-cache decodes (``pkg/kvevents/engineadapter/vllm_adapter.go`` at commit 7be76e1, 2026-06-12, the
  nearest source to the v0.9.0 the gateway overlay's endpoint picker is built with; its map support came later,
  keeping arrays). Choose the one your router reads; the gateway overlay sets ``array``.
- **Reload**: Triton loads a model's new instance before it unloads the old one, so a reload through the
  repository API finds the addresses still bound. A publisher holds a lock file for each TCP address with a fixed
  port that it binds (``$TMPDIR/llm-kv-events-<hash of the address>.lock``); the new instance, finding such an
  address in use and its lock held, starts without it and binds it as soon as the old instance has closed it (its
  last batch is ``AllBlocksCleared``). Its batches are numbered from 0, as a restarted vLLM's are; those of the
  steps before it bound go to its replay buffer only. An address in use by anything else is refused at start, as
  before; one that another publisher of this server keeps (two models or instances given the same address) is
  logged as an error after ``PENDING_ERROR_S`` and retried until it frees.
- **Replay** (ROUTER, optional): a DEALER or REQ client sends ``[b"", start sequence (8 bytes)]`` and gets
  every buffered batch from that sequence on, each as ``[b"", topic, sequence, payload]``, then the end
  marker ``[b"", b"", -1 (8 bytes, signed), b""]`` (vLLM 0.32's replay reply, which carries the topic).

Recording costs the engine step one tuple append per registered or evicted block (``BlockPool.events``)
and one queue put per step (:meth:`KVEventPublisher.publish`); converting, encoding and sending happen on
the publisher's own thread.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import queue
import re
import tempfile
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq

from backend.block_pool import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED

log = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's medium for the engine's primary KV pool
REPLAY_BUFFER_BATCHES = 10_000  # vLLM's buffer_steps default
SEND_HWM = 100_000  # vLLM's hwm default
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


GROUP_IDX = 0  # the KV cache group of every block: this engine has one (vLLM's kv_cache_group_id)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events. ``ts``: seconds since the epoch; ``data_parallel_rank``: always 0 here."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A tagged event: encoded as a map with ``"type": <class name>`` (not array_like, as in vLLM 0.32)."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one token sequence became findable; ``token_ids`` covers all of them.
    Field order and defaults are vLLM 0.32.0's."""

    block_hashes: list[int]
    parent_block_hash: int | None
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
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


# The same events as positional arrays ``[tag, field, ...]`` (``kv_events_encoding: array``).
class BlockStoredArray(BlockStored, array_like=True, tag="BlockStored"):
    pass


class BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


ENCODINGS = {"map": (BlockStored, BlockRemoved, AllBlocksCleared),
             "array": (BlockStoredArray, BlockRemovedArray, AllBlocksClearedArray)}


def external_block_hash(block_hash: bytes) -> int:
    """The wire form of a block hash: its last 8 bytes as an unsigned big-endian integer (vLLM's
    ``maybe_convert_block_hash``); 0..2**64-1."""
    return int.from_bytes(block_hash[-8:], "big")


def to_vllm_events(raw: list[tuple], block_size: int, encoding: str = "map") -> list[KVCacheEvent]:
    """Turns ``BlockPool`` event tuples into vLLM events, in order. A stored block whose parent is the
    previous stored block extends that event (as vLLM emits one event per run of blocks); consecutive
    removals share one event. Each stored block gets its ``extra_keys`` entry. ``encoding``: a key of
    :data:`ENCODINGS` (the event classes, which decide the wire layout).

    Raises:
        ValueError: an event tuple of an unknown kind."""
    BlockStored, BlockRemoved, AllBlocksCleared = ENCODINGS[encoding]  # noqa: N806 (the classes of this layout)
    events: list[KVCacheEvent] = []
    last_stored: bytes | None = None  # hash of the last block of events[-1] when it is a BlockStored
    for entry in raw:
        kind = entry[0]
        if kind == BLOCK_STORED:
            _, block_hash, parent, tokens, salt = entry
            extra = (salt,) if salt else None  # vLLM's untagged cache_salt key, first block only
            if last_stored is not None and parent == last_stored:
                events[-1].block_hashes.append(external_block_hash(block_hash))
                events[-1].token_ids.extend(tokens)
                events[-1].extra_keys.append(extra)
            else:
                events.append(BlockStored([external_block_hash(block_hash)],
                                          None if parent is None else external_block_hash(parent),
                                          list(tokens), block_size, None, MEDIUM, None, extra_keys=[extra],
                                          group_idx=GROUP_IDX))
            last_stored = block_hash
            continue
        last_stored = None
        if kind == BLOCK_REMOVED:
            if events and isinstance(events[-1], BlockRemoved):
                events[-1].block_hashes.append(external_block_hash(entry[1]))
            else:
                events.append(BlockRemoved([external_block_hash(entry[1])], MEDIUM, group_idx=GROUP_IDX))
        elif kind == ALL_BLOCKS_CLEARED:
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV cache event {entry!r}")
    return events


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind an address with a wildcard (``*``, ``::``) or an ipc/inproc one, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


REBIND_INTERVAL_S = 0.2  # how often a publisher retries an address its model's previous instance still holds
PENDING_ERROR_S = 120.0  # an address still held this long after start is logged as an error (not a reload)
LOCK_WAIT_S = 5.0  # how long a publisher that has bound an address waits for its predecessor to let the lock go
_FIXED_TCP_PORT = re.compile(r"tcp://.+:[1-9]\d*")  # tcp://*:5557; not :0 or :* (a port of the system's choosing)


class _AddressLock:
    """An exclusive ``flock`` on a file named after a bound TCP address with a fixed port, held while a publisher
    has it bound, so that a new instance of the model (a reload) can tell its predecessor's address from anything
    else's. Best effort: where no temporary directory can be written, nothing is held and a bound address is
    refused as before."""

    def __init__(self, address: str) -> None:
        self.path: str | None = None
        if _FIXED_TCP_PORT.fullmatch(address):
            digest = hashlib.sha256(address.encode("utf-8")).hexdigest()[:16]
            try:
                self.path = os.path.join(tempfile.gettempdir(), f"llm-kv-events-{digest}.lock")
            except OSError:  # no writable temporary directory
                pass
        self._fd: int | None = None

    def held_elsewhere(self) -> bool:
        """Whether another publisher holds the lock."""
        if self.path is None:
            return False
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)  # closing releases a lock this probe took
        return False

    def acquire(self) -> None:
        """Takes the lock, waiting up to ``LOCK_WAIT_S`` for a predecessor that has closed the address (the bind
        succeeded) to let it go; past that, or where the file cannot be opened, nothing is held."""
        if self.path is None:
            return
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError:
                if time.monotonic() >= deadline:
                    log.warning("KV events: the lock %s stayed held; a reload will not hand this address over",
                                self.path)
                    self.release()
                    return
                time.sleep(0.05)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class KVEventPublisher:
    """Publishes batches of KV cache events on a ZeroMQ PUB socket from a thread of its own, keeps the last
    ``REPLAY_BUFFER_BATCHES`` encoded batches, and answers replay requests on a ROUTER socket.

    Args:
        endpoint: the PUB address: ``tcp://*:5557`` binds, ``tcp://host:5557`` connects (to a subscriber
            that binds).
        replay_endpoint: the ROUTER address (always bound), or None for no replay.
        topic: the first frame of every message; ``$VAR`` / ``${VAR}`` are taken from the environment
            (llm-d expects ``kv@<pod>@<model>``).
        block_size: tokens per block, reported in every ``BlockStored``.
        encoding: ``map`` (vLLM 0.32's layout) or ``array`` (positional; see the module docstring).

    Raises:
        zmq.ZMQError: an address that cannot be bound or parsed.
        ValueError: an unknown encoding.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, block_size: int,
                 encoding: str = "map") -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"KV events encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        self.block_size = block_size
        self.encoding = encoding
        self.topic = os.path.expandvars(topic).encode("utf-8")
        self._queue: queue.SimpleQueue[tuple[float, list[tuple]] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER_BATCHES)
        self._sequence = count()
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(SEND_HWM)
        self._replay = None
        self._locks: list[_AddressLock] = []
        self._pending: list[tuple[zmq.Socket, str, _AddressLock]] = []  # addresses a previous instance holds
        self._pending_since = 0.0
        self._pending_error_logged = False
        try:
            if _binds(endpoint):
                self._bind(self._pub, endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._bind(self._replay, replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets(linger_ms=0)
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT) or replay_endpoint
                                if self._replay is not None else None)
        self.num_batches = 0  # published so far
        self.encode_seconds = 0.0  # spent converting, encoding and sending on the publisher thread
        self._thread = threading.Thread(target=self._run, name="llm-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, socket: zmq.Socket, address: str) -> None:
        """Binds ``address`` and holds its lock; where a previous instance of the model (its lock held) still has
        it, leaves it for the publisher thread to bind once it is free.

        Raises:
            zmq.ZMQError: the address is in use by anything else, or cannot be bound or parsed.
        """
        lock = _AddressLock(address)
        try:
            socket.bind(address)
        except zmq.ZMQError as error:
            if error.errno != errno.EADDRINUSE or not lock.held_elsewhere():
                raise
            log.warning("KV events: %s is still bound by this model's previous instance (a reload); publishing "
                        "there once it is unloaded", address)
            self._pending.append((socket, address, lock))
            self._pending_since = time.monotonic()
            return
        lock.acquire()
        self._locks.append(lock)

    def _bind_pending(self) -> None:
        """One try at each address a previous instance held (on the publisher thread, which owns the sockets)."""
        if not self._pending_error_logged and time.monotonic() - self._pending_since > PENDING_ERROR_S:
            self._pending_error_logged = True
            log.error("KV events: %s still bound by another publisher of this server after %.0f s: not a reload's "
                      "hand-over (two models or instances given the same address?); no events are published there "
                      "until it frees", ", ".join(a for _, a, _ in self._pending), PENDING_ERROR_S)
        for entry in list(self._pending):
            socket, address, lock = entry
            try:
                socket.bind(address)
            except zmq.ZMQError as error:
                if error.errno != errno.EADDRINUSE:
                    log.error("KV events: binding %s failed: %s; no events there", address, error)
                    self._pending.remove(entry)
                continue
            lock.acquire()
            self._locks.append(lock)
            self._pending.remove(entry)
            log.info("KV events: bound %s after the previous instance released it", address)

    def publish(self, events: list[tuple]) -> None:
        """Queues one step's ``BlockPool`` events (nothing when empty); cheap, callable from the engine loop."""
        if events:
            self._queue.put((time.time(), events))

    def shutdown(self, timeout: float = 2.0) -> None:
        """Sends what is queued (for up to ``timeout`` seconds), then closes the sockets (messages not yet
        delivered get up to ``timeout`` more)."""
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():  # a socket is never used by two threads
            self._close_sockets(linger_ms=int(timeout * 1000))

    # -- the publisher thread -----------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        next_bind = 0.0
        while True:
            if self._pending and time.monotonic() >= next_bind:
                self._bind_pending()
                next_bind = time.monotonic() + REBIND_INTERVAL_S
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except Exception:
                    log.exception("KV events replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            started = time.perf_counter()
            try:
                ts, raw = item
                batch = EventBatch(ts, to_vllm_events(raw, self.block_size, self.encoding), 0)
                payload = encoder.encode(batch)
                sequence = next(self._sequence)
                self._pub.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload))
                self._buffer.append((sequence, payload))
                self.num_batches += 1
            except Exception:
                log.exception("publishing KV cache events failed")
            self.encode_seconds += time.perf_counter() - started

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._buffer):
            if sequence >= first:
                self._replay.send_multipart((client, b"", self.topic, sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    def _close_sockets(self, linger_ms: int) -> None:
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)
        for lock in self._locks:  # after the close: a successor that bound meanwhile waits for it (acquire)
            lock.release()
        self._locks.clear()
