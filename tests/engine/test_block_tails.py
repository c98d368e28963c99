"""Prefix caching inside a block: the tails index, the manager's exact block ids and copies, and parity."""

from __future__ import annotations

import pytest

from contbatch.engine.block_pool import BlockPool
from contbatch.engine.block_tails import MIN_SWEEP, BlockTails
from contbatch.engine.kv_cache_manager import KVCacheManager, PrefixHit
from contbatch.engine.request import Request
from contbatch.engine.sampling_params import SamplingParams
from tests.helpers import make_engine, random_prompts, reference_generate, run_engine, tiny_model


def make_request(request_id: str, token_ids: list[int], max_new_tokens: int = 4) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_new_tokens=max_new_tokens))


def test_longest_match_takes_the_longest_common_run_of_a_live_block() -> None:
    tails = BlockTails()
    alive = {b"a", b"b", b"c"}
    tails.add(b"p", b"a", (1, 2, 3, 4), alive.__contains__)
    tails.add(b"p", b"b", (1, 2, 7, 8), alive.__contains__)
    tails.add(b"p", b"c", (5, 6, 7, 8), alive.__contains__)
    tails.add(None, b"a", (1, 2, 3, 4), alive.__contains__)
    assert tails.longest_match(b"p", (1, 2, 7), alive.__contains__) == (b"b", 3)
    assert tails.longest_match(b"p", (1, 2, 3), alive.__contains__) == (b"a", 3)
    assert tails.longest_match(b"p", (1, 9), alive.__contains__) in {(b"a", 1), (b"b", 1)}
    assert tails.longest_match(b"p", (9,), alive.__contains__) is None
    assert tails.longest_match(b"q", (1,), alive.__contains__) is None
    alive.discard(b"b")
    assert tails.longest_match(b"p", (1, 2, 7), alive.__contains__) == (b"a", 2), "a gone block is skipped"
    assert len(tails) == 3, "and forgotten"
    alive.clear()
    assert tails.longest_match(b"p", (1,), alive.__contains__) is None
    assert len(tails) == 2, "blocks that do not match stay until a sweep"


def test_the_index_sweeps_gone_blocks_so_it_stays_near_the_cache_size() -> None:
    tails = BlockTails()
    alive: set[bytes] = set()
    for index in range(3 * MIN_SWEEP):
        block_hash = index.to_bytes(4, "little")
        alive = {block_hash}
        tails.add(None, block_hash, (index, 0), alive.__contains__)
    assert len(tails) <= MIN_SWEEP + 1
    assert tails.longest_match(None, (3 * MIN_SWEEP - 1,), alive.__contains__) == (alive.pop(), 1)


def test_a_prefix_that_ends_inside_a_block_copies_the_cached_block_with_exact_ids() -> None:
    manager = KVCacheManager(BlockPool(8), block_size=4, enable_caching=True)
    a = make_request("a", list(range(1, 11)))
    manager.start_with_prefix(a, None)
    assert manager.allocate_slots(a, 10) == []
    a.num_computed_tokens = 10
    manager.cache_computed_blocks(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 99, 98])
    hit = manager.cached_prefix(b)
    assert hit == PrefixHit(1, ((0,),), partial_tokens=2, partial_blocks=(1,))
    assert manager.can_allocate(b, 8, hit)
    manager.start_with_prefix(b, hit)
    b.num_computed_tokens = 6
    assert manager.allocate_slots(b, 8) == [(1, 3)], "block 1's keys and values copied into b's own block 3"
    assert manager.block_table("b") == [0, 3]
    assert [manager.pool.ref_count(i) for i in range(4)] == [2, 1, 1, 1]
    c = make_request("c", list(range(1, 9)))
    assert manager.cached_prefix(c) == PrefixHit(1, ((0,),), 3, (1,)), "the last token is computed: 7 of 8"
    manager.free("a")
    manager.free("b")
    manager.check_integrity()
    assert manager.pool.is_whole


