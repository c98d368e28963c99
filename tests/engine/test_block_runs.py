"""Block runs: with `runs` on, each request's blocks are consecutive ids (exact ids), reserves stay free blocks."""

from __future__ import annotations

import itertools
import random

import pytest

from contbatch.engine.block_pool import BlockPool
from contbatch.engine.kv_cache_manager import KVCacheManager
from contbatch.engine.request import Request
from contbatch.engine.sampling_params import SamplingParams
from contbatch.frontend.output_processor import OutputCollector
from tests.helpers import make_engine, random_prompts, reference_generate, tiny_model


def is_run(table: list[int]) -> bool:
    return all(later == earlier + 1 for earlier, later in itertools.pairwise(table))


def test_an_owner_grows_into_its_reserve_while_others_start_after_it() -> None:
    pool = BlockPool(12, runs=True)
    assert pool.allocate(2, "a", reserve=2) == [0, 1]
    assert pool.allocate(2, "b", reserve=1) == [4, 5], "the lowest run of 3 free ids: 2 and 3 are a's"
    assert pool.num_reserved_blocks == 3 and pool.num_free_blocks == 8
    assert pool.allocate(1, "a", after=1) == [2]
    assert pool.allocate(2, "a", after=2) == [3, 7], "the reserve, then the lowest free id (4 is held)"
    assert pool.allocate(1, "b", after=5) == [6]
    assert pool.allocate(1, "b", after=6) == [8], "right after b's last block"
    assert pool.reserve_owners == [] and pool.num_free_blocks == 3
    pool.check_integrity()


def test_reserved_blocks_are_free_and_taken_before_a_cached_block_is_evicted() -> None:
    pool = BlockPool(6, runs=True)
    [cached] = pool.allocate(1, "x")
    pool.cache(cached, b"x")
    pool.free([cached])
    assert pool.allocate(1, "a", reserve=4) == [1]
    assert pool.num_free_blocks == 5 and pool.can_allocate(5)
    assert pool.allocate(3, "b") == [5, 4, 3], "a's reserve, from its end"
    assert pool.num_cached_blocks == 1
    assert pool.allocate(2, "c") == [2, 0], "the last reserved block, then the cached one"
    assert pool.num_cached_blocks == 0 and pool.reserve_owners == [] and pool.num_free_blocks == 0
    pool.check_integrity()


def test_release_gives_the_reserve_back_in_id_order() -> None:
    pool = BlockPool(8, runs=True)
    held = pool.allocate(2, "a", reserve=3)
    assert held == [0, 1] and pool.num_touched == 5
    pool.release("a")
    pool.release("a")
    pool.free(reversed(held))
    assert pool.free_order() == list(range(8)) and pool.is_whole and pool.num_reserved_blocks == 0
    pool.check_integrity()


def test_runs_stay_below_the_touch_limit_while_a_cached_block_can_be_evicted() -> None:
    pool = BlockPool(8, touch_limit=3, runs=True)
    cached = pool.allocate(2, "x")
    for block_id in cached:
        pool.cache(block_id, bytes([block_id]))
    pool.free(cached)
    assert pool.allocate(2, "a", reserve=2) == [2, 0], "no run fits below the limit: block 2, then an eviction"
    assert pool.num_touched == 3 and pool.num_reserved_blocks == 0
    pool.check_integrity()


def test_without_runs_owners_and_hints_change_nothing() -> None:
    pool = BlockPool(6)
    first = pool.allocate(2, "a")
    pool.allocate(1, "b")
    pool.free(reversed(first))
    assert pool.allocate(3, "a", after=2, reserve=3) == [0, 1, 3]
    assert pool.num_reserved_blocks == 0
    pool.check_integrity()


@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("touch_limit", [None, 10])
def test_random_traffic_keeps_every_invariant(runs: bool, touch_limit: int | None) -> None:
    rng = random.Random(f"{runs}-{touch_limit}")
    pool = BlockPool(24, touch_limit=touch_limit, runs=runs)
    tables: dict[str, list[int]] = {}
    for step in range(400):
        owner = f"r{rng.randrange(8)}"
        action = rng.random()
        if action < 0.55:
            count = rng.randint(1, 3)
            if pool.can_allocate(count):
                table = tables.setdefault(owner, [])
                new = pool.allocate(count, owner, table[-1] if table else None, rng.randint(0, 4))
                assert len(set(new)) == count and not set(new) & {b for t in tables.values() for b in t}
                table.extend(new)
        elif action < 0.7 and tables.get(owner):
            block_id = tables[owner][-1]
            pool.cache(block_id, f"{owner}-{step}".encode())
        else:
            pool.free(reversed(tables.pop(owner, [])))
            pool.release(owner)
        pool.check_integrity()
        held = sum(len(table) for table in tables.values())
        assert pool.num_free_blocks == pool.num_blocks - held
    for owner, table in tables.items():
        pool.free(table)
        pool.release(owner)
    assert pool.is_whole and pool.num_reserved_blocks == 0


def make_request(request_id: str, num_tokens: int, max_new_tokens: int) -> Request:
    return Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_new_tokens=max_new_tokens))


def test_interleaved_decoding_requests_each_hold_one_run() -> None:
    manager = KVCacheManager(BlockPool(64, runs=True), block_size=4)
    requests = [make_request(name, 6, 8) for name in "abc"]
    for request in requests:
        manager.allocate_slots(request, 6)
    for num_tokens in range(7, 15):
        for request in requests:
            manager.allocate_slots(request, num_tokens)
    assert [manager.block_table(name) for name in "abc"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert manager.pool.num_reserved_blocks == 0
    short = make_request("d", 6, 30)
    manager.allocate_slots(short, 6)
    assert manager.block_table("d") == [12, 13] and manager.pool.num_reserved_blocks == 7
    manager.check_integrity()
    for name in "abcd":
        manager.free(name)
    assert manager.pool.is_whole and manager.pool.reserve_owners == []
    manager.check_integrity()


def test_an_engine_keeps_each_request_in_one_run_with_generate_outputs() -> None:
    model = tiny_model("llama", "cpu")
    with make_engine(model, block_size=4, num_blocks=96) as engine:
        for wave, lengths in enumerate(([9, 17, 5, 12], [21, 3, 14, 8, 10])):
            prompts = random_prompts(lengths, seed=wave)
            ids = [f"{wave}-{index}" for index in range(len(prompts))]
            for request_id, prompt in zip(ids, prompts, strict=True):
                engine.add_request(prompt, request_id, max_new_tokens=9)
            collector = OutputCollector()
            while engine.has_unfinished_requests():
                collector.add(engine.step())
                for request_id in ids:
                    table = engine.kv_manager.block_table(request_id)
                    assert is_run(table), f"{request_id} holds {table}"
            engine.check_integrity()
            assert engine.block_pool.is_whole and engine.block_pool.num_reserved_blocks == 0
            for request_id, prompt in zip(ids, prompts, strict=True):
                assert collector.finished[request_id].generated_tokens == reference_generate(model, prompt, 9)
