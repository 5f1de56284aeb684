"""The pool of KV cache blocks: free-block queue, reference counts and prefix-cache hashes.

PagedAttention (Kwon et al. SOSP 2023, sec. 4.2-4.4) for blocks and sharing; vLLM's automatic prefix
caching for keeping freed full blocks reusable by content until they are evicted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

# (parent block's hash or None for a prompt's first block, this block's token ids, the request's cache salt
# on a first block, else None)
BlockKey = tuple[bytes | None, tuple[int, ...], str | None]

# KV cache events, recorded as plain tuples when enabled (``BlockPool.events``) and turned into vLLM's wire
# format off the engine thread (backend/kv_events.py):
BLOCK_STORED = 0  # (BLOCK_STORED, block hash, parent block hash or None, token ids, cache salt or None): findable
BLOCK_REMOVED = 1  # (BLOCK_REMOVED, block hash): content no longer findable (evicted or uncached)
ALL_BLOCKS_CLEARED = 2  # (ALL_BLOCKS_CLEARED,): nothing findable any more


def sha256_block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """A collision-resistant hash of a full block's content and, through ``parent``, of everything before it."""
    digest = hashlib.sha256(parent or b"")
    digest.update(b",".join(str(t).encode() for t in token_ids))
    return digest.digest()


class BlockPool:
    """Hands out fixed-size KV blocks by id; knows nothing about tensors or requests.

    A block is free when its reference count is 0. Free blocks wait in LRU order: freed blocks go to the
    back, new blocks come from the front. A full block may carry a hash of its content (prefix caching):
    it stays findable by :meth:`lookup` after it is freed, until it is reused for something else (evicted).
    A lookup compares the stored tokens and parent hash too, so even a colliding hash never returns
    another prompt's K/V.

    With ``events`` a list (:meth:`enable_events`), every change to the set of findable hashes is appended
    to it as a tuple (``BLOCK_STORED``, ``BLOCK_REMOVED``, ``ALL_BLOCKS_CLEARED``; vLLM's KV cache events) for
    :meth:`take_events`: an append per registered or evicted block, nothing more on the step's path.
    """

    def __init__(self, num_blocks: int, hash_fn: Callable[[bytes | None, Sequence[int]], bytes] = sha256_block_hash):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.hash_fn = hash_fn
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._keys: dict[int, tuple[bytes, BlockKey]] = {}  # block id -> (its hash, its key), copies included
        self._copies: dict[bytes, list[int]] = {}  # block hash -> other blocks holding that content
        self.num_evictions = 0
        self.events: list[tuple] | None = None  # KV cache events since the last take_events(), when enabled

    def enable_events(self) -> None:
        """Starts recording KV cache events (see the class docstring)."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[tuple]:
        """The events recorded since the last call, oldest first (empty when recording is off)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Takes ``count`` free blocks (ref count 1 each), evicting their cached content if any.

        Raises:
            RuntimeError: fewer than ``count`` blocks are free (callers check ``num_free_blocks`` first).
        """
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drops one reference to each block; a block with none left joins the back of the free queue
        (its cached content stays findable until evicted).

        Raises:
            RuntimeError: a block that is already free (a double free is a bug, never ignored).
        """
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    def touch(self, block_ids: Sequence[int]) -> None:
        """Adds a reference to each block (a prefix-cache hit), taking free ones off the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    # -- prefix caching -----------------------------------------------------------------------------
    def lookup(self, block_hash: bytes, key: BlockKey) -> int | None:
        """The block holding exactly ``key`` (parent hash, token ids, salt), or None."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self._keys[block_id][1] != key:
            return None
        return block_id

    def cache(self, block_id: int, block_hash: bytes, key: BlockKey) -> None:
        """Registers a full block's content. When another block already holds that content, this one is
        kept as a copy: lookups still return the first, and the content stays findable in the copy after
        the first is evicted (two requests that generate the same tokens each fill a block of them)."""
        if block_id in self._keys:
            return
        self._keys[block_id] = (block_hash, key)
        if block_hash in self._cached:
            self._copies.setdefault(block_hash, []).append(block_id)
            return
        self._cached[block_hash] = block_id
        if self.events is not None:
            self.events.append((BLOCK_STORED, block_hash, key[0], key[1], key[2]))

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Forgets the content of these blocks (their K/V cannot be trusted, e.g. a forward pass failed
        after they were registered); they stay allocated or free as they were."""
        for block_id in block_ids:
            self._forget(block_id)

    def _evict(self, block_id: int) -> None:
        if self._forget(block_id):
            self.num_evictions += 1

    def _forget(self, block_id: int) -> bool:
        """Drops a block's registered content; True when no other block holds it (it is no longer findable)."""
        entry = self._keys.pop(block_id, None)
        if entry is None:
            return False
        block_hash = entry[0]
        copies = self._copies.get(block_hash)
        if self._cached[block_hash] != block_id:  # a copy
            copies.remove(block_id)
        elif copies:  # the first goes, a copy takes its place
            self._cached[block_hash] = copies.pop()
        else:
            del self._cached[block_hash]
            if self.events is not None:
                self.events.append((BLOCK_REMOVED, block_hash))
            return True
        if not copies:
            del self._copies[block_hash]
        return False

    def reset_prefix_cache(self) -> bool:
        """Forgets the content of every block, so that no later prompt finds any (vLLM's
        ``reset_prefix_cache``): only while no block is in use, since a running request's blocks are its own
        K/V. Returns True when reset (recording ``ALL_BLOCKS_CLEARED``), False, changing nothing, otherwise."""
        if self.num_used_blocks > 0:
            return False
        self._cached.clear()
        self._keys.clear()
        self._copies.clear()
        if self.events is not None:
            self.events.append((ALL_BLOCKS_CLEARED,))
        return True

    def cached_hashes(self) -> set[bytes]:
        """The hashes of every block whose content is findable now (for tests and tools)."""
        return set(self._cached)
