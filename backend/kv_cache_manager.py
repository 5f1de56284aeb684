"""Per-request block tables over the block pool (vLLM v1's KVCacheManager): allocation as tokens grow,
prefix-cache hits (blocks registered at allocation, so a request admitted in the same step can share them),
and freeing.

The manager keeps its own per-request state (block table, memoized block hashes, how many blocks are
registered in the prefix cache) keyed by request id; it reads a :class:`Request`'s tokens and counters
and writes none of its fields. The scheduler asks it questions through its methods only.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.block_pool import BlockKey, BlockPool
from backend.request import Request
from backend.utils import cdiv

NULL_BLOCK = -1
"""A block-table entry whose block was freed because it fell wholly behind the sliding window (never read)."""


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

    Prefix caching (vLLM's automatic prefix caching): a full block is registered under a hash of its
    tokens and of everything before it when it is allocated; its K/V are written by the forward pass of
    that same step, before any layer reads them, so a request admitted in the same step may already
    share it. A request with a ``cache_salt`` hashes the salt into its first block: it shares only with
    requests of the same salt, and it does so even when prefix caching is off (the completions of one
    ``n`` > 1 request share their prompt that way).

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
        self._block_hashes: dict[str, list[tuple[bytes, BlockKey]]] = {}  # memo: tokens never change
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks registered in the prefix cache
        self.prefix_cache_queries = 0  # prompt tokens looked up (only with prefix caching on)
        self.prefix_cache_hits = 0  # of which found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty when it holds no blocks)."""
        return list(self.block_tables.get(request_id, ()))

    # -- prefix caching -----------------------------------------------------------------------------
    def _caches(self, request: Request) -> bool:
        return self.enable_prefix_caching or request.cache_salt is not None

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of leading full blocks of the request already cached, leaving at least the last
        token to compute (its logits are needed). Empty when prefix caching is off (and no salt)."""
        if not self._caches(request):
            return []
        hits = []
        for i in range((request.num_tokens - 1) // self.block_size):
            block_hash, key = self._block_hash(request, i)
            block_id = self.pool.lookup(block_hash, key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, request: Request, num_cached_tokens: int) -> None:
        """Counts an admitted request's lookup in :attr:`prefix_cache_queries` and :attr:`prefix_cache_hits`:
        once, when the scheduler admits it (a request that waits looks up again at every step, and those looks
        are not counted), and never after a preemption, as vLLM's ``PrefixCacheStats`` counts."""
        if self.enable_prefix_caching and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached_tokens

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the request's blocks that ``num_tokens`` tokens fill, so later requests can reuse them.
        Only the request's own tokens count: slots past them (a speculative decode's drafts) never make a
        block findable, so no block is hashed while it holds a draft that may be rejected."""
        if not self._caches(request):
            return
        table = self.block_tables[request.request_id]
        done = self._num_cached_blocks.get(request.request_id, 0)
        full = min(min(num_tokens, request.num_tokens) // self.block_size, len(table))
        for i in range(done, full):
            if table[i] == NULL_BLOCK:  # a prefix-cache hit behind the window, left free
                continue
            block_hash, key = self._block_hash(request, i)
            self.pool.cache(table[i], block_hash, key)
        self._num_cached_blocks[request.request_id] = max(done, full)

    def _block_hash(self, request: Request, index: int) -> tuple[bytes, BlockKey]:
        """Hash and key of the request's ``index``-th full block. The salt, if any, seeds the first block's
        hash in place of a parent and is part of its key (vLLM puts ``cache_salt`` in the first block's extra
        keys, ``generate_block_hash_extra_keys``); later blocks carry it through their parent's hash."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1][0] if hashes else None
            salt = request.cache_salt if not hashes and request.cache_salt else None
            tokens = tuple(request.token_ids[i * self.block_size:(i + 1) * self.block_size])
            seed = parent if parent is not None else (salt.encode() if salt else None)
            hashes.append((self.pool.hash_fn(seed, tokens), (parent, tokens, salt)))
        return hashes[index]

    # -- allocation -----------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Makes room for ``num_new_tokens`` more computed tokens of ``request`` and registers the blocks
        they fill in the prefix cache.

        Args:
            computed_blocks: prefix-cache hits to put at the head of a new request's table (from
                :meth:`get_computed_blocks`); the caller advances ``num_computed_tokens`` past them.

        Returns:
            False, with nothing changed, when the pool has too few free blocks.
        """
        table = self.block_tables.get(request.request_id, [])
        if (table and not computed_blocks and self.sliding_window is None
                and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size):
            self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)  # fits: most decodes
            return True
        computed_blocks = computed_blocks or []
        first = request.num_computed_tokens + len(computed_blocks) * self.block_size
        behind = self._blocks_behind_window(first)
        # Prefix-cache hits behind the window are not needed: left free, their entries null.
        computed_blocks = [NULL_BLOCK if len(table) + i < behind else b for i, b in enumerate(computed_blocks)]
        new_blocks = cdiv(first + num_new_tokens, self.block_size) - len(table) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b != NULL_BLOCK and self.pool.ref_counts[b] == 0)
        released = sum(1 for b in table[:behind] if b != NULL_BLOCK and self.pool.ref_counts[b] == 1)
        if max(new_blocks, 0) + revived > self.pool.num_free_blocks + released:
            return False
        self.pool.touch([b for b in computed_blocks if b != NULL_BLOCK])
        table = self.block_tables.setdefault(request.request_id, table)
        table.extend(computed_blocks)
        dropped = [b for b in table[:behind] if b != NULL_BLOCK]
        if dropped:  # before allocating, so this request's own old blocks can be reused at once
            table[:behind] = [NULL_BLOCK] * behind
            self.pool.free(dropped[::-1])
        if new_blocks > 0:
            table.extend(self.pool.allocate(new_blocks))
        self._cache_full_blocks(request, first + num_new_tokens)
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

    def shares_unwritten_blocks(self, request: Request) -> bool:
        """Whether another request holds a block that this one registered for tokens it has not computed yet.

        Blocks are registered when allocated, so a request admitted later in the same step can take them as
        prefix-cache hits; only this request's forward pass of that step writes their K/V. Preempting it now
        would leave the other request attending to K/V that nobody writes.
        """
        table = self.block_tables.get(request.request_id, ())
        return any(b != NULL_BLOCK and self.pool.ref_counts[b] > 1
                   for b in table[request.num_computed_tokens // self.block_size:])

    def free_surplus_blocks(self, request: Request) -> None:
        """Returns the blocks of the table past ``request.num_computed_tokens`` to the pool: a speculative decode
        allocated them for drafts that were rejected. They hold no registered content (drafts are never hashed)."""
        table = self.block_tables.get(request.request_id)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if table and len(table) > keep:
            surplus = table[keep:]
            del table[keep:]
            self.pool.free(surplus[::-1])

    def free(self, request: Request, uncache: bool = False) -> None:
        """Returns all of the request's blocks to the pool (a no-op when it holds none).

        Blocks registered for tokens beyond ``request.num_computed_tokens`` leave the prefix cache: the request
        is preempted or ended in the step that allocated them, before its forward pass wrote their K/V.

        Args:
            uncache: forget the prefix-cache entries of all its blocks (their K/V may never have been written:
                the forward pass failed).
        """
        table = self.block_tables.pop(request.request_id, None)
        self._block_hashes.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table:
            unwritten = 0 if uncache else request.num_computed_tokens // self.block_size
            self.pool.uncache([b for b in table[unwritten:] if b != NULL_BLOCK])
            # Last block first: it joins the free queue first, so it is evicted first (the tail of a
            # prompt is the least likely part to be shared).
            self.pool.free([b for b in table[::-1] if b != NULL_BLOCK])

    def usage(self) -> KVCacheUsage:
        pool = self.pool
        return KVCacheUsage(pool.num_blocks, pool.num_used_blocks, pool.num_free_blocks, self.block_size,
                            self.prefix_cache_queries, self.prefix_cache_hits)
