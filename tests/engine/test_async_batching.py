"""Async batching: the next step is scheduled and prepared while the current step's forward runs, the tokens it
samples are carried into the next, and the outputs are those of the synchronous engine."""

from __future__ import annotations

import threading

import pytest
import torch

from contbatch import ContinuousBatchingConfig, LLMEngine
from contbatch.engine.batch import SchedulerOutput
from contbatch.engine.cuda_graphs import EagerReplay, GraphSettings, StepGraphs
from contbatch.engine.handoff import PreparedBatch
from contbatch.engine.outputs import EventType
from contbatch.engine.request import RequestStatus
from contbatch.engine.step_pipeline import ForwardWorker, StepPipeline, resolve_async_batching
from contbatch.frontend.output_processor import OutputCollector
from contbatch.outputs import GenerationOutput
from tests.helpers import add_samples, make_engine, random_prompts, reference_generate, run_engine, tiny_model

LENGTHS = [1, 3, 9, 16, 17, 30, 41]
MAX_NEW = [9, 4, 12, 1, 7, 10, 5]
CONFIGS = {
    "bs1-chunk5": dict(block_size=1, num_blocks=600, max_batch_tokens=5),
    "bs4-prefill_first": dict(block_size=4, num_blocks=200, max_batch_tokens=13, scheduler_type="prefill_first"),
    "bs8-tight": dict(block_size=8, num_blocks=8, max_batch_tokens=32),
}
TIGHT_HYBRID_BLOCKS = 12  # a hybrid model's block holds half its layers; its longest request needs 12


def _stop_token(model_name: str, prompts: list[list[int]]) -> int:
    """A token that greedy decoding of the first prompt produces third: some requests stop on it early."""
    return reference_generate(tiny_model(model_name), prompts[2], 12)[2]


def _run(engine: LLMEngine, prompts: list[list[int]], eos: int | None = None, preempted: set[str] | None = None
         ) -> dict[str, GenerationOutput]:
    """Runs the prompts to the end (asserting the pool whole after); adds the ids of preempted requests to
    `preempted`."""
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        engine.add_request(prompt, f"r{index}", max_new_tokens=max_new, eos_token_id=eos)
    collector = OutputCollector()
    while engine.has_unfinished_requests():
        deltas = engine.step()
        collector.add(deltas)
        if preempted is not None:
            preempted.update(d.request_id for d in deltas for e in d.events if e.type == EventType.PREEMPTED)
    engine.check_integrity()
    assert engine.block_pool.is_whole
    return collector.finished


def _forwards_inline(engine: LLMEngine, inline: bool) -> None:
    """Runs the engine's forwards on the engine thread (`inline`, a CUDA model's default) or on the worker."""
    engine.pipeline._worker = ForwardWorker(inline=inline)


@pytest.mark.parametrize("inline", [False, True], ids=["worker-thread", "inline"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "gemma3-hybrid"])
def test_greedy_matches_generate(name: str, config: dict, inline: bool) -> None:
    """Chunked prefills, preemption, sliding windows, and requests stopping on EOS while the next step (which
    computes a token of theirs for nothing) is in flight; forwards on the worker thread or launched inline."""
    model = tiny_model(name)
    prompts = random_prompts(LENGTHS, seed=21)
    eos = _stop_token(name, prompts)
    tight = config["num_blocks"] == 8
    if tight and name.startswith("gemma"):
        config = {**config, "num_blocks": TIGHT_HYBRID_BLOCKS}
    preempted: set[str] = set()
    with make_engine(model, use_async_batching=True, **config) as engine:
        assert engine.async_batching
        _forwards_inline(engine, inline)
        finished = _run(engine, prompts, eos, preempted)
        assert (engine.pipeline._worker._executor is None) == inline, "inline starts no thread"
    assert bool(preempted) or not tight, "the tight cache preempts requests (never one in flight)"
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        expected = reference_generate(model, prompt, max_new, eos_token_id=eos)
        assert finished[f"r{index}"].generated_tokens == expected, f"r{index} (prompt {len(prompt)} tokens)"
    assert any(len(output.generated_tokens) < max_new
               for output, max_new in zip(finished.values(), MAX_NEW, strict=True)), "no request stopped early"


