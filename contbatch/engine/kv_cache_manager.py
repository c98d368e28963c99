"""`KVCacheManager`: which blocks each request holds (its block table), and the prefix cache over them."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from contbatch.engine.block_pool import BlockHash, BlockPool
from contbatch.engine.request import Request

DEAD_BLOCK = -1


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The content hash of a full block: its tokens chained to the hash of everything before it, so equal
    hashes mean equal prefixes, not just equal blocks."""
    digest = hashlib.blake2b(digest_size=16)
    if parent is not None:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheManager:
    """Per-request block tables over one `BlockPool`, with prefix caching.

    A request holding `n` blocks can keep `n * block_size` tokens; token `i` of a request lives in block
    `block_table[i // block_size]` at offset `i % block_size`. With caching on, every block a request fills
    is registered under the hash of its prefix once computed; a new request starts with the longest computed
    prefix of its tokens found in the cache (shared, ref-counted blocks) and computes only the rest. The manager
    returns plain block ids and hides the pool; it never decides *who* gets memory (that is the scheduler's
    job), only whether an allocation fits.

    With `sliding_window` (a model whose layers all slide), blocks holding only tokens that every future query
    of the request is past the window of are given back at once; their table entries become DEAD_BLOCK, so a
    long generation holds about `window / block_size + 1` blocks.
    """

    def __init__(self, pool: BlockPool, block_size: int, max_blocks_per_request: int = 0,
                 enable_caching: bool = False, sliding_window: int | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self._num_dead: dict[str, int] = {}
        self.max_blocks_per_request = max_blocks_per_request or pool.num_blocks
        self.enable_caching = enable_caching
        self._tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self._pending: dict[BlockHash, str] = {}
        self._owned: dict[str, list[BlockHash]] = {}

    def max_tokens_per_request(self) -> int:
        """The most tokens one request can ever hold."""
        return min(self.max_blocks_per_request, self.pool.num_blocks) * self.block_size

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks `request_id` still needs so that it can hold `num_tokens` tokens in all."""
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - len(self._tables.get(request_id, ())))

    def can_allocate(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Whether `request_id` can hold `num_tokens` tokens, starting from the cached blocks `prefix` when it
        holds nothing yet (taking an unheld cached block uses up one free block too)."""
        held = len(self._tables.get(request_id, ())) or len(prefix)
        needed = max(0, -(-num_tokens // self.block_size) - held)
        unheld_prefix = sum(self.pool.ref_count(block_id) == 0 for block_id in prefix)
        live = held - self._num_dead.get(request_id, 0) + needed
        return live <= self.max_blocks_per_request and self.pool.can_allocate(needed + unheld_prefix)

    def allocate_slots(self, request_id: str, num_tokens: int) -> None:
        """Grows `request_id`'s table to hold `num_tokens` tokens in all. Precondition: `can_allocate`."""
        needed = self.num_new_blocks(request_id, num_tokens)
        if needed:
            self._tables.setdefault(request_id, []).extend(self.pool.allocate(needed))

    # --- prefix caching ----------------------------------------------------------------------------------------

    def cached_prefix(self, request: Request) -> list[int]:
        """The blocks of the longest cached prefix of `request`'s tokens, leaving at least its last token to be
        computed (its logits are needed)."""
        if not self.enable_caching:
            return []
        blocks = []
        for block_hash in self._hashes(request, (request.num_tokens - 1) // self.block_size):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def is_being_computed(self, request: Request, num_cached_blocks: int) -> bool:
        """True when the first block `request` would compute is being computed right now by another running
        request: waiting a step or two then shares it instead of computing it twice."""
        if not self.enable_caching or num_cached_blocks >= (request.num_tokens - 1) // self.block_size:
            return False
        owner = self._pending.get(self._hashes(request, num_cached_blocks + 1)[num_cached_blocks])
        return owner is not None and owner != request.request_id

    def start_with_prefix(self, request: Request, prefix: Sequence[int]) -> None:
        """Gives `request` (holding nothing yet) the cached blocks `prefix`, and marks the full blocks it will
        compute as pending so that requests with the same prefix wait for them."""
        for block_id in prefix:
            self.pool.take_cached(block_id)
        self._tables[request.request_id] = list(prefix)
        self._num_registered[request.request_id] = len(prefix)
        if self.enable_caching:
            owned = self._owned.setdefault(request.request_id, [])
            for block_hash in self._hashes(request, request.num_tokens // self.block_size)[len(prefix):]:
                if self._pending.setdefault(block_hash, request.request_id) == request.request_id:
                    owned.append(block_hash)

    def cache_computed_blocks(self, request: Request) -> None:
        """Registers the blocks `request` has filled and computed since the last call."""
        if not self.enable_caching:
            return
        table = self._tables.get(request.request_id, [])
        full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(request.request_id, 0)
        if full <= start:
            return
        for index, block_hash in enumerate(self._hashes(request, full)[start:], start):
            self.pool.cache(table[index], block_hash)
            if self._pending.get(block_hash) == request.request_id:
                del self._pending[block_hash]
        self._num_registered[request.request_id] = max(start, full)

    def free_out_of_window(self, request: Request) -> None:
        """Gives back `request`'s blocks that no future query can see: the next query, at position
        `num_computed_tokens`, sees keys from `num_computed_tokens - window + 1` on."""
        if self.sliding_window is None:
            return
        table = self._tables.get(request.request_id)
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        dead = 0 if table is None else min(max(0, first_visible) // self.block_size, len(table))
        start = self._num_dead.get(request.request_id, 0)
        if dead <= start:
            return
        self.pool.free(reversed(table[start:dead]))
        table[start:dead] = [DEAD_BLOCK] * (dead - start)
        self._num_dead[request.request_id] = dead

    def reset_prefix_cache(self) -> None:
        """Forgets all cached content: nothing computed so far will be shared again."""
        self.pool.reset_prefix_cache()
        self._pending.clear()
        self._owned.clear()
        for request_id in self._num_registered:
            self._num_registered[request_id] = len(self._tables.get(request_id, ()))

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of `request`'s first `num_blocks` full blocks (computed once, then reused)."""
        hashes = request.block_hashes
        size = self.block_size
        while len(hashes) < num_blocks:
            index = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     request.token_ids[index * size:(index + 1) * size]))
        return hashes[:num_blocks]

    # ------------------------------------------------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Returns all of `request_id`'s blocks to the pool (last block first). Unknown ids are ignored."""
        table = self._tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._num_dead.pop(request_id, None)
        for block_hash in self._owned.pop(request_id, ()):
            if self._pending.get(block_hash) == request_id:
                del self._pending[block_hash]
        if table:
            self.pool.free(block_id for block_id in reversed(table) if block_id != DEAD_BLOCK)

    def check_integrity(self) -> None:
        """The ref count of every block equals the number of tables that hold it."""
        holders = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for block_id in table:
                if block_id != DEAD_BLOCK:
                    holders[block_id] += 1
        for block_id, count in enumerate(holders):
            assert self.pool.ref_count(block_id) == count, f"block {block_id}: ref count != {count} holders"
        self.pool.check_integrity()
