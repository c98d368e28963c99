"""n samples per prompt: one prefill, the prompt's blocks shared, copy-on-write of the partial block."""

from __future__ import annotations

from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch
from contbatch.engine.block_pool import BlockPool
from contbatch.engine.kv_cache_manager import KVCacheManager
from contbatch.engine.request import Request, RequestStatus
from contbatch.engine.sampling_params import SamplingParams
from contbatch.frontend.output_processor import OutputCollector
from tests.helpers import add_samples, make_engine, random_prompts, reference_generate, run_engine, tiny_model


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_new_tokens=4))


def test_fork_shares_blocks_and_copies_the_partial_block_on_write() -> None:
    manager = KVCacheManager(BlockPool(8), block_size=4, enable_caching=True)
    leader, follower = make_request("p_0", list(range(1, 7))), make_request("p_1", list(range(1, 7)))
    manager.start_with_prefix(leader, None)
    manager.allocate_slots(leader, 6)
    leader.num_computed_tokens = 6
    manager.cache_computed_blocks(leader)
    manager.fork(leader, follower)
    assert manager.block_table("p_1") == [0, 1]
    assert [manager.pool.ref_count(i) for i in range(3)] == [2, 2, 0]
    follower.num_computed_tokens = 6
    for request, token in ((follower, 7), (leader, 8)):
        request.token_ids.append(token)
    assert manager.can_allocate(follower, 7)
    assert manager.allocate_slots(follower, 7) == [(1, 2)], "the shared partial block is copied before a write"
    assert manager.block_table("p_1") == [0, 2]
    assert manager.allocate_slots(leader, 7) == [], "the last holder writes in place"
    assert [manager.pool.ref_count(i) for i in range(3)] == [2, 1, 1]
    manager.check_integrity()
    manager.free("p_0")
    manager.free("p_1")
    assert manager.pool.is_whole and manager.pool.num_cached_blocks == 1


def test_n_samples_compute_the_prompt_once_and_match_generate() -> None:
    model = tiny_model("llama")
    prompts = random_prompts([10, 13], seed=60)  # partial last blocks of 2 and 1 tokens
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=32) as engine:
        ids = [add_samples(engine, prompt, f"p{i}", 4, max_new_tokens=6, do_sample=True, top_k=1)
               for i, prompt in enumerate(prompts)]
        finished = run_engine(engine)
        # each prompt once, then 5 more tokens per sample
        assert engine.num_scheduled_tokens_total == 10 + 13 + 2 * 4 * 5
    for prompt, sample_ids in zip(prompts, ids, strict=True):
        for request_id in sample_ids:
            assert finished[request_id].generated_tokens == reference_generate(model, prompt, 6), request_id
        assert [finished[rid].num_cached_tokens for rid in sample_ids] == [0] + [len(prompt)] * 3


def test_n_samples_under_memory_pressure_match_generate() -> None:
    model = tiny_model("qwen3")
    prompt = random_prompts([11], seed=61)[0]
    # 8 samples of 11 + 12 tokens need 6 blocks each once they diverge; 14 blocks force preemption
    with make_engine(model, block_size=4, num_blocks=14, max_batch_tokens=16) as engine:
        ids = add_samples(engine, prompt, "p", 8, max_new_tokens=12, do_sample=True, top_k=1)
        finished = run_engine(engine)
    for request_id in ids:
        assert finished[request_id].generated_tokens == reference_generate(model, prompt, 12), request_id


def test_followers_of_a_cancelled_leader_still_run() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([9], seed=62)[0]
    with make_engine(model, block_size=4, num_blocks=64) as engine:
        ids = add_samples(engine, prompt, "p", 3, max_new_tokens=5, do_sample=True, top_k=1)
        assert engine.cancel_request("p_0").status == RequestStatus.CANCELLED
        finished = run_engine(engine)
        assert engine.num_scheduled_tokens_total == 9 + 2 * 4, "p_1 leads p_2 in p_0's place"
    assert sorted(finished) == ids[1:]
    for request_id in ids[1:]:
        assert finished[request_id].generated_tokens == reference_generate(model, prompt, 5)