def _record_hand_offs(engine: LLMEngine) -> list[tuple[bool, list[bool]]]:
    """Makes each forward wait until the engine thread has scheduled the next step and, when it is not empty,
    built its inputs; returns, per forward, whether it did so while the forward ran (it waits at most 30 s) and
    which of its requests had their token carried in."""
    runner, scheduler = engine.model_runner, engine.scheduler
    state = {"scheduled": 0, "prepared": 0, "upcoming": False}
    changed = threading.Condition()
    hand_offs: list[tuple[bool, list[bool]]] = []
    counts_when_prepared: dict[int, tuple[int, int]] = {}
    execute, prepare, schedule = runner.execute, runner.prepare, scheduler.schedule

    def scheduling() -> SchedulerOutput:
        output = schedule()
        with changed:
            state["scheduled"] += 1
            state["upcoming"] = not output.is_empty
            changed.notify_all()
        return output

    def preparing(output: SchedulerOutput) -> PreparedBatch:
        prepared = prepare(output)
        with changed:
            state["prepared"] += 1
            counts_when_prepared[id(prepared)] = (state["scheduled"], state["prepared"])
            changed.notify_all()
        return prepared

    def executing(output: SchedulerOutput, prepared: PreparedBatch | None = None) -> torch.Tensor:
        scheduled, prepared_count = counts_when_prepared[id(prepared)]
        logits = execute(output, prepared)
        with changed:
            overlapped = changed.wait_for(lambda: state["scheduled"] > scheduled and (
                not state["upcoming"] or state["prepared"] > prepared_count), timeout=30)
        hand_offs.append((overlapped, [entry.carried for entry in output.requests]))
        return logits

    runner.execute, runner.prepare, scheduler.schedule = executing, preparing, scheduling  # type: ignore[method-assign]
    return hand_offs


def test_the_next_step_is_prepared_while_the_forward_runs() -> None:
    """The worker-thread form (a CPU model): each forward waits for the engine thread to schedule and prepare the
    next step. A CUDA model launches on the engine thread itself (`ForwardWorker(inline=True)`), where such a wait
    could never end."""
    model = tiny_model("llama", "cpu")
    prompts = random_prompts(LENGTHS, seed=22)
    with make_engine(model, use_async_batching=True, block_size=4, num_blocks=200, max_batch_tokens=16) as engine:
        hand_offs = _record_hand_offs(engine)
        finished = _run(engine, prompts)
    assert all(overlapped for overlapped, _ in hand_offs)
    assert sum(any(carried) for _, carried in hand_offs) >= max(MAX_NEW) - 1, "decode steps carry tokens in"
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, max_new)


