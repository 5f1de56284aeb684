"""Per-request block tables over the block pool (vLLM v1's KVCacheManager): allocation as tokens grow,
prefix-cache hits, forks for parallel sampling with copy-on-write, and freeing."""

from __future__ import annotations

from dataclasses import dataclass

from backend.block_pool import BlockPool
from backend.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheUsage:
    """A snapshot of the pool: counts in blocks, ``tokens_per_block`` in tokens, prefix cache in tokens."""

    num_blocks: int
    used_blocks: int
    free_blocks: int
    tokens_per_block: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.used_blocks / self.num_blocks


class KVCacheManager:
    """Grows each request's block table as its tokens grow and frees it on finish, abort or preemption.

    A block table lists a request's block ids in token order: token i lives in block
    ``table[i // block_size]`` at offset ``i % block_size`` (its slot is ``block_id * block_size + offset``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 pool: BlockPool | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = pool or BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (source, destination) block ids, copy before the forward
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix caching -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of leading full blocks of the request already cached, leaving at least the last
        token to compute (its logits are needed). Empty when prefix caching is off."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i in range((request.num_tokens - 1) // self.block_size):
            block_hash, key = self._block_hash(request, i)
            block_id = self.pool.lookup(block_hash, key)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's blocks that are full of computed tokens, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.request_id, ())
        for i in range(request.num_cached_blocks, min(request.num_computed_tokens // self.block_size, len(table))):
            block_hash, key = self._block_hash(request, i)
            self.pool.cache(table[i], block_hash, key)
        request.num_cached_blocks = max(request.num_cached_blocks, request.num_computed_tokens // self.block_size)

    def _block_hash(self, request: Request, index: int) -> tuple[bytes, tuple]:
        """Hash and key of the request's ``index``-th full block, memoized on the request (tokens never change)."""
        hashes = request.block_hashes
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1][0] if hashes else None
            tokens = tuple(request.token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append((self.pool.hash_fn(parent, tokens), (parent, tokens)))
        return hashes[index]

    # -- allocation -----------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Makes room for ``num_new_tokens`` more computed tokens of ``request``.

        Args:
            computed_blocks: prefix-cache hits to put at the head of a new request's table (from
                :meth:`get_computed_blocks`); the caller advances ``num_computed_tokens`` past them.

        Returns:
            False, with nothing changed, when the pool has too few free blocks.

        A write into a block that other requests share (a fork's last prompt block) first copies it
        (copy-on-write, PagedAttention sec. 4.4); the copy is queued in ``pending_copies``.
        """
        computed_blocks = computed_blocks or []
        table = self.block_tables.get(request.request_id, [])
        first = request.num_computed_tokens + len(computed_blocks) * self.block_size
        index = first // self.block_size
        copy_on_write = index < len(table) and self.pool.ref_counts[table[index]] > 1
        new_blocks = cdiv(first + num_new_tokens, self.block_size) - len(table) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)  # free now, in use after
        if max(new_blocks, 0) + copy_on_write + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed_blocks)
        table = self.block_tables.setdefault(request.request_id, table)
        table.extend(computed_blocks)
        if copy_on_write:
            (copy,) = self.pool.allocate(1)
            self.pending_copies.append((table[index], copy))
            self.pool.free([table[index]])
            table[index] = copy
        if new_blocks > 0:
            table.extend(self.pool.allocate(new_blocks))
        return True

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Shares the parent's blocks for its first ``num_tokens`` tokens with ``child`` (parallel sampling)."""
        shared = self.block_tables[parent.request_id][: self.blocks_for_tokens(num_tokens)]
        self.pool.touch(shared)
        self.block_tables[child.request_id] = list(shared)

    def free(self, request: Request) -> None:
        """Returns all of the request's blocks to the pool (a no-op when it holds none)."""
        table = self.block_tables.pop(request.request_id, None)
        request.num_cached_blocks = 0
        if table:
            # Last block first: it joins the free queue first, so it is evicted first (the tail of a
            # prompt is the least likely part to be shared).
            self.pool.free(table[::-1])

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def usage(self) -> KVCacheUsage:
        pool = self.pool
        return KVCacheUsage(pool.num_blocks, pool.num_used_blocks, pool.num_free_blocks, self.block_size,
                            self.prefix_cache_queries, self.prefix_cache_hits)