def test_n_samples_differ_and_reproduce_with_a_seed() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([37], seed=46)[0]
    config = GenerationConfig(do_sample=True, temperature=1.5, max_new_tokens=8, eos_token_id=None)
    cb = ContinuousBatchingConfig(block_size=8, num_blocks=64)
    runs = []
    for _ in range(2):
        manager = ContinuousBatchingManager(model, config, cb)
        assert manager.add_request(prompt, "p", n=4, seed=100) == "p"
        manager.start()
        runs.append({f"p_{j}": manager.get_result(f"p_{j}", timeout=30) for j in range(4)})
        manager.stop()
    first = runs[0]
    assert sorted(o.num_cached_tokens for o in first.values()) == [0, 37, 37, 37], "one prefill, shared"
    assert len({tuple(o.generated_tokens) for o in first.values()}) > 1
    assert {k: o.generated_tokens for k, o in first.items()} == {k: o.generated_tokens for k, o in runs[1].items()}


def test_generate_batch_num_return_sequences_ids_and_greedy_parity() -> None:
    model = tiny_model("gemma3-hybrid")
    prompts = random_prompts([19, 4], seed=47)
    # transformers refuses greedy with num_return_sequences > 1: top_k=1 sampling is greedy by another name.
    config = GenerationConfig(do_sample=True, top_k=1, max_new_tokens=5, num_return_sequences=3, eos_token_id=None)
    outputs = generate_batch(model, prompts, config, ContinuousBatchingConfig(block_size=4, num_blocks=64),
                             progress_bar=False)
    assert list(outputs) == [f"req_{i}_{j}" for i in range(2) for j in range(3)]
    for i, prompt in enumerate(prompts):
        for j in range(3):
            assert outputs[f"req_{i}_{j}"].generated_tokens == reference_generate(model, prompt, 5)
    assert [outputs[f"req_0_{j}"].num_cached_tokens for j in range(3)] == [0, 19, 19]


def test_samples_prefixes_preemption_and_cancels_together_keep_the_cache_whole() -> None:
    """Hybrid layers, shared prefixes, n samples, a tight cache and cancellations in one run: the cache
    bookkeeping holds after every step and every request that was not cancelled matches generate."""
    model = tiny_model("gemma3-hybrid")
    system = random_prompts([10], seed=63)[0]
    prompts = [system + suffix for suffix in random_prompts([3, 6, 1, 9, 4, 7], seed=64)]
    expected = [reference_generate(model, prompt, 10) for prompt in prompts]
    with make_engine(model, block_size=4, num_blocks=24, max_batch_tokens=16) as engine:
        samples = {i: add_samples(engine, prompt, f"p{i}", 1 + i % 3, max_new_tokens=10, do_sample=True, top_k=1)
                   for i, prompt in enumerate(prompts)}
        cancel_at = {2: "p1_0", 5: "p4_1", 9: "p5_2"}
        collector = OutputCollector()
        finished = collector.finished
        computed: dict[str, int] = {}
        preempted = set()
        step = 0
        while engine.has_unfinished_requests():
            if step in cancel_at:
                assert engine.cancel_request(cancel_at[step]) is not None, cancel_at[step]
            collector.add(engine.step())
            engine.check_integrity()
            for request_id, request in engine.requests.items():
                if request.num_computed_tokens < computed.get(request_id, 0):
                    preempted.add(request_id)
                computed[request_id] = request.num_computed_tokens
            step += 1
        assert engine.block_pool.is_whole
        assert preempted, "the cache is meant to be too small for everything at once"
    for i, sample_ids in samples.items():
        for request_id in sample_ids:
            if request_id not in cancel_at.values():
                assert finished[request_id].generated_tokens == expected[i], request_id
