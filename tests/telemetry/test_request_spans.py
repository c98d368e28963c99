"""Spans and metrics of a mixed manager run (a failed, a cancelled and preempted requests), with the SDK's in-memory
exporter and reader; and `generate_batch` reporting the same way."""

from __future__ import annotations

import pytest
import torch
from opentelemetry.trace import SpanKind, StatusCode
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus, generate_batch
from contbatch.engine.batch import SchedulerOutput
from contbatch.outputs import GenerationOutput
from tests.helpers import random_prompts, tiny_model
from tests.telemetry.otel_helpers import Collected

MODEL = "LlamaForCausalLM"  # a model built from a config has no name_or_path: its class name stands for it
NUM_BLOCKS = 12


def _drain(manager: ContinuousBatchingManager, request_id: str) -> GenerationOutput:
    while True:
        output = manager.get_result(request_id, timeout=60)
        assert output is not None, f"{request_id} gave no final output"
        if output.is_finished():
            return output


def _mixed_run(collected: Collected, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, GenerationOutput], int]:
    """Runs, under a caller span: "bad" (its forward fails), "cancelled" (cancelled after its first token),
    then "a", "b" and "c", which preempt each other in a 12-block cache. Returns the outputs and the tokens
    the engine computed after the failed step."""
    manager = ContinuousBatchingManager(
        tiny_model("llama"), GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=12),
        ContinuousBatchingConfig(block_size=4, num_blocks=NUM_BLOCKS, max_batch_tokens=64),
        telemetry=collected.telemetry)
    runner = manager.engine.model_runner
    execute = runner.execute

    def failing_for_bad(scheduler_output: SchedulerOutput, *args: object, **kwargs: object) -> torch.Tensor:
        if any(entry.request_id == "bad" for entry in scheduler_output.requests):
            raise RuntimeError("boom")
        return execute(scheduler_output, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", failing_for_bad)
    prompts = random_prompts([6, 5, 10, 10, 10], seed=3)
    outputs: dict[str, GenerationOutput] = {}
    with collected.tracer_provider.get_tracer("test").start_as_current_span("caller"), manager:
        manager.add_request(prompts[0], "bad")
        outputs["bad"] = _drain(manager, "bad")
        after_failure = manager.engine.num_scheduled_tokens_total
        manager.add_request(prompts[1], "cancelled", max_new_tokens=40, streaming=True)
        assert manager.get_result("cancelled", timeout=60) is not None
        manager.cancel_request("cancelled")
        outputs["cancelled"] = _drain(manager, "cancelled")
        for request_id, prompt in zip("abc", prompts[2:], strict=True):
            manager.add_request(prompt, request_id)
        outputs.update({request_id: _drain(manager, request_id) for request_id in "abc"})
        assert collected.value("contbatch.requests.running") == 0
        assert collected.value("contbatch.kv_cache.blocks.free") + collected.value(
            "contbatch.kv_cache.blocks.used") == NUM_BLOCKS
        computed = manager.engine.num_scheduled_tokens_total - after_failure
    return outputs, computed


def test_a_mixed_run_gives_one_span_per_request_and_matching_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    collected = Collected(detailed_traces=True)
    outputs, computed = _mixed_run(collected, monkeypatch)
    assert [outputs[r].status for r in ("bad", "cancelled", "a")] == [
        RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.FINISHED]
    (caller,) = collected.spans("caller")
    spans = collected.request_spans()
    assert set(spans) == set(outputs)
    for request_id, span in spans.items():
        output, attributes = outputs[request_id], span.attributes
        assert span.name == f"text_completion {MODEL}" and span.kind == SpanKind.INTERNAL
        assert span.parent is not None and span.parent.span_id == caller.context.span_id
        assert span.context.trace_id == caller.context.trace_id
        assert attributes["gen_ai.operation.name"] == "text_completion" and attributes["gen_ai.request.model"] == MODEL
        assert attributes["gen_ai.usage.input_tokens"] == len(output.prompt_ids)
        assert attributes["gen_ai.usage.output_tokens"] == len(output.generated_tokens)
        assert attributes["gen_ai.response.finish_reasons"] == (output.finish_reason,)
        assert attributes["gen_ai.request.temperature"] == 0.0
        assert len([e for e in span.events if e.name == "contbatch.request.preempted"]) == attributes[
            "contbatch.request.preemptions"]
    for request_id in ("cancelled", "a", "b", "c"):
        attributes = spans[request_id].attributes
        assert attributes["contbatch.request.time_in_queue"] + attributes["contbatch.request.prefill_time"] == (
            pytest.approx(attributes["contbatch.request.time_to_first_token"], abs=1e-6))
        ttft_and_decode = attributes["contbatch.request.time_to_first_token"] + attributes[
            "contbatch.request.decode_time"]
        assert ttft_and_decode <= (spans[request_id].end_time - spans[request_id].start_time) / 1e9 + 1e-6
    assert spans["a"].attributes["gen_ai.request.max_tokens"] == 12
    assert spans["cancelled"].attributes["gen_ai.request.max_tokens"] == 40
    assert [e.name for e in spans["cancelled"].events] == ["contbatch.request.cancelled"]
    failed = spans["bad"]
    assert failed.status.status_code == StatusCode.ERROR and failed.status.description == "RuntimeError: boom"
    (event,) = failed.events
    assert event.name == "contbatch.request.failed" and event.attributes["error.message"] == "RuntimeError: boom"
    assert failed.attributes["error.type"] == "contbatch.request_failed"
    preemptions = sum(span.attributes["contbatch.request.preemptions"] for span in spans.values())
    assert preemptions >= 1, "the 12-block cache should have made a, b and c preempt each other"
    _check_metrics(collected, outputs, preemptions, computed)
    _check_step_spans(collected)


def _check_metrics(collected: Collected, outputs: dict[str, GenerationOutput], preemptions: int,
                   computed: int) -> None:
    def tokens(kind: str) -> float:
        return collected.value("gen_ai.client.token.usage", {"gen_ai.token.type": kind})

    assert tokens("input") == sum(len(output.prompt_ids) for output in outputs.values())
    assert tokens("output") == sum(len(output.generated_tokens) for output in outputs.values())
    assert collected.count("gen_ai.server.request.duration") == 5
    (failed,) = [p for p in collected.points("gen_ai.server.request.duration") if "error.type" in p.attributes]
    assert failed.count == 1 and failed.attributes["gen_ai.request.model"] == MODEL
    assert collected.count("gen_ai.server.time_to_first_token") == 4  # every request but the failed one
    assert collected.count("gen_ai.server.time_per_output_token") == 3  # the finished ones
    assert collected.value("contbatch.preemptions") == preemptions
    prefill, decode = collected.value("contbatch.prefill.tokens"), collected.value("contbatch.decode.tokens")
    assert prefill + decode == computed
    steps = collected.spans("contbatch.step.forward")
    assert collected.count("contbatch.batch.fill") == len(steps)
    assert sum(span.attributes["contbatch.batch.prefill_tokens"] for span in collected.spans("contbatch.step")
               if span.name == "contbatch.step") == prefill


def _check_step_spans(collected: Collected) -> None:
    steps = [span for span in collected.spans("contbatch.step") if span.name == "contbatch.step"]
    assert steps
    children: dict[int, list[str]] = {}
    for span in collected.spans("contbatch.step."):
        assert span.parent is not None
        children.setdefault(span.parent.span_id, []).append(span.name)
    for step in steps:
        assert step.parent is None and step.attributes["contbatch.batch.size"] >= 1
        assert 0 < step.attributes["contbatch.batch.fill"] <= 1
        assert children[step.context.span_id] == ["contbatch.step.schedule", "contbatch.step.forward",
                                                  "contbatch.step.sample"]


def test_generate_batch_reports_every_sample_with_its_shared_prompt() -> None:
    collected = Collected()
    prompts = random_prompts([9, 7], seed=5)
    config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=0, num_return_sequences=2,
                              eos_token_id=None, max_new_tokens=4)
    with collected.tracer_provider.get_tracer("test").start_as_current_span("eval step") as caller:
        outputs = generate_batch(tiny_model("llama"), [*prompts, [10**6]], config,
                                 ContinuousBatchingConfig(block_size=4, num_blocks=64), progress_bar=False,
                                 telemetry=collected.telemetry)
    spans = collected.request_spans()
    assert outputs["req_2_0"].status == RequestStatus.FAILED  # refused before it reached the engine: no span
    assert set(spans) == {"req_0_0", "req_0_1", "req_1_0", "req_1_1"}
    assert all(span.parent.span_id == caller.context.span_id for span in spans.values())
    attributes = spans["req_0_1"].attributes
    assert (attributes["gen_ai.request.temperature"], attributes["gen_ai.request.top_p"]) == (0.7, 0.9)
    assert attributes["gen_ai.usage.output_tokens"] == 4
    cached = {rid: span.attributes["contbatch.request.cached_prompt_tokens"] for rid, span in spans.items()}
    assert cached["req_0_1"] == 9 and cached["req_1_1"] == 7  # the second sample shares the first's prompt
    assert collected.value("contbatch.prefix_cache.hit_tokens") == sum(cached.values())
    assert collected.value("contbatch.prefill.tokens") == 9 + 7
