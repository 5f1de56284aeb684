"""Per-request block tables over the block pool (vLLM v1's KVCacheManager)."""

from __future__ import annotations

from dataclasses import dataclass

from backend.block_pool import BlockPool
from backend.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheUsage:
    """A snapshot of the pool: counts in blocks, ``tokens_per_block`` in tokens."""

    num_blocks: int
    used_blocks: int
    free_blocks: int
    tokens_per_block: int

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.used_blocks / self.num_blocks


class KVCacheManager:
    """Grows each request's block table as its tokens grow and frees it on finish, abort or preemption.

    A block table lists a request's block ids in token order: token i lives in block
    ``table[i // block_size]`` at offset ``i % block_size`` (its slot is ``block_id * block_size + offset``).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Makes room for ``num_new_tokens`` more computed tokens of ``request``.

        Returns:
            False, with nothing allocated, when the pool has too few free blocks.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Returns all of the request's blocks to the pool (a no-op when it holds none)."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            # Last block first: with prefix caching the tail is the least likely to be shared.
            self.pool.free(table[::-1])

    def usage(self) -> KVCacheUsage:
        pool = self.pool
        return KVCacheUsage(pool.num_blocks, pool.num_used_blocks, pool.num_free_blocks, self.block_size)
