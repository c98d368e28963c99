"""Fork as an engine operation: at any point of a request, sharing its blocks copy-on-write. The engines step
synchronously (as on a CPU), so the tests can read a parent's sequence and block tables between steps."""

from __future__ import annotations

import pytest

from contbatch import LLMEngine
from contbatch.engine.request import RequestStatus
from contbatch.frontend.output_processor import OutputCollector
from tests.helpers import make_engine, random_prompts, reference_generate, tiny_model


def step_until(engine: LLMEngine, collector: OutputCollector, request_id: str, num_generated: int) -> None:
    while engine.requests[request_id].num_generated_tokens < num_generated:
        collector.add(engine.step())
        engine.check_integrity()


@pytest.mark.parametrize("model_name", ["llama", "gemma3-hybrid", "mistral-sliding", "deepseek-mla"])
def test_fork_during_decode_shares_blocks_and_continues_exactly(model_name: str) -> None:
    model = tiny_model(model_name)
    prompt = random_prompts([10], seed=80)[0]
    expected = reference_generate(model, prompt, 12)
    with make_engine(model, block_size=4, num_blocks=64, use_async_batching=False) as engine:
        engine.add_request(prompt, request_id="parent", max_new_tokens=12)
        collector = OutputCollector()
        step_until(engine, collector, "parent", 5)
        parent = engine.requests["parent"]
        held = [list(table) for table in engine.kv_manager.block_tables("parent")]
        child = engine.make_request(parent.token_ids, "child", max_new_tokens=7)
        engine.fork("parent", child)
        assert engine.kv_manager.block_tables("child") == held, "the child holds the parent's blocks"
        assert all(engine.block_pool.ref_count(block) == 2 for table in held for block in table if block >= 0)
        before = engine.num_scheduled_tokens_total
        collector.add(engine.step())
        assert engine.num_scheduled_tokens_total - before == 2, "each computes only its newest token"
        while engine.has_unfinished_requests():
            collector.add(engine.step())
            engine.check_integrity()
        assert engine.block_pool.is_whole
    assert collector.finished["parent"].generated_tokens == expected
    assert collector.finished["child"].generated_tokens == expected[5:]
    assert collector.finished["child"].num_cached_tokens == len(prompt) + 4


def test_fork_of_a_preempted_request_recomputes_its_sequence() -> None:
    model = tiny_model("qwen3")
    prompts = random_prompts([3, 8], seed=81)
    with make_engine(model, block_size=4, num_blocks=4, max_batch_tokens=64,
                     use_async_batching=False) as engine:
        engine.add_request(prompts[0], request_id="old", max_new_tokens=6)
        engine.add_request(prompts[1], request_id="new", max_new_tokens=6)
        collector = OutputCollector()
        new = engine.requests["new"]
        while engine.kv_manager.holds("new") or not new.num_generated_tokens:  # until preempted after a token
            collector.add(engine.step())
        assert new.status == RequestStatus.PENDING and not engine.kv_manager.holds("new")
        engine.fork("new", engine.make_request(new.token_ids, "copy", max_new_tokens=6 - new.num_generated_tokens))
        while engine.has_unfinished_requests():
            collector.add(engine.step())
        engine.check_integrity()
        assert engine.block_pool.is_whole
    expected = reference_generate(model, prompts[1], 6)
    generated_before = 6 - len(collector.finished["copy"].generated_tokens)
    assert collector.finished["new"].generated_tokens == expected
    assert collector.finished["copy"].generated_tokens == expected[generated_before:]


def test_fork_refuses_an_unknown_parent_or_a_different_sequence() -> None:
    with make_engine(tiny_model("llama"), block_size=4, num_blocks=16) as engine:
        engine.add_request([5, 6, 7], request_id="p", max_new_tokens=4)
        with pytest.raises(ValueError, match="not running"):
            engine.fork("nope", engine.make_request([5, 6, 7], "c"))
        with pytest.raises(ValueError, match="token sequence"):
            engine.fork("p", engine.make_request([5, 6], "c"))
        engine.cancel_request("p")
        assert engine.block_pool.is_whole
