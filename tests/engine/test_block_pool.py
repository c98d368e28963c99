"""Block pool and KV-cache manager bookkeeping, with exact block ids and free-queue order."""

from __future__ import annotations

import pytest

from contbatch.engine.block_pool import BlockPool
from contbatch.engine.kv_cache_manager import KVCacheManager
from contbatch.engine.request import Request
from contbatch.engine.sampling_params import SamplingParams


def make_request(request_id: str, num_tokens: int = 4) -> Request:
    return Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_new_tokens=4))


def test_allocate_takes_lowest_ids_in_order() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free_blocks == 1
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    pool.check_integrity()


def test_freed_blocks_are_reused_first_in_table_order() -> None:
    pool = BlockPool(6)
    first, second = pool.allocate(2), pool.allocate(2)
    assert (first, second) == ([0, 1], [2, 3])
    pool.free(reversed(second))
    assert pool.free_order() == [2, 3, 4, 5]
    assert pool.allocate(3) == [2, 3, 4]
    pool.free(reversed(first))
    assert pool.free_order() == [0, 1, 5]
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    assert not pool.can_allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_shared_block_is_freed_by_its_last_holder() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.incref([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1 and block not in pool.free_order()
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.free_order()[0] == block
    assert pool.is_whole


def test_double_free_and_sharing_a_free_block_raise() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])
    with pytest.raises(RuntimeError, match="is free and cannot be shared"):
        pool.incref([block])


def test_integrity_check_catches_a_corrupted_pool() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._free[0] = None
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_untouched_blocks_are_a_range_the_integrity_check_guards() -> None:
    pool = BlockPool(2_000_000)
    held = pool.allocate(3)
    pool.free([held[1]])
    assert pool.num_touched == 3 and pool.num_free_blocks == 2_000_000 - 2
    assert pool.free_order()[:3] == [1, 3, 4] and len(pool.free_order()) == 2_000_000 - 2
    pool.check_integrity()
    pool._free[7] = None
    with pytest.raises(AssertionError, match="untouched block is in the free queue"):
        pool.check_integrity()


def test_manager_grows_tables_by_whole_blocks() -> None:
    manager = KVCacheManager(BlockPool(10), block_size=4)
    a, b = make_request("a"), make_request("b")
    assert manager.allocate_slots(a, 5) == []
    assert manager.block_table("a") == [0, 1]
    manager.allocate_slots(a, 8)
    assert manager.block_table("a") == [0, 1]
    manager.allocate_slots(b, 4)
    manager.allocate_slots(a, 9)
    assert manager.block_table("a") == [0, 1, 3]
    assert manager.block_table("b") == [2]
    manager.check_integrity()
    manager.free("a")
    manager.free("a")
    assert manager.block_table("a") == []
    assert manager.pool.free_order()[:3] == [0, 1, 3]
    manager.free("b")
    assert manager.pool.is_whole
    manager.check_integrity()


def test_manager_respects_max_blocks_per_request() -> None:
    manager = KVCacheManager(BlockPool(10), block_size=4, max_blocks_per_request=2)
    assert manager.can_ever_hold(8, max_chunk=8) and not manager.can_ever_hold(9, max_chunk=8)
    assert manager.can_allocate(make_request("a"), 8)
    assert not manager.can_allocate(make_request("a"), 9)


def test_manager_cannot_allocate_past_the_pool() -> None:
    manager = KVCacheManager(BlockPool(3), block_size=2)
    manager.allocate_slots(make_request("a"), 4)
    assert manager.can_allocate(make_request("b"), 2)
    assert not manager.can_allocate(make_request("b"), 3)


def test_try_allocate_grows_copies_or_refuses_with_exact_blocks() -> None:
    manager = KVCacheManager(BlockPool(4), block_size=4)
    parent, child = make_request("p", 6), make_request("c", 6)
    assert manager.try_allocate(parent, 6) == []
    assert manager.block_table("p") == [0, 1]
    parent.num_computed_tokens = 6
    assert manager.try_allocate(parent, 7) == [] and manager.block_table("p") == [0, 1]  # inside its last block
    manager.fork(parent, child)
    child.num_computed_tokens = 6
    assert manager.try_allocate(child, 7) == [(1, 2)]  # the shared block it writes into is copied first
    assert manager.block_table("c") == [0, 2] and manager.pool.ref_count(1) == 1
    assert manager.try_allocate(child, 9) == [] and manager.block_table("c") == [0, 2, 3]
    assert manager.try_allocate(parent, 9) is None  # no free block left: nothing changes
    assert manager.block_table("p") == [0, 1] and manager.pool.num_free_blocks == 0
    manager.check_integrity()