def test_logprobs_penalties_prompt_logprobs_and_seeds_match_the_synchronous_engine() -> None:
    """Everything a delta carries is the synchronous engine's: logprobs, top logprobs, prompt logprobs of
    chunked prompts, tokens sampled with a per-request seed and a repetition penalty (which reads the tokens
    sampled so far)."""
    model = tiny_model("qwen3")
    prompts = random_prompts(LENGTHS, seed=23)
    sampling = dict(do_sample=True, temperature=0.9, repetition_penalty=1.3, logprobs=True, top_logprobs=3,
                    prompt_logprobs=2)

    def run(use_async_batching: bool) -> dict[str, GenerationOutput]:
        with make_engine(model, use_async_batching=use_async_batching, block_size=4, num_blocks=200,
                         max_batch_tokens=11) as engine:
            for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
                engine.add_request(prompt, f"r{index}", max_new_tokens=max_new, seed=100 + index, **sampling)
            return run_engine(engine)

    def _entries(output: GenerationOutput) -> tuple[list[list[int] | None], list[float]]:
        """The prompt logprobs' top ids and values (a chunk computed in another batch rounds differently)."""
        entries = output.prompt_logprobs or []
        ids = [None if entry is None else [token for token, _ in entry.top_logprobs] for entry in entries]
        values = [value for entry in entries if entry is not None
                  for value in (entry.logprob, *(value for _, value in entry.top_logprobs))]
        return ids, values

    synchronous, overlapped = run(False), run(True)
    for request_id, output in synchronous.items():
        other = overlapped[request_id]
        assert other.generated_tokens == output.generated_tokens, request_id
        assert other.logprobs == pytest.approx(output.logprobs), request_id
        (ids, values), (expected_ids, expected_values) = _entries(other), _entries(output)
        assert ids == expected_ids and values == pytest.approx(expected_values), request_id
        assert [[token for token, _ in top] for top in other.top_logprobs] == [
            [token for token, _ in top] for top in output.top_logprobs], request_id
        assert [value for top in other.top_logprobs for _, value in top] == pytest.approx(
            [value for top in output.top_logprobs for _, value in top]), request_id


def test_cancel_while_in_flight_fails_nothing_else_and_leaks_nothing() -> None:
    model = tiny_model("llama")
    prompts = random_prompts(LENGTHS, seed=24)
    collector = OutputCollector()
    with make_engine(model, use_async_batching=True, block_size=4, num_blocks=200) as engine:
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, f"r{index}", max_new_tokens=10)
        for _ in range(4):
            collector.add(engine.step())
        assert engine.requests["r2"].num_in_flight_tokens, "r2 is in the step in flight"
        cancelled = engine.cancel_request("r2")
        assert cancelled is not None and cancelled.status == RequestStatus.CANCELLED
        collector.add([cancelled])
        while engine.has_unfinished_requests():
            collector.add(engine.step())
        engine.check_integrity()
        assert engine.block_pool.is_whole
    outputs = collector.finished
    assert outputs["r2"].status == RequestStatus.CANCELLED and len(outputs["r2"].generated_tokens) < 10
    for index, prompt in enumerate(prompts):
        if index != 2:
            assert outputs[f"r{index}"].generated_tokens == reference_generate(model, prompt, 10), f"r{index}"


@pytest.mark.parametrize("inline", [False, True], ids=["worker-thread", "inline"])
def test_a_failing_forward_fails_its_own_requests_and_the_engine_goes_on(inline: bool) -> None:
    model = tiny_model("llama")
    prompts = random_prompts([5, 6], seed=25)
    with make_engine(model, use_async_batching=True, block_size=4, num_blocks=200) as engine:
        _forwards_inline(engine, inline)
        engine.add_request(prompts[0], "bad", max_new_tokens=6)
        execute = engine.model_runner.execute

        def failing(output: SchedulerOutput, prepared: PreparedBatch | None = None) -> torch.Tensor:
            if any(entry.request_id == "bad" and entry.num_computed_tokens == 7 for entry in output.requests):
                raise RuntimeError("boom")
            return execute(output, prepared)

        engine.model_runner.execute = failing  # type: ignore[method-assign]
        engine.add_request(prompts[1], "good", max_new_tokens=3)
        outputs = run_engine(engine)
    assert outputs["bad"].status == RequestStatus.FAILED and "RuntimeError: boom" in (outputs["bad"].error or "")
    assert len(outputs["bad"].generated_tokens) == 3, "positions 5, 6 and 7 were sampled before the failure"
    assert outputs["good"].generated_tokens == reference_generate(model, prompts[1], 3)


