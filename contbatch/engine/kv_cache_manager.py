"""`KVCacheManager`: which blocks each request holds (one block table per layer group), and the prefix cache."""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from contbatch.engine.attention_types import FullAttention, attention_policy
from contbatch.engine.block_pool import BlockHash, BlockPool
from contbatch.engine.block_tails import BlockTails
from contbatch.engine.request import Request

DEAD_BLOCK = -1
MAX_RESERVED_BLOCKS = 32


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The content hash of a full block: its tokens chained to the hash of everything before it, so equal
    hashes mean equal prefixes, not just equal blocks."""
    digest = hashlib.blake2b(digest_size=16)
    if parent is not None:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks a new request can start from: its first `num_blocks` full blocks, as one block table per
    group (in a sliding group, the blocks no future query can see are DEAD_BLOCK). With `partial_tokens` > 0,
    the request's next `partial_tokens` tokens are also the first ones of the cached blocks `partial_blocks` (one
    per group), which are copied into the request's own next block, never shared (it writes the rest)."""

    num_blocks: int
    tables: tuple[tuple[int, ...], ...]
    partial_tokens: int = 0
    partial_blocks: tuple[int, ...] = ()

    def num_tokens(self, block_size: int) -> int:
        """The leading tokens the request takes from the cache."""
        return self.num_blocks * block_size + self.partial_tokens


