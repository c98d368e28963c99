"""`step()` hands out immutable per-request deltas with events, never live requests; sampling is its own stage."""

from __future__ import annotations

import pytest
import torch

from contbatch.engine.outputs import EventType, RequestDelta
from contbatch.engine.request import Request, RequestStatus
from contbatch.frontend.output_processor import OutputCollector
from tests.helpers import make_engine, random_prompts, reference_generate, tiny_model


def events_by_request(deltas: list[RequestDelta]) -> dict[str, list[EventType]]:
    seen: dict[str, list[EventType]] = {}
    for delta in deltas:
        seen.setdefault(delta.request_id, []).extend(event.type for event in delta.events)
    return seen


def test_deltas_are_values_with_the_lifecycle_events_of_each_request() -> None:
    model = tiny_model("llama")
    prompts = random_prompts([9, 30], seed=70)
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=16) as engine:
        engine.add_request(prompts[0], request_id="a", max_new_tokens=3, logprobs=True)
        engine.add_request(prompts[1], request_id="b", max_new_tokens=2)
        deltas: list[RequestDelta] = []
        while engine.has_unfinished_requests():
            step = engine.step()
            assert all(isinstance(delta, RequestDelta) and not isinstance(delta, Request) for delta in step)
            deltas += step
    with pytest.raises(AttributeError):  # immutable
        deltas[0].new_token_ids = (1,)  # type: ignore[misc]
    events = events_by_request(deltas)
    assert events == {"a": [EventType.QUEUED, EventType.SCHEDULED, EventType.FINISHED],
                      "b": [EventType.QUEUED, EventType.SCHEDULED, EventType.FINISHED]}
    b_steps = [delta for delta in deltas if delta.request_id == "b"]
    # b's 30-token prompt takes two chunks: the first brings its SCHEDULED event, the second nothing to report
    assert [len(delta.new_token_ids) for delta in b_steps] == [0, 1, 1]
    assert b_steps[-1].is_finished and b_steps[-1].finish_reason == "length"
    a_tokens = [token for delta in deltas if delta.request_id == "a" for token in delta.new_token_ids]
    assert a_tokens == reference_generate(model, prompts[0], 3)
    assert all(delta.new_logprobs is not None and len(delta.new_logprobs) == len(delta.new_token_ids)
               for delta in deltas if delta.request_id == "a")
    assert all(delta.new_logprobs is None for delta in b_steps)


def test_preemption_is_an_event_and_the_tokens_stay_exact() -> None:
    model = tiny_model("qwen3")
    prompts = random_prompts([3, 8], seed=71)
    with make_engine(model, block_size=4, num_blocks=4, max_batch_tokens=64, use_async_batching=False) as engine:
        engine.add_request(prompts[0], request_id="old", max_new_tokens=6)
        engine.add_request(prompts[1], request_id="new", max_new_tokens=6)
        collector, deltas = OutputCollector(), []
        while engine.has_unfinished_requests():
            step = engine.step()
            collector.add(step)
            deltas += step
    events = events_by_request(deltas)["new"]
    assert events[:3] == [EventType.QUEUED, EventType.SCHEDULED, EventType.PREEMPTED]
    assert events[-2:] == [EventType.SCHEDULED, EventType.FINISHED]
    for request_id, prompt in zip(("old", "new"), prompts, strict=True):
        assert collector.finished[request_id].generated_tokens == reference_generate(model, prompt, 6)


def test_cancel_returns_the_final_delta() -> None:
    with make_engine(tiny_model("llama"), block_size=4, num_blocks=16, use_async_batching=False) as engine:
        engine.add_request([5, 6, 7], request_id="c", max_new_tokens=4)
        engine.step()
        delta = engine.cancel_request("c")
        assert delta is not None and delta.status == RequestStatus.CANCELLED and delta.finish_reason == "cancelled"
        assert [event.type for event in delta.events] == [EventType.FINISHED]
        assert engine.cancel_request("c") is None and engine.block_pool.is_whole


def test_a_logits_mask_between_forward_and_sampling_constrains_the_token() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([7], seed=72)[0]
    with make_engine(model, block_size=4, num_blocks=16) as engine:
        engine.add_request(prompt, request_id="m", max_new_tokens=2)
        scheduler_output = engine.scheduler.schedule()
        logits = engine.model_runner.execute(scheduler_output)
        greedy = int(logits[0].argmax())
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[0, (greedy + 1) % logits.shape[1]] = True
        result = engine.model_runner.sample(logits, scheduler_output, logits_mask=allowed)
        assert result.request_ids == ["m"] and result.sampled_token_ids == [(greedy + 1) % logits.shape[1]]
        engine.scheduler.update_from_output(scheduler_output, result)
        engine.cancel_request("m")
        assert engine.block_pool.is_whole
