"""Sliding-window layers: layer groups, blocks given back once out of the window (all-sliding and hybrid models),
and prefix caching over sliding groups."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig

from contbatch.engine.attention_groups import key_layout as _key_layout
from contbatch.engine.block_pool import BlockPool
from contbatch.engine.kv_cache import KVCacheGroup, kv_cache_groups
from contbatch.engine.kv_cache_manager import DEAD_BLOCK, KVCacheManager, PrefixHit
from contbatch.engine.request import Request, RequestStatus
from contbatch.engine.sampling_params import SamplingParams
from contbatch.frontend.output_processor import OutputCollector
from tests.helpers import _COMMON, make_engine, random_prompts, reference_generate, run_engine, tiny_model


def test_layer_groups_by_attention_kind() -> None:
    assert kv_cache_groups(LlamaConfig(num_hidden_layers=3)) == [KVCacheGroup((0, 1, 2), None)]
    assert kv_cache_groups(MistralConfig(num_hidden_layers=2, sliding_window=7)) == [KVCacheGroup((0, 1), 7)]
    pattern = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    gemma3 = Gemma3TextConfig(num_hidden_layers=12, sliding_window=6, layer_types=pattern)
    assert kv_cache_groups(gemma3) == [
        KVCacheGroup((5, 11), None),
        KVCacheGroup((0, 1), 6), KVCacheGroup((2, 3), 6), KVCacheGroup((4, 6), 6),
        KVCacheGroup((7, 8), 6), KVCacheGroup((9, 10), 6),
    ]


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_new_tokens=4))


def test_sliding_group_prefix_hit_needs_only_the_window() -> None:
    manager = KVCacheManager(BlockPool(16), block_size=4, enable_caching=True, windows=(None, 6))
    a = make_request("a", list(range(1, 18)))
    manager.start_with_prefix(a, None)
    manager.allocate_slots(a, 17)
    assert manager.block_tables("a") == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    a.num_computed_tokens = 17
    manager.cache_computed_blocks(a)
    manager.free_unreachable(a)  # the next query (position 17) sees keys 12..17: blocks 3 and 4
    assert manager.block_table("a", 1) == [DEAD_BLOCK] * 3 + [8, 9]
    assert list(manager.pool._evictable) == [7, 6, 5], "cached blocks out of the window stay cached"

    b = make_request("b", [*range(1, 17), 99])
    hit = manager.cached_prefix(b)  # 16 tokens reused: the next query (position 16) sees keys 11..16
    assert hit == PrefixHit(4, ((0, 1, 2, 3), (DEAD_BLOCK, DEAD_BLOCK, 7, 8)))
    manager.start_with_prefix(b, hit)
    assert [manager.pool.ref_count(i) for i in range(10)] == [2, 2, 2, 2, 1, 0, 0, 1, 2, 1]

    taken = manager.pool.allocate(7)  # 6 plain free blocks, then the least recently used cached one: block 6
    assert taken == [10, 11, 12, 13, 14, 15, 6]
    c = make_request("c", [*range(1, 13), 50, 51])
    # 3 blocks would need sliding blocks 1 (evicted) and 2; 2 blocks need 0 and 1; 1 block needs block 0 only
    assert manager.cached_prefix(c) == PrefixHit(1, ((0,), (5,)))
    manager.pool.free(taken)
    manager.free("a")
    manager.free("b")
    manager.check_integrity()
    assert manager.pool.is_whole


@pytest.mark.parametrize("caching", [True, False])
def test_all_sliding_model_holds_a_window_of_blocks(caching: bool) -> None:
    model = tiny_model("mistral-sliding")  # every layer slides, window 7
    prompts = random_prompts([10, 10], seed=48)
    prompts[1] = prompts[0][:8] + prompts[1][8:]
    live_most = 0
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=16, allow_block_sharing=caching) as engine:
        assert engine.kv_manager.windows == (7,)
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=80)
        collector = OutputCollector()
        finished = collector.finished
        while engine.has_unfinished_requests():
            collector.add(engine.step())
            for request_id in engine.requests:
                table = engine.kv_manager.block_table(request_id)
                live_most = max(live_most, sum(block_id >= 0 for block_id in table))
        engine.check_integrity()
        assert engine.block_pool.is_whole
    # positions [p - 6, p] span at most 3 blocks of 4; without the window a request would end with 23 blocks
    assert live_most <= 3
    for index, prompt in enumerate(prompts):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, 80)


@pytest.mark.parametrize("model_name", ["gemma3-hybrid", "gemma2-softcap"])
@pytest.mark.parametrize("caching", [True, False])
def test_hybrid_model_sliding_layers_hold_a_window_of_blocks(model_name: str, caching: bool) -> None:
    model = tiny_model(model_name)  # half the layers slide (window 6), half attend to everything
    prompts = random_prompts([9, 14, 5], seed=50)
    prompts[1] = prompts[0][:8] + prompts[1][8:]
    expected = [reference_generate(model, prompt, 90) for prompt in prompts]
    # Full KV in both groups would need 2 * 26 blocks for the longest request; its sliding group needs 4.
    with make_engine(model, block_size=4, num_blocks=40, max_batch_tokens=8, allow_block_sharing=caching) as engine:
        assert engine.kv_manager.windows == (None, 6)
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=90)
        collector = OutputCollector()
        finished = collector.finished
        live_most = {0: 0, 1: 0}
        while engine.has_unfinished_requests():
            collector.add(engine.step())
            for request_id in engine.requests:
                for group in live_most:
                    live = sum(block_id >= 0 for block_id in engine.kv_manager.block_table(request_id, group))
                    live_most[group] = max(live_most[group], live)
        engine.check_integrity()
        assert engine.block_pool.is_whole
    assert live_most[1] <= 4, "keys [p - 5, p + 7] of an 8-token chunk span at most 4 blocks of 4"
    assert live_most[0] >= 25
    for index in range(len(prompts)):
        assert finished[f"r{index}"].generated_tokens == expected[index], f"r{index}"


def test_all_sliding_model_accepts_generations_longer_than_the_cache() -> None:
    model = tiny_model("mistral-sliding")
    prompt = random_prompts([10], seed=49)[0]
    expected = reference_generate(model, prompt, 120)
    with make_engine(model, block_size=4, num_blocks=8, max_batch_tokens=16) as engine:
        engine.add_request(prompt, request_id="long", max_new_tokens=120)  # 129 tokens, a 32-slot cache
        assert run_engine(engine)["long"].generated_tokens == expected
    with (make_engine(tiny_model("llama"), block_size=4, num_blocks=8, max_batch_tokens=16) as engine,
          pytest.raises(ValueError, match="more than the cache can ever hold")):
        engine.add_request(prompt, request_id="long", max_new_tokens=120)


@pytest.mark.parametrize("caching", [True, False])
def test_uneven_hybrid_layer_groups_match_generate(caching: bool) -> None:
    """Seven layers, two of them full: groups (3, 6), (0, 1), (2, 4) and a padded (5,), in one pool."""
    layer_types = ["full_attention" if layer in (3, 6) else "sliding_attention" for layer in range(7)]
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(Gemma3TextConfig(
        num_hidden_layers=7, head_dim=16, sliding_window=5, layer_types=layer_types, **_COMMON
    ), attn_implementation="sdpa").eval()
    prompts = random_prompts([23, 9, 30], seed=51)
    prompts[2] = prompts[0][:20] + prompts[2][20:]
    expected = [reference_generate(model, prompt, 20) for prompt in prompts]
    with make_engine(model, block_size=4, num_blocks=60, max_batch_tokens=12, allow_block_sharing=caching) as engine:
        assert [len(group.layers) for group in engine.cache.groups] == [2, 2, 2, 1]
        assert engine.kv_manager.windows == (None, 5, 5, 5)
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=20)
        finished = run_engine(engine)
    for index in range(len(prompts)):
        assert finished[f"r{index}"].generated_tokens == expected[index], f"r{index}"
    assert (finished["r2"].num_cached_tokens == 20) == caching


def test_sliding_layers_read_only_their_window_of_keys() -> None:
    starts, counts = torch.tensor([3, 20]), torch.tensor([1, 5])
    full, full_positions = _key_layout(starts, counts, None)
    assert full.first is None and full.length == 25 and full_positions[0, :6].tolist() == [0, 1, 2, 3, 3, 3]
    window, positions = _key_layout(starts, counts, 6)
    assert window.first.tolist() == [0, 15] and window.length == 10
    assert positions.tolist() == [[0, 1, 2, 3, 3, 3, 3, 3, 3, 3], list(range(15, 25))]
    queries = torch.tensor([[3, 3, 3, 3, 3], [20, 21, 22, 23, 24]])
    mask = window.mask(queries, 6)[:, 0]
    keys = window.first[:, None, None] + torch.arange(10)
    assert torch.equal(mask, (keys <= queries[..., None]) & (keys > queries[..., None] - 6))
    assert mask[0, 0].tolist() == [True] * 4 + [False] * 6, "padding keys are masked"
    short, _ = _key_layout(torch.tensor([0]), torch.tensor([5]), 6)
    assert short.first is None and short.length == 5, "a window that does not shorten the range reads from 0"


def test_a_layer_wider_than_its_cache_window_fails_its_requests_not_silently() -> None:
    from tests.helpers import TINY_CONFIGS

    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["mistral-sliding"](), attn_implementation="sdpa").eval()
    with make_engine(model, block_size=4, num_blocks=16) as engine:
        model.config.sliding_window = None  # the layers now attend to everything; the cache keeps 7 positions
        engine.add_request([5, 6, 7], request_id="r", max_new_tokens=2)
        failed = engine.step()[0]
        engine.check_integrity()
        assert engine.block_pool.is_whole
    assert failed.status == RequestStatus.FAILED and "keeps only the last 7 positions" in failed.error