def test_a_prompt_sharing_only_part_of_a_first_block_copies_it() -> None:
    manager = KVCacheManager(BlockPool(4), block_size=4, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    manager.start_with_prefix(a, None)
    manager.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    manager.cache_computed_blocks(a)
    manager.free("a")
    b = make_request("b", [1, 2, 9, 9])
    hit = manager.cached_prefix(b)
    assert hit == PrefixHit(0, ((),), 2, (0,))
    manager.start_with_prefix(b, hit)
    b.num_computed_tokens = 2
    assert manager.allocate_slots(b, 4) == [(0, 1)], "a's freed block 1 is the first plain free block"
    assert [manager.pool.ref_count(i) for i in range(2)] == [0, 1]
    assert manager.pool.lookup(manager._hashes(a, 1)[0]) == 0, "the copied block stays cached, unheld"
    manager.free("b")
    manager.check_integrity()
    assert manager.pool.is_whole


def test_no_partial_hit_from_an_evicted_block_or_without_caching() -> None:
    manager = KVCacheManager(BlockPool(3), block_size=4, enable_caching=True)
    a = make_request("a", list(range(1, 9)))
    manager.start_with_prefix(a, None)
    manager.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    manager.cache_computed_blocks(a)
    manager.free("a")
    taken = manager.pool.allocate(2)  # the plain block, then the least recently used cached one: block 1
    assert taken == [2, 1]
    assert manager.cached_prefix(make_request("b", [1, 2, 3, 4, 5, 6])) == PrefixHit(1, ((0,),))
    manager.pool.free(taken)
    plain = KVCacheManager(BlockPool(8), block_size=4, enable_caching=False)
    assert plain.cached_prefix(make_request("c", [1, 2, 3, 4, 5, 6])) is None


def test_a_sliding_group_copies_its_own_partial_block() -> None:
    manager = KVCacheManager(BlockPool(16), block_size=4, enable_caching=True, windows=(None, 6))
    a = make_request("a", list(range(1, 14)))
    manager.start_with_prefix(a, None)
    manager.allocate_slots(a, 13)
    assert manager.block_tables("a") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    a.num_computed_tokens = 13
    manager.cache_computed_blocks(a)
    manager.free_unreachable(a)
    b = make_request("b", [*range(1, 11), 77, 78])
    hit = manager.cached_prefix(b)  # 8 tokens in whole blocks, 2 of block 2; the query at 10 sees keys 5..10
    assert hit == PrefixHit(2, ((0, 1), (4, 5)), 2, (2, 6))
    manager.start_with_prefix(b, hit)
    b.num_computed_tokens = 10
    assert manager.allocate_slots(b, 12) == [(2, 8), (6, 9)]
    assert manager.block_tables("b") == [[0, 1, 8], [4, 5, 9]]
    manager.free("a")
    manager.free("b")
    manager.check_integrity()
    assert manager.pool.is_whole


SYSTEM = random_prompts([21], seed=60)[0]


@pytest.mark.parametrize("model_name", ["llama", "gemma3-hybrid", "deepseek-mla"])
def test_prompts_sharing_part_of_a_block_match_generate(model_name: str) -> None:
    model = tiny_model(model_name)
    suffixes = random_prompts([3, 9, 1, 14, 6, 11, 2, 8], seed=61)
    prompts = [SYSTEM + suffix for suffix in suffixes] + [SYSTEM + suffixes[3][:5]]
    with make_engine(model, block_size=8, num_blocks=64, max_batch_tokens=32) as engine:
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=6)
        finished = run_engine(engine)
        computed = engine.num_scheduled_tokens_total
        engine.check_integrity()
        assert engine.block_pool.is_whole
    for index, prompt in enumerate(prompts):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, 6), f"r{index}"
    cached = [finished[f"r{index}"].num_cached_tokens for index in range(len(prompts))]
    assert all(count % 8 for count in cached[1:]), f"every later prompt shares part of a block: {cached}"
    assert cached[-1] == 21 + 5 - 1, "the prompt inside r3's shares all but its last token"
    assert computed == sum(map(len, prompts)) - sum(cached) + sum(6 - 1 for _ in prompts)
