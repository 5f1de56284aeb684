"""The pool of KV cache blocks: a free-block queue and reference counts (PagedAttention, Kwon et al. SOSP 2023, sec. 4.2)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out fixed-size KV blocks by id; knows nothing about tensors or requests.

    A block is free when its reference count is 0. Freed blocks go to the back of the free queue and
    new blocks come from the front, so the least recently freed block is reused first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Takes ``count`` free blocks (ref count 1 each).

        Raises:
            RuntimeError: fewer than ``count`` blocks are free (callers check ``num_free_blocks`` first).
        """
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self.ref_counts[block_id] = 1
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference to each block; a block with none left returns to the free queue.

        Raises:
            RuntimeError: a block that is already free (a double free is a bug, never ignored).
        """
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free.append(block_id)
