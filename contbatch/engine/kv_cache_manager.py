"""`KVCacheManager`: which blocks each request holds (its block table)."""

from __future__ import annotations

from contbatch.engine.block_pool import BlockPool


class KVCacheManager:
    """Per-request block tables over one `BlockPool`.

    A request holding `n` blocks can keep `n * block_size` tokens; token `i` of a request lives in block
    `block_table[i // block_size]` at offset `i % block_size`. The manager returns plain block ids and hides the
    pool; it never decides *who* gets memory (that is the scheduler's job), only whether an allocation fits.
    """

    def __init__(self, pool: BlockPool, block_size: int, max_blocks_per_request: int = 0) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_blocks_per_request = max_blocks_per_request or pool.num_blocks
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def max_tokens_per_request(self) -> int:
        """The most tokens one request can ever hold."""
        return min(self.max_blocks_per_request, self.pool.num_blocks) * self.block_size

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks `request_id` still needs so that it can hold `num_tokens` tokens in all."""
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - len(self._tables.get(request_id, ())))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        needed = self.num_new_blocks(request_id, num_tokens)
        held = len(self._tables.get(request_id, ()))
        return held + needed <= self.max_blocks_per_request and self.pool.can_allocate(needed)

    def allocate_slots(self, request_id: str, num_tokens: int) -> None:
        """Grows `request_id`'s table to hold `num_tokens` tokens in all. Precondition: `can_allocate`."""
        needed = self.num_new_blocks(request_id, num_tokens)
        if needed:
            self._tables.setdefault(request_id, []).extend(self.pool.allocate(needed))

    def free(self, request_id: str) -> None:
        """Returns all of `request_id`'s blocks to the pool (last block first). Unknown ids are ignored."""
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def check_integrity(self) -> None:
        """The ref count of every block equals the number of tables that hold it."""
        holders = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for block_id in table:
                holders[block_id] += 1
        for block_id, count in enumerate(holders):
            assert self.pool.ref_count(block_id) == count, f"block {block_id}: ref count != {count} holders"
        self.pool.check_integrity()
