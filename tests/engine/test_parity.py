"""Greedy contbatch equals greedy `model.generate`, token for token, whatever the batch composition."""

from __future__ import annotations

import pytest

from contbatch.engine import attention, cpu_kernels
from contbatch.engine.step_timer import RecordingStepTimer, StepRecord
from contbatch.frontend.output_processor import OutputCollector
from tests.helpers import make_engine, random_prompts, reference_generate, run_engine, tiny_model

# Prompts from 1 token to several blocks; different max_new_tokens per request.
LENGTHS = [1, 2, 5, 9, 16, 17, 31, 40, 64]
MAX_NEW = [12, 3, 9, 1, 14, 6, 10, 2, 7]

CONFIGS = [
    # block size 1, budget that chunks every prefill
    dict(block_size=1, num_blocks=600, max_batch_tokens=5),
    # small blocks, a budget smaller than most prompts, prefill_first
    dict(block_size=4, num_blocks=200, max_batch_tokens=13, scheduler_type="prefill_first"),
    # blocks larger than every prompt, budget large enough for everything at once
    dict(block_size=128, num_blocks=10, max_batch_tokens=4096),
    # more requests than the cache holds at once: preemption and waiting
    dict(block_size=8, num_blocks=14, max_batch_tokens=32),
]
# A block of a hybrid model holds one layer group (half its layers); the longest request needs 9 blocks for the
# full layers and 6 for the sliding ones (window 6 before a 32-token chunk).
TIGHT_HYBRID_BLOCKS = 16


@pytest.mark.parametrize("config", CONFIGS, ids=["bs1-chunk5", "bs4-prefill_first", "bs128-big", "bs8-tight"])
def test_greedy_matches_generate(model_name: str, config: dict) -> None:
    model = tiny_model(model_name)
    own_attention = model.config._attn_implementation
    prompts = random_prompts(LENGTHS, seed=1)
    if config["num_blocks"] == 14 and model_name.startswith("gemma"):
        config = {**config, "num_blocks": TIGHT_HYBRID_BLOCKS}
    with make_engine(model, **config) as engine:
        for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=max_new)
        finished = run_engine(engine)
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        expected = reference_generate(model, prompt, max_new)
        assert finished[f"r{index}"].generated_tokens == expected, f"request r{index} (prompt {len(prompt)} tokens)"
    assert model.config._attn_implementation == own_attention


def test_sdpa_fallback_matches_generate(model_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the CPU decode kernel (no compiler, or a GPU) decoding goes through SDPA on gathered K/V."""
    monkeypatch.setattr(attention, "paged_decode_kernel", lambda: None)
    model = tiny_model(model_name)
    prompts = random_prompts(LENGTHS, seed=5)
    with make_engine(model, block_size=4, num_blocks=300, max_batch_tokens=24) as engine:
        for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=max_new)
        finished = run_engine(engine)
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, max_new), f"r{index}"


def test_decode_kernel_is_built_here() -> None:
    """The CPU kernel builds on this machine (the fallback above must not be what the suite silently tests)."""
    assert cpu_kernels.paged_decode_kernel() is not None


def test_eos_stops_and_is_kept() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([12], seed=3)[0]
    free_run = reference_generate(model, prompt, 10)
    eos = free_run[4]
    with make_engine(model, block_size=4, num_blocks=64) as engine:
        engine.add_request(prompt, request_id="eos", max_new_tokens=10, eos_token_id=[255, eos])
        request = run_engine(engine)["eos"]
    first = free_run.index(eos)
    assert request.generated_tokens == free_run[: first + 1]
    assert request.finish_reason == "stop"


@pytest.mark.parametrize("prefill_while_decoding", [None, 3], ids=["whole-budget", "3-while-decoding"])
def test_requests_added_while_running_match_generate(prefill_while_decoding: int | None) -> None:
    model = tiny_model("qwen3")
    prompts = random_prompts([7, 20, 3, 33], seed=4)
    collector = OutputCollector()
    finished = collector.finished
    with make_engine(model, block_size=4, num_blocks=100, max_batch_tokens=16,
                     max_prefill_tokens_while_decoding=prefill_while_decoding) as engine:
        steps: list[StepRecord] = []
        engine.step_timer = RecordingStepTimer(steps.append)
        engine.add_request(prompts[0], request_id="a", max_new_tokens=12)
        for step in range(40):
            if step == 3:
                engine.add_request(prompts[1], request_id="b", max_new_tokens=8)
            if step == 6:
                engine.add_request(prompts[2], request_id="c", max_new_tokens=5)
                engine.add_request(prompts[3], request_id="d", max_new_tokens=9)
            collector.add(engine.step())
        assert not engine.has_unfinished_requests()
    for rid, prompt, max_new in zip("abcd", prompts, [12, 8, 5, 9], strict=True):
        assert finished[rid].generated_tokens == reference_generate(model, prompt, max_new)
    assert engine.block_pool.is_whole
    mixed = [step.num_prefill_tokens for step in steps if step.num_decode_tokens and step.num_prefill_tokens]
    assert mixed and max(mixed) == (prefill_while_decoding or 16 - 1)
