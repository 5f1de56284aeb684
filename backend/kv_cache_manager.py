"""Per-request block tables over the block pool (vLLM v1's KVCacheManager): allocation as tokens grow,
prefix-cache hits, forks for parallel sampling with copy-on-write, and freeing."""

from __future__ import annotations

from dataclasses import dataclass

from backend.block_pool import BlockPool
from backend.request import Request


NULL_BLOCK = -1
"""A block-table entry whose block was freed because it fell wholly behind the sliding window (never read)."""


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

    With ``sliding_window`` W (a model whose every layer attends through the same window), a query at position
    p reads keys p - W + 1 .. p only, so before each allocation the blocks wholly behind the window of the next
    token to compute are freed and their entries become :data:`NULL_BLOCK`: a request holds at most
    ``cdiv(W - 1 + chunk, block_size) + 1`` blocks whatever its length (vLLM's SlidingWindowManager does the
    same). Freed full blocks stay in the prefix cache until evicted, like any freed block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 pool: BlockPool | None = None, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
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
            if table[i] == NULL_BLOCK:  # freed behind the window (it was cached when it filled)
                continue
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
        behind = self._blocks_behind_window(first)
        # Prefix-cache hits behind the window are not needed: left free, their entries null.
        computed_blocks = [NULL_BLOCK if len(table) + i < behind else b for i, b in enumerate(computed_blocks)]
        copy_on_write = index < len(table) and self.pool.ref_counts[table[index]] > 1
        new_blocks = cdiv(first + num_new_tokens, self.block_size) - len(table) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b != NULL_BLOCK and self.pool.ref_counts[b] == 0)
        released = sum(1 for b in table[:behind] if b != NULL_BLOCK and self.pool.ref_counts[b] == 1)
        if max(new_blocks, 0) + copy_on_write + revived > self.pool.num_free_blocks + released:
            return False
        self.pool.touch([b for b in computed_blocks if b != NULL_BLOCK])
        table = self.block_tables.setdefault(request.request_id, table)
        table.extend(computed_blocks)
        dropped = [b for b in table[:behind] if b != NULL_BLOCK]
        if dropped:  # before allocating, so this request's own old blocks can be reused at once
            table[:behind] = [NULL_BLOCK] * behind
            self.pool.free(dropped[::-1])
        if copy_on_write:
            (copy,) = self.pool.allocate(1)
            self.pending_copies.append((table[index], copy))
            self.pool.free([table[index]])
            table[index] = copy
        if new_blocks > 0:
            table.extend(self.pool.allocate(new_blocks))
        return True

    def _blocks_behind_window(self, first: int) -> int:
        """How many leading blocks hold only tokens before ``first - sliding_window + 1``, the oldest key the
        query at position ``first`` (the next to compute) can see; 0 without a window."""
        if self.sliding_window is None:
            return 0
        return max(0, first - self.sliding_window + 1) // self.block_size

    def max_blocks_per_request(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens computed ``chunk`` tokens a step at a time ever
        holds: all of them, or with a sliding window W those under ``W - 1 + chunk`` tokens (+1 for alignment)."""
        full = self.blocks_for_tokens(num_tokens)
        if self.sliding_window is None:
            return full
        return min(full, cdiv(self.sliding_window - 1 + min(chunk, num_tokens), self.block_size) + 1)

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Shares the parent's blocks for its first ``num_tokens`` tokens with ``child`` (parallel sampling)."""
        shared = self.block_tables[parent.request_id][: self.blocks_for_tokens(num_tokens)]
        self.pool.touch([b for b in shared if b != NULL_BLOCK])
        self.block_tables[child.request_id] = list(shared)

    def free(self, request: Request) -> None:
        """Returns all of the request's blocks to the pool (a no-op when it holds none)."""
        table = self.block_tables.pop(request.request_id, None)
        request.num_cached_blocks = 0
        if table:
            # Last block first: it joins the free queue first, so it is evicted first (the tail of a
            # prompt is the least likely part to be shared).
            self.pool.free([b for b in table[::-1] if b != NULL_BLOCK])

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def usage(self) -> KVCacheUsage:
        pool = self.pool
        return KVCacheUsage(pool.num_blocks, pool.num_used_blocks, pool.num_free_blocks, self.block_size,
                            self.prefix_cache_queries, self.prefix_cache_hits)
