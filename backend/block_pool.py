"""The pool of KV cache blocks: free-block queue, reference counts and prefix-cache hashes.

PagedAttention (Kwon et al. SOSP 2023, sec. 4.2-4.4) for blocks and sharing; vLLM's automatic prefix
caching for keeping freed full blocks reusable by content until they are evicted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

BlockKey = tuple[bytes | None, tuple[int, ...]]  # (parent block's hash, this block's token ids)


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
    """

    def __init__(self, num_blocks: int, hash_fn: Callable[[bytes | None, Sequence[int]], bytes] = sha256_block_hash):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.hash_fn = hash_fn
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._keys: dict[int, tuple[bytes, BlockKey]] = {}  # block id -> (its hash, its key)
        self.num_evictions = 0

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
        """The block holding exactly ``key`` (parent hash, token ids), or None."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self._keys[block_id][1] != key:
            return None
        return block_id

    def cache(self, block_id: int, block_hash: bytes, key: BlockKey) -> None:
        """Registers a full block's content; a no-op when that content is already cached in another block."""
        if block_hash not in self._cached and block_id not in self._keys:
            self._cached[block_hash] = block_id
            self._keys[block_id] = (block_hash, key)

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Forgets the content of these blocks (their K/V cannot be trusted, e.g. a forward pass failed
        after they were registered); they stay allocated or free as they were."""
        for block_id in block_ids:
            entry = self._keys.pop(block_id, None)
            if entry is not None:
                del self._cached[entry[0]]

    def _evict(self, block_id: int) -> None:
        entry = self._keys.pop(block_id, None)
        if entry is not None:
            del self._cached[entry[0]]
            self.num_evictions += 1
