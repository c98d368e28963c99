"""A CPU cache's touched memory: past the pool's touch limit, cached blocks are evicted before new ones are touched."""

from __future__ import annotations

import pytest

from contbatch.engine.block_pool import BlockPool
from contbatch.engine.kv_cache import RESIDENT_GIB_ENV, resident_block_limit
from tests.helpers import make_engine, random_prompts, reference_generate, run_engine, tiny_model


def cached_and_freed(pool: BlockPool, count: int) -> list[int]:
    blocks = pool.allocate(count)
    for block_id in blocks:
        pool.cache(block_id, bytes([block_id]))
    pool.free(blocks)
    return blocks


def test_past_the_limit_cached_blocks_are_evicted_before_new_ones_are_touched() -> None:
    pool = BlockPool(6, touch_limit=3)
    assert cached_and_freed(pool, 3) == [0, 1, 2]
    assert pool.num_touched == 3
    assert pool.allocate(2) == [0, 1], "least recently used cached blocks, not untouched blocks 3 and 4"
    assert pool.num_cached_blocks == 1 and pool.num_touched == 3
    assert pool.allocate(2) == [2, 3], "the last cached block, then a new one once nothing is evictable"
    assert pool.num_touched == 4
    pool.check_integrity()


def test_without_a_limit_new_blocks_come_before_evictions() -> None:
    pool = BlockPool(6)
    cached_and_freed(pool, 3)
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.num_cached_blocks == 3
    assert pool.allocate(1) == [0]
    pool.check_integrity()


def test_touched_plain_blocks_come_before_evictions_under_a_limit() -> None:
    pool = BlockPool(6, touch_limit=2)
    cached_and_freed(pool, 1)
    plain = pool.allocate(1)
    pool.free(plain)
    assert pool.allocate(2) == [1, 0], "the plain free block first, then the cached one, not block 2"
    assert pool.num_touched == 2
    pool.check_integrity()


def test_forget_touched_hands_out_ids_from_zero_again() -> None:
    pool = BlockPool(4, touch_limit=2)
    held = pool.allocate(3)
    with pytest.raises(RuntimeError, match="every block free"):
        pool.forget_touched()
    pool.free(held)
    pool.forget_touched()
    assert pool.num_touched == 0 and pool.allocate(2) == [0, 1]
    pool.check_integrity()


def test_an_engine_on_cpu_stays_within_its_touch_limit_with_generate_outputs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama", "cpu")
    monkeypatch.setenv(RESIDENT_GIB_ENV, "0.000001")
    with make_engine(model, block_size=4, num_blocks=64) as engine:
        limit = engine.block_pool.touch_limit
        assert limit is not None and 1 <= limit < 8
        for wave in range(4):
            prompts = random_prompts([9, 13, 6], seed=wave)
            for index, prompt in enumerate(prompts):
                engine.add_request(prompt, f"{wave}-{index}", max_new_tokens=6)
            finished = run_engine(engine)
            for index, prompt in enumerate(prompts):
                assert finished[f"{wave}-{index}"].generated_tokens == reference_generate(model, prompt, 6)
        assert engine.block_pool.num_touched == 4 + 5 + 3, "the blocks one wave holds at once (39 without a limit)"
        again = random_prompts([9, 13, 6], seed=3)[0]
        engine.add_request(again, "again", max_new_tokens=6)
        assert run_engine(engine)["again"].num_cached_tokens > 0, "the latest wave's prefixes are still cached"


def test_the_limit_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with make_engine(tiny_model("llama", "cpu"), block_size=4, num_blocks=8) as engine:
        cache = engine.cache
    block_bytes = cache.nbytes // 9
    monkeypatch.setenv(RESIDENT_GIB_ENV, str(3 * block_bytes / 2**30))
    assert resident_block_limit(cache) == 3
    monkeypatch.delenv(RESIDENT_GIB_ENV)
    assert resident_block_limit(cache) == 4 * 2**30 // block_bytes
    for bad in ("lots", "0", "-1", "inf"):
        monkeypatch.setenv(RESIDENT_GIB_ENV, bad)
        with pytest.raises(ValueError, match=repr(bad)):
            resident_block_limit(cache)


def test_sleep_gives_the_memory_back_so_every_block_is_untouched_again() -> None:
    model = tiny_model("llama", "cpu")
    prompt = random_prompts([11], seed=7)[0]
    with make_engine(model, block_size=4, num_blocks=16) as engine:
        engine.add_request(prompt, "a", max_new_tokens=5)
        run_engine(engine)
        assert engine.block_pool.num_touched == 4
        assert engine.stats().num_touched_blocks == 4
        engine.sleep()
        assert engine.block_pool.num_touched == 0 and engine.stats().num_touched_blocks == 0
        engine.add_request(prompt, "b", max_new_tokens=5)
        assert run_engine(engine)["b"].generated_tokens == reference_generate(model, prompt, 5)
        assert engine.block_pool.num_touched == 4
        engine.block_pool.check_integrity()