def test_n_samples_forks_and_weight_updates_settle_the_step_in_flight() -> None:
    """A fork from a request in flight, and a weight update, first end the step in flight; n samples of a prompt
    still share its prefill."""
    model = tiny_model("llama")
    prompt, other_prompt = random_prompts([12, 7], seed=26)
    with make_engine(model, use_async_batching=True, block_size=4, num_blocks=200) as engine:
        ids = add_samples(engine, prompt, "s", 3, max_new_tokens=5)
        engine.add_request(other_prompt, "other", max_new_tokens=5)
        collector = OutputCollector()
        collector.add(engine.step())
        collector.add(engine.step())
        parent = engine.requests["other"]
        assert parent.num_in_flight_tokens
        stale = engine.make_request(list(parent.token_ids), "stale-fork", max_new_tokens=2)
        with pytest.raises(ValueError, match="a fork's prompt must be 'other'"):
            engine.fork("other", stale)
        assert engine.pipeline._in_flight is None and not parent.num_in_flight_tokens, "the fork settled"
        child = engine.make_request(list(parent.token_ids), "other-fork", max_new_tokens=2)
        engine.fork("other", child)
        collector.add(engine.step())
        engine.mark_weights_updated()
        assert engine.pipeline._in_flight is None
        while engine.has_unfinished_requests():
            collector.add(engine.step())
        engine.check_integrity()
    outputs = collector.finished
    expected = reference_generate(model, prompt, 5)
    assert [outputs[rid].generated_tokens for rid in ids] == [expected] * 3
    assert outputs["other"].generated_tokens == reference_generate(model, other_prompt, 5)
    forked_prompt = child.prompt_ids
    assert outputs["other-fork"].generated_tokens == reference_generate(model, forked_prompt, 2)


def test_beam_search_runs_synchronously_under_async_batching() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([6], seed=27)[0]
    results = []
    for use_async_batching in (False, True):
        with make_engine(model, use_async_batching=use_async_batching, block_size=4, num_blocks=200) as engine:
            engine.add_request(prompt, "b", max_new_tokens=5, num_beams=3)
            results.append(run_engine(engine)["b"].generated_tokens)
    assert results[0] == results[1]


def test_forwards_are_launched_inline_for_a_cuda_model_and_on_a_thread_on_a_cpu(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    with make_engine(tiny_model("llama", "cpu"), use_async_batching=True) as engine:
        assert not engine.pipeline._worker.inline
        monkeypatch.setattr(engine.model_runner, "device", torch.device("cuda"))
        pipeline = StepPipeline(engine.scheduler, engine.model_runner, engine.beam_search, engine.block_pool, True)
        assert pipeline._worker.inline


def test_async_batching_auto_is_on_for_a_cuda_model_only() -> None:
    """Auto (None) is on where the forward launches on a GPU (1.6-1.9x on an H200, docs/performance.md) and off
    on a CPU; True and False are taken as set on either."""
    with LLMEngine(tiny_model("llama", "cpu"), config=ContinuousBatchingConfig()) as engine:
        assert not engine.async_batching
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_async_batching(None, cpu) is False
    assert resolve_async_batching(None, cuda) is True
    for device in (cpu, cuda):
        assert resolve_async_batching(True, device) is True
        assert resolve_async_batching(False, device) is False


def test_decode_graphs_replayed_on_the_forward_thread_match_generate() -> None:
    """The combination auto turns on: decode steps replayed from graphs over padded buckets (`EagerReplay`, the
    CPU stand-in for CUDA graphs), captured and replayed on the worker thread, with carried tokens."""
    model = tiny_model("llama")
    prompts = random_prompts(LENGTHS, seed=28)
    with make_engine(model, use_async_batching=True, block_size=4, num_blocks=200, max_batch_tokens=32) as engine:
        graphs = StepGraphs(engine.cache, GraphSettings(batch_interval=2, kv_interval=4, max_graphs=3),
                              EagerReplay())
        engine.model_runner.graphs = graphs
        finished = _run(engine, prompts)
    assert graphs.num_captures > 0
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, max_new), f"r{index}"
