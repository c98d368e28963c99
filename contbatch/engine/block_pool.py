"""`BlockPool`: the ref-counted KV-cache blocks, their free queue and the prefix cache. Pure Python, no tensors."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable

BlockHash = bytes


class BlockPool:
    """Hands out block ids in `[0, num_blocks)`, takes them back, and remembers which full blocks hold which
    content (the prefix cache).

    Invariants (checked by `check_integrity`):
      - every block is either free (ref count 0) or held (ref count >= 1), never both;
      - a free block is in exactly one of the free queue (no content worth keeping) or the evictable set
        (cached content nobody holds);
      - `cached[h] == b` exactly when `block_hash[b] == h`.

    Order: `allocate` takes plain free blocks first, from the front of the free queue, where `free` puts blocks
    back (the most recently freed are reused first, keeping the touched memory close to its peak). Only when no
    plain block is left does it evict cached blocks, least recently used first. Blocks never handed out wait at
    the back of the queue in id order: the ids below `num_touched` are exactly those handed out at least once.
    The untouched ids are that range, not entries of a queue, so creating a pool and checking it cost time in
    the blocks touched, not in `num_blocks` (a small model's cache sized by memory has millions of blocks).

    `touch_limit` is for a cache whose memory is committed as it is first written (a CPU tensor): once
    `num_touched` reaches it, `allocate` evicts a cached block before it touches a new one, so the memory the
    cache holds stops growing at the limit (or at what held blocks need, if more) instead of filling the whole
    pool with cached content, and new blocks stop costing page faults. None: new blocks before evictions, which
    keeps cached content longest where the memory is committed anyway (a GPU).

    `runs` (off by default) keeps each owner's blocks in runs of consecutive ids, so that a request's keys and
    values lie in one stretch of memory (a CPU reads it with far fewer TLB misses): `allocate` with an `owner`
    hands out the owner's reserved blocks first, then a run of free ids right after its block `after` where
    those are free, else the lowest-id free run that fits, and sets the next `reserve` ids of that run aside for
    the owner's later growth. Reserved blocks still count as free: when nothing plain is free they are taken
    (most recent reservation first) before a cached block is evicted, so reserving never changes whether an
    allocation fits. `release` gives an owner's reserve back.
    """

    def __init__(self, num_blocks: int, touch_limit: int | None = None, runs: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if touch_limit is not None and touch_limit < 1:
            raise ValueError(f"touch_limit must be >= 1 or None, got {touch_limit}")
        self.num_blocks = num_blocks
        self.touch_limit = touch_limit
        self.runs = runs
        self.num_touched = 0
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict()
        self._free_map = bytearray(b"\x01") * num_blocks
        self._reserves: dict[Hashable, deque[int]] = {}
        self._num_reserved = 0
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}
        self._block_hash: dict[int, BlockHash] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: freed, untouched, reserved and evictable cached ones."""
        return len(self._free) + self.num_blocks - self.num_touched + len(self._evictable) + self._num_reserved

    @property
    def num_reserved_blocks(self) -> int:
        """Free blocks set aside for their owners' growth (see `runs`)."""
        return self._num_reserved

    @property
    def reserve_owners(self) -> list[Hashable]:
        """The owners holding a reserve (see `runs`)."""
        return list(self._reserves)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def is_whole(self) -> bool:
        """True when no block is held: nothing is in use and nothing leaked."""
        return self.num_free_blocks == self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_order(self) -> list[int]:
        """The plain free blocks in the order `allocate` takes them: the freed ones, most recent first, then the
        untouched ones in id order (reserved and evictable blocks excluded)."""
        return [*self._free, *range(self.num_touched, self.num_blocks)]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int, owner: Hashable | None = None, after: int | None = None,
                 reserve: int = 0) -> list[int]:
        """Takes `num_blocks` free blocks, each with ref count 1 and no cached content. Raises RuntimeError when
        too few are free: callers check `can_allocate` first. `owner`, `after` and `reserve` only matter with
        `runs` on: the owner's reserve is used first, then a run after block `after` (see the class)."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        in_runs = self.runs and owner is not None
        block_ids = self._take_reserved(owner, num_blocks) if in_runs else []
        if in_runs and len(block_ids) < num_blocks:
            need = num_blocks - len(block_ids)
            run = self._find_run(block_ids[-1] if block_ids else after, need, need + max(reserve, 0))
            for block_id in run:
                self._take_free(block_id)
            block_ids.extend(run[:need])
            if len(run) > need:
                self._reserves.setdefault(owner, deque()).extend(run[need:])
                self._num_reserved += len(run) - need
        while len(block_ids) < num_blocks:
            block_ids.append(self._take_one())
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def release(self, owner: Hashable) -> None:
        """Gives `owner`'s reserved blocks back to the front of the free queue. Unknown owners are ignored."""
        reserved = self._reserves.pop(owner, None)
        if reserved:
            self._num_reserved -= len(reserved)
            for block_id in reversed(reserved):
                self._push_free(block_id)

    def _take_one(self) -> int:
        """One block for an allocation: a plain free one, else another owner's reserved one, else an evicted
        cached one (see `_evicts_before_touching` for a touch limit)."""
        if self._free:
            block_id, _ = self._free.popitem(last=False)
            self._free_map[block_id] = 0
            return block_id
        if self.num_touched < self.num_blocks and not self._evicts_before_touching():
            block_id = self.num_touched
            self._take_free(block_id)
            return block_id
        if self._num_reserved:
            owner, reserved = next(reversed(self._reserves.items()))
            block_id = reserved.pop()
            self._num_reserved -= 1
            if not reserved:
                del self._reserves[owner]
            return block_id
        block_id, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_hash.pop(block_id)]
        return block_id

    def _take_reserved(self, owner: Hashable, num_blocks: int) -> list[int]:
        reserved = self._reserves.get(owner)
        if not reserved:
            return []
        taken = [reserved.popleft() for _ in range(min(num_blocks, len(reserved)))]
        self._num_reserved -= len(taken)
        if not reserved:
            del self._reserves[owner]
        return taken

    def _find_run(self, after: int | None, need: int, want: int) -> list[int]:
        """Up to `want` consecutive free ids: right after `after` if at least `need` are free there, else the
        lowest-id free run of `want`, else of `need`; empty if there is none. Stays below the touch limit while
        a cached block could be evicted instead, and takes untouched ids only from the lowest one on."""
        limit = self.num_blocks
        if self.touch_limit is not None and self._evictable:
            limit = min(limit, max(self.num_touched, self.touch_limit))
        if after is not None and after + 1 < limit:
            start, end = after + 1, min(after + 1 + want, limit)
            stop = self._free_map.find(0, start, end)
            if (end if stop < 0 else stop) - start >= need:
                return list(range(start, end if stop < 0 else stop))
        for length in dict.fromkeys((want, need)):
            start = self._free_map.find(b"\x01" * length, 0, limit)
            if start >= 0:
                return list(range(start, start + length))
        return []

    def _take_free(self, block_id: int) -> None:
        """Takes free block `block_id` out of the queue: a freed one, or the lowest untouched one."""
        if block_id < self.num_touched:
            del self._free[block_id]
        elif block_id == self.num_touched:
            self.num_touched += 1
        else:
            raise RuntimeError(f"block {block_id} taken before the untouched block {self.num_touched}")
        self._free_map[block_id] = 0

    def _push_free(self, block_id: int) -> None:
        self._free[block_id] = None
        self._free.move_to_end(block_id, last=False)
        self._free_map[block_id] = 1

    def _evicts_before_touching(self) -> bool:
        """Whether the next block should be an evicted cached one although untouched blocks are left (no freed
        one is): the touch limit is reached and a cached block is evictable."""
        return self.touch_limit is not None and self.num_touched >= self.touch_limit and bool(self._evictable)

    def incref(self, block_ids: Iterable[int]) -> None:
        """Adds a holder to blocks that are already held (block sharing)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] < 1:
                raise RuntimeError(f"block {block_id} is free and cannot be shared")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one holder from each block. A block nobody holds any more becomes evictable if its content is
        cached (most recently used last), else returns to the front of the free queue."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count < 1:
                raise RuntimeError(f"block {block_id} freed more often than it was held")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                if block_id in self._block_hash:
                    self._evictable[block_id] = None
                else:
                    self._push_free(block_id)

    # --- prefix cache -----------------------------------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding content `block_hash`, if cached."""
        return self._cached.get(block_hash)

    def take_cached(self, block_id: int) -> None:
        """Adds a holder to a cached block, taking it out of the evictable set if nobody held it."""
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Records that held block `block_id` is full and holds content `block_hash`. A block whose content is
        already cached elsewhere stays uncached (the first copy serves later requests)."""
        if block_hash not in self._cached and block_id not in self._block_hash:
            self._cached[block_hash] = block_id
            self._block_hash[block_id] = block_hash

    def reset_prefix_cache(self) -> None:
        """Forgets every cached content (e.g. after the weights changed): evictable blocks become plain free
        blocks and held blocks stop being shareable."""
        for block_id in self._evictable:
            self._push_free(block_id)
        self._evictable.clear()
        self._cached.clear()
        self._block_hash.clear()

    def forget_touched(self) -> None:
        """Marks every block untouched again, in id order (the cache's memory was given back). Only with every
        block free and nothing cached: else raises RuntimeError."""
        if not self.is_whole or self._cached:
            raise RuntimeError("forget_touched needs every block free and an empty prefix cache")
        self._free = OrderedDict()
        self._free_map = bytearray(b"\x01") * self.num_blocks
        self._reserves.clear()
        self._num_reserved = 0
        self.num_touched = 0

    def check_integrity(self) -> None:
        """Raises AssertionError if an invariant is broken (a bookkeeping bug, never a user error)."""
        free, touched = set(self._free), self.num_touched
        assert all(block_id < touched for block_id in free), "an untouched block is in the free queue"
        reserved = [block_id for blocks in self._reserves.values() for block_id in blocks]
        assert len(set(reserved)) == len(reserved) == self._num_reserved, "reserve counts disagree"
        assert all(self._reserves.values()), "an owner keeps an empty reserve"
        assert not free & set(self._evictable) and not (free | set(self._evictable)) & set(reserved), \
            "a block is in two of the free queue, the evictable set and a reserve"
        assert all(block_id < touched for block_id in reserved), "an untouched block is reserved"
        assert self._free_map[:touched] == bytearray(int(b in free) for b in range(touched)), "free map disagrees"
        assert self._free_map.find(0, touched) < 0 and not any(self._ref_counts[touched:]), "untouched block used"
        unused_ids = free | set(self._evictable) | set(reserved)
        for block_id, count in enumerate(self._ref_counts[:touched]):
            unused = block_id in unused_ids
            assert count >= 0, f"block {block_id} has ref count {count}"
            assert (count == 0) == unused, f"block {block_id}: ref count {count}, unused={unused}"
        for block_id in self._evictable:
            assert block_id in self._block_hash, f"evictable block {block_id} has no cached content"
        assert all(self._block_hash[b] == h for h, b in self._cached.items()), "cache maps disagree"
        assert len(self._cached) == len(self._block_hash), "cache maps disagree"
