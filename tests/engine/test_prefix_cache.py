"""Prefix caching: exact block-level bookkeeping, sharing, LRU eviction, parity, and stale weights."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, generate_batch
from contbatch.engine.block_pool import BlockPool
from contbatch.engine.kv_cache_manager import KVCacheManager, PrefixHit, hash_block
from contbatch.engine.request import Request
from contbatch.engine.sampling_params import SamplingParams
from tests.helpers import make_engine, random_prompts, reference_generate, run_engine, tiny_model


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_new_tokens=4))


def test_block_hashes_chain_over_the_whole_prefix() -> None:
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == first
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])


def test_cached_blocks_are_shared_with_exact_ids_and_ref_counts() -> None:
    manager = KVCacheManager(BlockPool(8), block_size=4, enable_caching=True)
    a = make_request("a", list(range(1, 11)))
    manager.start_with_prefix(a, None)
    manager.allocate_slots(a, 10)
    assert manager.block_table("a") == [0, 1, 2]
    a.num_computed_tokens = 10
    manager.cache_computed_blocks(a)
    assert manager.pool.num_cached_blocks == 2
    b = make_request("b", [*range(1, 9), 99, 98, 97])
    hit = manager.cached_prefix(b)
    assert hit == PrefixHit(2, ((0, 1),))
    c = make_request("c", list(range(1, 9)))
    # the last token must be computed: 7 of 8 reused, block 0 shared and 3 tokens of block 1 copied
    assert manager.cached_prefix(c) == PrefixHit(1, ((0,),), partial_tokens=3, partial_blocks=(1,))
    manager.start_with_prefix(b, hit)
    b.num_computed_tokens = 8
    manager.allocate_slots(b, 11)
    assert manager.block_table("b") == [0, 1, 3]
    assert [manager.pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    manager.free("a")
    assert [manager.pool.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    manager.free("b")
    assert manager.pool.is_whole and manager.pool.num_cached_blocks == 2
    manager.check_integrity()


def test_unheld_cached_blocks_are_evicted_least_recently_used_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for block_id in blocks:
        pool.cache(block_id, bytes([block_id]))
    pool.free([2])
    pool.free([0])
    pool.free([3])
    assert list(pool._evictable) == [2, 0, 3]
    pool.take_cached(0)
    pool.free([0])
    assert list(pool._evictable) == [2, 3, 0]
    assert pool.allocate(2) == [2, 3]
    assert pool.lookup(bytes([2])) is None and pool.lookup(bytes([3])) is None and pool.lookup(bytes([0])) == 0
    pool.free([1])
    assert pool.allocate(1) == [0], "block 0 was used less recently than block 1"
    pool.check_integrity()


def test_plain_free_blocks_are_used_before_cached_ones_and_reset_forgets() -> None:
    pool = BlockPool(3)
    held = pool.allocate(2)
    pool.cache(held[0], b"x")
    pool.free(held)
    assert pool.free_order() == [1, 2] and list(pool._evictable) == [0]
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup(b"x") == 0
    pool.reset_prefix_cache()
    assert pool.lookup(b"x") is None and pool.free_order() == [0] and not pool._evictable
    pool.check_integrity()


SYSTEM = random_prompts([37], seed=40)[0]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("model_name", ["llama", "gemma3-hybrid", "deepseek-mla"])
def test_shared_prefix_parity_under_memory_pressure(model_name: str, caching: bool) -> None:
    model = tiny_model(model_name)
    prompts = [SYSTEM + suffix for suffix in random_prompts([3, 9, 1, 14, 6, 11, 2, 8], seed=41)]
    # One request needs at most ceil((51 + 10) / 8) = 8 blocks (Gemma 3: 8 for its full layers, and for its
    # sliding ones a window of 6 before a 24-token chunk, 5 blocks): one block more forces waiting and preemption.
    num_blocks = {"llama": 9, "deepseek-mla": 9, "gemma3-hybrid": 14}[model_name]
    with make_engine(model, block_size=8, num_blocks=num_blocks, max_batch_tokens=24,
                     allow_block_sharing=caching) as engine:
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=10)
        finished = run_engine(engine)
    for index, prompt in enumerate(prompts):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, 10), f"r{index}"
    cached = sum(request.num_cached_tokens for request in finished.values())
    assert (cached > 0) == caching


def test_64_requests_behind_one_system_prompt_compute_it_once() -> None:
    model = tiny_model("qwen3")
    system = random_prompts([200], seed=42)[0]
    suffixes = random_prompts([5 + i % 7 for i in range(64)], seed=43)
    with make_engine(model, block_size=16, num_blocks=400, max_batch_tokens=256) as engine:
        for index, suffix in enumerate(suffixes):
            engine.add_request(system + suffix, request_id=f"r{index}", max_new_tokens=1)
        finished = run_engine(engine)
        computed = engine.num_scheduled_tokens_total
    total_prompt = sum(200 + len(suffix) for suffix in suffixes)
    cached = [finished[f"r{index}"].num_cached_tokens for index in range(64)]
    assert computed == total_prompt - sum(cached)
    assert cached[0] == 0 and min(cached[1:]) >= 200 // 16 * 16, "every later request shares the whole blocks"
    # the prompt's last 8 tokens share a block with each suffix: copied from the first cached such block on
    assert sum(count >= 200 for count in cached) >= 40, cached
    for index in (0, 17, 63):
        prompt = system + suffixes[index]
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, 1)


@pytest.mark.parametrize("update", ["optimizer", "load_state_dict", "data"])
def test_changed_weights_never_reuse_stale_kv(update: str) -> None:
    torch.manual_seed(5)
    from transformers import AutoModelForCausalLM

    from tests.helpers import TINY_CONFIGS

    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"](), attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    prompt = random_prompts([40], seed=44)[0]
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None)
    cb = ContinuousBatchingConfig(block_size=8, num_blocks=64)
    first = generate_batch(model, [prompt], config, cb, progress_bar=False, persistent_manager=True)["req_0"]
    again = generate_batch(model, [prompt], config, cb, progress_bar=False, persistent_manager=True)["req_0"]
    assert again.num_cached_tokens == 39 and again.generated_tokens == first.generated_tokens
    with torch.no_grad():
        if update == "optimizer":
            torch.optim.SGD(model.parameters(), lr=1.0).zero_grad()
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
        elif update == "load_state_dict":
            model.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()})
        else:
            for parameter in model.parameters():
                parameter.data += 0.05 * torch.randn_like(parameter)
    after = generate_batch(model, [prompt], config, cb, progress_bar=False, persistent_manager=True)["req_0"]
    assert after.num_cached_tokens == 0
    assert after.generated_tokens == reference_generate(model, prompt, 6)
    assert after.generated_tokens != first.generated_tokens


def test_explicit_reset_prefix_cache() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([33], seed=45)[0]
    with make_engine(model, block_size=8, num_blocks=64) as engine:
        engine.add_request(prompt, request_id="a", max_new_tokens=2)
        run_engine(engine)
        engine.add_request(prompt, request_id="b", max_new_tokens=2)
        assert run_engine(engine)["b"].num_cached_tokens == 32
        engine.reset_prefix_cache()
        engine.add_request(prompt, request_id="c", max_new_tokens=2)
        assert run_engine(engine)["c"].num_cached_tokens == 0
