"""`BlockPool`: the ref-counted KV-cache blocks and their free queue. Pure Python: no tensors here."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    """Hands out block ids in `[0, num_blocks)` and takes them back.

    Invariants (checked by `check_integrity`):
      - every block is either in the free queue with ref count 0, or out of it with ref count >= 1;
      - the free queue holds no block twice.

    Order: `allocate` takes blocks from the front of the free queue; `free` puts blocks whose ref count drops to
    zero back at the front, last block first. The most recently freed blocks are therefore reused first, so the
    memory the cache touches stays close to its peak use instead of cycling through every block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def is_whole(self) -> bool:
        """True when every block is free: nothing is held, nothing leaked."""
        return len(self._free) == self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes `num_blocks` free blocks, each with ref count 1. Raises RuntimeError when too few are free:
        callers check `can_allocate` first."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Adds a holder to blocks that are already held (block sharing)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] < 1:
                raise RuntimeError(f"block {block_id} is free and cannot be shared")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one holder from each block; blocks nobody holds any more return to the free queue."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count < 1:
                raise RuntimeError(f"block {block_id} freed more often than it was held")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.appendleft(block_id)

    def check_integrity(self) -> None:
        """Raises AssertionError if an invariant is broken (a bookkeeping bug, never a user error)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free queue twice"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has ref count {count}"
            assert (count == 0) == (block_id in free), f"block {block_id}: ref count {count}, free={block_id in free}"