class KVCacheManager:
    """Per-request block tables over one `BlockPool`, with prefix caching.

    A request has one block table per layer group (`windows[g]` is group g's sliding window, None for full
    attention); all its tables have the same length. Token `i` lives at offset `i % block_size` of block
    `table[i // block_size]` of every group. What depends on the kind of attention is asked of the group's
    policy (`attention_types`): blocks no future query can see are given back at once and their entries become
    DEAD_BLOCK (a sliding group holds about `window / block_size + 1` blocks however long the request grows).

    With caching on, every block a request fills is registered, once computed, under the hash of its prefix
    (and its group); a new request starts with the longest cached prefix of its tokens (shared, ref-counted
    blocks) and computes only the rest. Where that prefix ends inside a block, the cached block after it with the
    longest run of the request's next tokens (`BlockTails`) is copied into the request's own block and the run
    is not computed again either. A block shared after `fork` is copied before it is written
    (copy-on-write). The manager returns plain block ids and hides the pool; it never decides *who* gets
    memory (that is the scheduler's job), only whether an allocation fits.
    """

    def __init__(self, pool: BlockPool, block_size: int, max_blocks_per_request: int = 0,
                 enable_caching: bool = False, windows: Sequence[int | None] = (None,)) -> None:
        self.pool = pool
        self.block_size = block_size
        self.windows = tuple(windows)
        self.policies: tuple[FullAttention, ...] = tuple(attention_policy(block_size, w) for w in self.windows)
        self.frees_blocks = any(policy.sliding_window is not None for policy in self.policies)
        self.max_blocks_per_request = max_blocks_per_request or pool.num_blocks
        self.enable_caching = enable_caching
        self._tables: dict[str, list[list[int]]] = {}
        self._num_dead: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self._pending: dict[BlockHash, str] = {}
        self._owned: dict[str, list[BlockHash]] = {}
        self._tails = BlockTails()
        self._partial: dict[str, tuple[int, ...]] = {}

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        tables = self._tables.get(request_id)
        return tables[group] if tables else []

    def block_tables(self, request_id: str) -> list[list[int]]:
        """One table per group, all of the same length."""
        return self._tables.get(request_id) or [[] for _ in self.windows]

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` holds blocks (it was admitted and is neither preempted nor freed)."""
        return request_id in self._tables

    # --- capacity ----------------------------------------------------------------------------------------------

    def blocks_needed_alone(self, num_tokens: int, max_chunk: int) -> list[int]:
        """Per group, the most blocks a request that grows to `num_tokens` tokens, computing at most `max_chunk`
        a step, holds at once."""
        return [policy.max_blocks_held(num_tokens, max_chunk) for policy in self.policies]

    def can_ever_hold(self, num_tokens: int, max_chunk: int) -> bool:
        """Whether a request growing to `num_tokens` tokens fits in the cache when it runs alone."""
        needed = self.blocks_needed_alone(num_tokens, max_chunk)
        return max(needed) <= self.max_blocks_per_request and sum(needed) <= self.pool.num_blocks

    def can_allocate(self, request: Request, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Whether `request` can hold `num_tokens` tokens (and copy the shared block it writes into), starting
        from the cached blocks `hit` when it holds nothing yet (an unheld cached block uses up a free block)."""
        tables: Sequence[Sequence[int]] | None = self._tables.get(request.request_id)
        needed = 0
        if tables is not None:
            num_dead: Sequence[int] = self._num_dead[request.request_id]
            needed += len(self._blocks_to_copy(request, tables))
        else:
            tables = hit.tables if hit else [()] * len(self.windows)
            num_dead = [table.count(DEAD_BLOCK) for table in tables]
            needed += sum(self.pool.ref_count(block_id) == 0
                          for table in tables for block_id in table if block_id != DEAD_BLOCK)
        length = -(-num_tokens // self.block_size)
        most_live = 0
        for table, dead in zip(tables, num_dead, strict=True):
            new = max(0, length - len(table))
            needed += new
            most_live = max(most_live, len(table) - dead + new)
        return most_live <= self.max_blocks_per_request and self.pool.can_allocate(needed)

    def try_allocate(self, request: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """`allocate_slots` when `can_allocate` (for a request that holds blocks or starts from none); None, with
        nothing changed, when it does not fit. A request whose tables already cover `num_tokens` and that writes
        into no shared block (a decode inside its last block: most steps) needs no pool work."""
        tables = self._tables.get(request.request_id)
        if tables is not None and -(-num_tokens // self.block_size) <= len(tables[0]):
            index = request.next_position // self.block_size
            for table in tables:
                if index < len(table) and table[index] != DEAD_BLOCK and self.pool.ref_count(table[index]) != 1:
                    break
            else:
                return []
        if not self.can_allocate(request, num_tokens):
            return None
        return self.allocate_slots(request, num_tokens)

    def allocate_slots(self, request: Request, num_tokens: int) -> list[tuple[int, int]]:
        """Grows `request`'s tables to hold `num_tokens` tokens in all, and gives it its own copy of a shared
        block it is about to write into. Returns the `(src, dst)` block copies to do before the next forward.
        A request started from a `PrefixHit` with a partial block also gets that block copied into its own next
        block, the first time. Precondition: `can_allocate`."""
        if request.request_id not in self._tables:
            self._tables[request.request_id] = [[] for _ in self.windows]
            self._num_dead[request.request_id] = [0] * len(self.windows)
        tables = self._tables[request.request_id]
        copies = []
        for group, index in self._blocks_to_copy(request, tables):
            (new_block,) = self.pool.allocate(1, (request.request_id, group), _live(tables[group][index - 1:index]))
            copies.append((tables[group][index], new_block))
            self.pool.free([tables[group][index]])
            tables[group][index] = new_block
        length = -(-num_tokens // self.block_size)
        growth = max(min(self._expected_blocks(request) - length, MAX_RESERVED_BLOCKS), 0)
        for group, table in enumerate(tables):
            if length > len(table):
                table.extend(self.pool.allocate(length - len(table), (request.request_id, group), _live(table),
                                                growth))
        if partial := self._partial.pop(request.request_id, None):
            index = request.next_position // self.block_size
            copies += [(source, table[index]) for source, table in zip(partial, tables, strict=True)]
        return copies

    def _expected_blocks(self, request: Request) -> int:
        """The blocks `request` holds once it has generated all it may."""
        return -(-(request.num_prompt_tokens + request.params.max_new_tokens) // self.block_size)

    def _blocks_to_copy(self, request: Request, tables: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """(group, index) of the blocks `request` writes into next that others hold too."""
        index = request.next_position // self.block_size
        return [(group, index) for group, table in enumerate(tables)
                if index < len(table) and table[index] != DEAD_BLOCK and self.pool.ref_count(table[index]) > 1]

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` (holding nothing) the blocks of `parent`, shared: n samples of one prompt computed once.
        A shared block either of them writes into later is copied first (see `allocate_slots`)."""
        tables = self._tables[parent.request_id]
        for table in tables:
            self.pool.incref(block_id for block_id in table if block_id != DEAD_BLOCK)
        self._tables[child.request_id] = [list(table) for table in tables]
        self._num_dead[child.request_id] = list(self._num_dead.get(parent.request_id, [0] * len(tables)))
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    # --- prefix caching ----------------------------------------------------------------------------------------

    def cached_prefix(self, request: Request) -> PrefixHit | None:
        """The longest cached prefix of `request`'s tokens, at most `request.max_cached_tokens` long (at least
        one token is left to compute, and no position whose logits score a prompt logprob still to report comes
        from the cache), or None. Every group must have the blocks of the prefix its policy says the first
        query after it can see (all of them for full attention, those in the window for a sliding group)."""
        if not self.enable_caching:
            return None
        hashes = self._hashes(request, request.max_cached_tokens // self.block_size)
        found = [self._lookup(hashes, group) for group in range(len(self.policies))]
        missing = [list(itertools.accumulate((block is None for block in blocks), initial=0)) for blocks in found]
        for length in range(len(hashes), -1, -1):
            firsts = [policy.first_needed_block(length) for policy in self.policies]
            if all(missing[g][length] == missing[g][first] for g, first in enumerate(firsts)):
                hit = PrefixHit(length, tuple(
                    (DEAD_BLOCK,) * first + tuple(found[g][first:length])  # type: ignore[arg-type]
                    for g, first in enumerate(firsts)))
                return self._with_partial(request, hit, hashes)
        return None

    def _with_partial(self, request: Request, hit: PrefixHit, hashes: Sequence[BlockHash]) -> PrefixHit | None:
        """`hit` and the cached block that continues it furthest into the request's next block, if any (None for
        an empty `hit` without one)."""
        start = hit.num_blocks * self.block_size
        query = request.token_ids[start:min(start + self.block_size - 1, request.max_cached_tokens)]
        match = self._tails.longest_match(hashes[hit.num_blocks - 1] if hit.num_blocks else None, query,
                                          self._is_cached) if query else None
        if match is None:
            return hit if hit.num_blocks else None
        blocks = [self.pool.lookup(_group_key(match[0], group)) for group in range(len(self.policies))]
        return PrefixHit(hit.num_blocks, hit.tables, match[1], tuple(blocks))  # type: ignore[arg-type]

    def _is_cached(self, block_hash: BlockHash) -> bool:
        """Whether content `block_hash` is cached in every group."""
        return all(self.pool.lookup(_group_key(block_hash, group)) is not None for group in range(len(self.policies)))

    def _lookup(self, hashes: Sequence[BlockHash], group: int) -> list[int | None]:
        """The cached block of `group` for each of `hashes`, None where it is not cached."""
        return [self.pool.lookup(_group_key(block_hash, group)) for block_hash in hashes]

    def is_being_computed(self, request: Request, num_cached_blocks: int) -> bool:
        """True when the first block `request` would compute is being computed right now by another running
        request: waiting a step or two then shares it instead of computing it twice. Never for a block the
        request may not take from the cache (see `cached_prefix`)."""
        if not self.enable_caching or num_cached_blocks >= request.max_cached_tokens // self.block_size:
            return False
        owner = self._pending.get(self._hashes(request, num_cached_blocks + 1)[num_cached_blocks])
        return owner is not None and owner != request.request_id

    def start_with_prefix(self, request: Request, hit: PrefixHit | None) -> None:
        """Gives `request` (holding nothing yet) the cached blocks of `hit`, and marks the full blocks it will
        compute as pending so that requests with the same prefix wait for them."""
        tables = [list(table) for table in hit.tables] if hit else [[] for _ in self.windows]
        for table in tables:
            for block_id in table:
                if block_id != DEAD_BLOCK:
                    self.pool.take_cached(block_id)
        num_blocks = hit.num_blocks if hit else 0
        self._tables[request.request_id] = tables
        self._num_dead[request.request_id] = [table.count(DEAD_BLOCK) for table in tables]
        self._num_registered[request.request_id] = num_blocks
        if hit and hit.partial_tokens:
            self._partial[request.request_id] = hit.partial_blocks
        if self.enable_caching:
            owned = self._owned.setdefault(request.request_id, [])
            for block_hash in self._hashes(request, request.num_tokens_to_compute // self.block_size)[num_blocks:]:
                if self._pending.setdefault(block_hash, request.request_id) == request.request_id:
                    owned.append(block_hash)

    def cache_computed_blocks(self, request: Request) -> None:
        """Registers the blocks `request` has filled and computed since the last call, in every group."""
        if not self.enable_caching:
            return
        start = self._num_registered.get(request.request_id, 0)
        if request.num_computed_tokens // self.block_size <= start:
            return
        tables = self._tables.get(request.request_id)
        if not tables:
            return
        full = min(request.num_computed_tokens // self.block_size, len(tables[0]))
        if full <= start:
            return
        hashes = self._hashes(request, full)
        size = self.block_size
        for index, block_hash in enumerate(hashes[start:], start):
            for group, table in enumerate(tables):
                if table[index] != DEAD_BLOCK:
                    self.pool.cache(table[index], _group_key(block_hash, group))
            if self._is_cached(block_hash):
                self._tails.add(hashes[index - 1] if index else None, block_hash,
                                request.token_ids[index * size:(index + 1) * size], self._is_cached)
            if self._pending.get(block_hash) == request.request_id:
                del self._pending[block_hash]
        self._num_registered[request.request_id] = full

    def free_unreachable(self, request: Request) -> None:
        """Gives back the blocks of `request` that no future query can see (the next query is at position
        `num_computed_tokens`); their entries become DEAD_BLOCK."""
        if not self.frees_blocks:
            return
        tables = self._tables.get(request.request_id)
        if tables is None:
            return
        num_dead = self._num_dead[request.request_id]
        for group, policy in enumerate(self.policies):
            table = tables[group]
            dead = min(policy.num_unreachable_blocks(request.num_computed_tokens), len(table))
            start = num_dead[group]
            if dead > start:
                self.pool.free(block_id for block_id in reversed(table[start:dead]) if block_id != DEAD_BLOCK)
                table[start:dead] = [DEAD_BLOCK] * (dead - start)
                num_dead[group] = dead

    def reset_prefix_cache(self) -> None:
        """Forgets all cached content: nothing computed so far will be shared again."""
        self.pool.reset_prefix_cache()
        self._pending.clear()
        self._owned.clear()
        self._tails.clear()
        for request_id, tables in self._tables.items():
            self._num_registered[request_id] = len(tables[0])

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
        tables = self._tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._partial.pop(request_id, None)
        self._num_dead.pop(request_id, None)
        for block_hash in self._owned.pop(request_id, ()):
            if self._pending.get(block_hash) == request_id:
                del self._pending[block_hash]
        for group, table in enumerate(tables or ()):
            self.pool.free(block_id for block_id in reversed(table) if block_id != DEAD_BLOCK)
            self.pool.release((request_id, group))

    def check_integrity(self) -> None:
        """The ref count of every block equals the number of tables that hold it; a request's tables have one
        length; the dead entries of a table are its first ones."""
        holders: Counter[int] = Counter()
        for request_id, tables in self._tables.items():
            assert len({len(table) for table in tables}) == 1, f"{request_id}: tables of different lengths"
            for table, num_dead in zip(tables, self._num_dead[request_id], strict=True):
                assert table[:num_dead] == [DEAD_BLOCK] * num_dead and DEAD_BLOCK not in table[num_dead:]
                holders.update(table[num_dead:])
        assert all(block_id < self.pool.num_touched for block_id in holders), "a table holds an untouched block"
        for block_id in range(self.pool.num_touched):
            count = holders[block_id]
            assert self.pool.ref_count(block_id) == count, f"block {block_id}: ref count != {count} holders"
        assert self._partial.keys() <= self._tables.keys(), "a partial block is pending for a request without blocks"
        for owner in self.pool.reserve_owners:
            assert isinstance(owner, tuple) and owner[0] in self._tables, f"{owner} holds a reserve, no blocks"
        self.pool.check_integrity()


def _live(table: Sequence[int]) -> int | None:
    """The last block of `table` if it is live (an allocation hint), else None."""
    return table[-1] if table and table[-1] != DEAD_BLOCK else None


def _group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block of `group`: the same content in another group is another block."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")
