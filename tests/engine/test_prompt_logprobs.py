"""`prompt_logprobs=k`: the log-probability of every prompt token after the first, and the top k there, computed in
the batched prefill and checked against log_softmax of a plain forward of an unattached copy of the model."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus, generate_batch
from contbatch.engine.attention import METADATA_KWARG
from contbatch.engine.attention_types import KVShapeProbe
from contbatch.engine.outputs import EventType, RequestDelta
from contbatch.frontend.output_processor import OutputCollector
from contbatch.outputs import GenerationOutput, PromptLogprob
from tests.helpers import (
    TINY_CONFIGS,
    add_samples,
    make_engine,
    random_prompts,
    reference_generate,
    run_engine,
    tiny_model,
)

ATOL = 1e-5
Entries = Sequence[PromptLogprob | None] | None


def reference_logprobs(reference: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: log_softmax in float32 of one plain forward over the prompt (no cache)."""
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt], device=reference.device), use_cache=False).logits[0]
    return logits.float().log_softmax(-1).cpu()


def check_entries(entries: Entries, expected: torch.Tensor, prompt: list[int], k: int) -> None:
    """One entry per prompt token, None first; each token's logprob and the top k (ids in order, values) within
    ATOL of `expected` (the reference log_softmax at the previous position)."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    scored = [entry for entry in entries[1:] if entry is not None]
    assert len(scored) == len(prompt) - 1 and all(isinstance(entry, PromptLogprob) for entry in scored)
    if not scored:
        return
    rows = expected[:-1]
    wanted = rows.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([entry.logprob for entry in scored]), wanted, atol=ATOL, rtol=0)
    if k == 0:
        assert all(entry.top_logprobs == () for entry in scored)
        return
    values, ids = rows.topk(k, dim=-1)
    assert [[token for token, _ in entry.top_logprobs] for entry in scored] == ids.tolist()
    actual = torch.tensor([[value for _, value in entry.top_logprobs] for entry in scored])
    torch.testing.assert_close(actual, values, atol=ATOL, rtol=0)


def count_kept_rows(model: PreTrainedModel) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """Records how many logits rows each forward of `model` keeps (`logits_to_keep`)."""
    kept: list[int] = []

    def hook(_: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not isinstance(kwargs.get(METADATA_KWARG), KVShapeProbe):  # the cache's probe keeps every row
            kept.append(len(kwargs["logits_to_keep"]))

    return kept, model.register_forward_pre_hook(hook, with_kwargs=True)


ASKS = {"none": None, "k0": 0, "k5": 5, "k20": 20}
LENGTHS = {"none": 29, "k0": 23, "k5": 41, "k20": 17}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_prompt_logprobs_equal_a_plain_forward_with_chunked_prefill_and_mixed_requests(name: str) -> None:
    """Prompts longer than `max_batch_tokens` (several chunks), asking and non-asking requests in one batch: each
    asking request's entries match the reference, the others are untouched, and the forward keeps only the
    sampling rows plus the asking requests' prompt rows."""
    model = tiny_model(name)
    reference = copy.deepcopy(model)
    prompts = dict(zip(ASKS, random_prompts(list(LENGTHS.values()), seed=300), strict=True))
    prompts["single"] = random_prompts([1], seed=301)[0]
    asks = {**ASKS, "single": 3}
    kept, handle = count_kept_rows(model)
    try:
        # no decode graphs (a GPU's default): their buckets pad the rows, and each capture runs the forward twice
        with make_engine(model, block_size=4, num_blocks=128, max_batch_tokens=12, use_cuda_graph=False) as engine:
            for rid, prompt in prompts.items():
                engine.add_request(prompt, request_id=rid, max_new_tokens=4, prompt_logprobs=asks[rid])
            outputs = run_engine(engine)
    finally:
        handle.remove()
    for rid, prompt in prompts.items():
        assert outputs[rid].generated_tokens == reference_generate(model, prompt, 4), rid
        if asks[rid] is None:
            assert outputs[rid].prompt_logprobs is None
        else:
            check_entries(outputs[rid].prompt_logprobs, reference_logprobs(reference, prompt), prompt, asks[rid])
    scored = sum(len(prompt) - 1 for rid, prompt in prompts.items() if asks[rid] is not None)
    assert sum(kept) == 4 * len(prompts) + scored, "only sampling rows and the asking prompts' rows"
    assert outputs["single"].prompt_logprobs == [None]


def test_a_request_asking_prompt_logprobs_takes_nothing_from_the_prefix_cache() -> None:
    """A cached prefix has no logits: the asking request computes its whole prompt (num_cached_tokens 0) and gets
    every entry, equal to the first request's; the blocks it computes still serve a request that does not ask."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    system = random_prompts([16], seed=310)[0]
    prompt = system + random_prompts([5], seed=311)[0]
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=64) as engine:
        engine.add_request(prompt, request_id="first", max_new_tokens=2, prompt_logprobs=4)
        first = run_engine(engine)["first"]
        assert engine.block_pool.num_cached_blocks >= 4
        engine.add_request(prompt, request_id="again", max_new_tokens=2, prompt_logprobs=4)
        engine.add_request([*system, 7, 8], request_id="plain", max_new_tokens=2)
        second = run_engine(engine)
    again = second["again"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 0
    assert second["plain"].num_cached_tokens == 16, "the asking requests' blocks are cached for others"
    check_entries(again.prompt_logprobs, reference_logprobs(reference, prompt), prompt, 4)
    assert first.prompt_logprobs is not None and again.prompt_logprobs is not None
    for mine, theirs in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:], strict=True):
        assert mine is not None and theirs is not None
        assert [token for token, _ in mine.top_logprobs] == [token for token, _ in theirs.top_logprobs]
        assert mine.logprob == pytest.approx(theirs.logprob, abs=ATOL)
    assert second["plain"].generated_tokens == reference_generate(model, [*system, 7, 8], 2)


def prompt_entries_before_preemption(deltas: list[RequestDelta], request_id: str) -> int:
    """How many prompt logprobs entries `request_id` reported before its first PREEMPTED event."""
    count = 0
    for delta in deltas:
        if delta.request_id != request_id:
            continue
        if any(event.type == EventType.PREEMPTED for event in delta.events):
            return count
        count += len(delta.new_prompt_logprobs or ())
    raise AssertionError(f"{request_id} was never preempted")


def test_preemption_in_the_middle_of_the_prompt_reports_every_entry_once() -> None:
    """`late` is preempted partway through its chunked prompt (a tiny cache, `early` growing) and recomputes it
    from the start: it reports only the entries it had not reported, so the list is whole and exact."""
    model = tiny_model("qwen3")
    reference = copy.deepcopy(model)
    early, late = random_prompts([4, 20], seed=320)
    with make_engine(model, block_size=4, num_blocks=6, max_batch_tokens=6) as engine:
        engine.add_request(early, request_id="early", max_new_tokens=18)
        engine.add_request(late, request_id="late", max_new_tokens=2, prompt_logprobs=2)
        collector, deltas = OutputCollector(), []
        while engine.has_unfinished_requests():
            step = engine.step()
            collector.add(step)
            deltas += step
        engine.check_integrity()
        assert engine.block_pool.is_whole
    reported = prompt_entries_before_preemption(deltas, "late")
    assert 0 < reported < len(late), "preempted in the middle of its prompt"
    assert sum(len(delta.new_prompt_logprobs or ()) for delta in deltas if delta.request_id == "late") == len(late)
    outputs = collector.finished
    check_entries(outputs["late"].prompt_logprobs, reference_logprobs(reference, late), late, 2)
    assert outputs["early"].generated_tokens == reference_generate(model, early, 18)
    assert outputs["late"].generated_tokens == reference_generate(model, late, 2)


@pytest.mark.parametrize("cancel_leader", [False, True])
def test_n_samples_all_carry_the_prompt_logprobs_of_the_shared_prefill(cancel_leader: bool) -> None:
    """The samples of a chunked prompt share its prefill and all get its entries; when the leader is cancelled
    midway, the sample taking its place recomputes the prompt and reports only what it had not received."""
    model = tiny_model("mistral-sliding")
    reference = copy.deepcopy(model)
    prompt = random_prompts([26], seed=330)[0]
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=10) as engine:
        ids = add_samples(engine, prompt, "p", 3, max_new_tokens=3, do_sample=True, top_k=1, prompt_logprobs=3)
        collector = OutputCollector()
        if cancel_leader:
            collector.add(engine.step())
            collector.add([engine.cancel_request("p_0")])  # type: ignore[list-item]
            ids = ids[1:]
        while engine.has_unfinished_requests():
            collector.add(engine.step())
        engine.check_integrity()
        assert engine.block_pool.is_whole
        outputs = collector.finished
    expected = reference_logprobs(reference, prompt)
    for request_id in ids:
        check_entries(outputs[request_id].prompt_logprobs, expected, prompt, 3)
        assert outputs[request_id].generated_tokens == reference_generate(model, prompt, 3)
    first = outputs[ids[0]].prompt_logprobs
    assert all(outputs[request_id].prompt_logprobs == first for request_id in ids)


def test_forks_that_could_not_get_the_prompt_logprobs_are_refused() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([12], seed=340)[0]
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=8) as engine:
        engine.add_request(prompt, request_id="p", max_new_tokens=3, prompt_logprobs=2)
        with pytest.raises(ValueError, match=r"'c': prompt_logprobs=None differs from its parent 'p'"):
            engine.fork("p", engine.make_request(prompt, "c", max_new_tokens=3))
        engine.step()
        with pytest.raises(ValueError, match=r"'d': prompt_logprobs=2 needs a fork made before its parent 'p'"):
            engine.fork("p", engine.make_request(prompt, "d", max_new_tokens=3, prompt_logprobs=2))
        assert sorted(engine.requests) == ["p"]
        run_engine(engine)


@pytest.mark.parametrize("value", [21, -1, 2.5, True, "3"])
def test_a_bad_prompt_logprobs_fails_only_its_request_naming_the_value(value: object) -> None:
    model = tiny_model("llama")
    prompts = random_prompts([5, 6], seed=350)
    with make_engine(model, block_size=4, num_blocks=64) as engine:
        with pytest.raises(ValueError) as error:
            engine.add_request(prompts[0], request_id="bad", prompt_logprobs=value)
        assert "'bad'" in str(error.value) and "prompt_logprobs" in str(error.value)
        assert repr(value) in str(error.value) or str(value) in str(error.value)
        engine.add_request(prompts[1], request_id="good", max_new_tokens=3, prompt_logprobs=1)
        outputs = run_engine(engine)
    assert list(outputs) == ["good"] and outputs["good"].status == RequestStatus.FINISHED


def test_the_manager_streams_and_samples_with_prompt_logprobs() -> None:
    model = tiny_model("gemma3-hybrid")
    reference = copy.deepcopy(model)
    prompts = random_prompts([30, 9], seed=360)
    config = ContinuousBatchingConfig(block_size=4, num_blocks=128, max_batch_tokens=16)
    greedy = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=None)
    with ContinuousBatchingManager(model, greedy, config) as manager:
        with pytest.raises(ValueError, match="prompt_logprobs must be None or at most 20, got 30"):
            manager.add_request(prompts[0], "bad", prompt_logprobs=30)
        manager.add_request(prompts[0], "s", streaming=True, prompt_logprobs=2)
        manager.add_request(prompts[1], "n", n=2, do_sample=True, top_k=1, prompt_logprobs=0)
        manager.add_request(prompts[1], "plain")
        streamed = list(manager.request_id_iter("s"))
        samples = [manager.get_result(f"n_{j}", timeout=60) for j in range(2)]
        plain = manager.get_result("plain", timeout=60)
    assert len(streamed) == 4 and streamed[-1].is_finished()
    for output in streamed:  # the prompt is computed before the first token: every streamed output has it all
        check_entries(output.prompt_logprobs, reference_logprobs(reference, prompts[0]), prompts[0], 2)
    expected = reference_logprobs(reference, prompts[1])
    for output in samples:
        assert isinstance(output, GenerationOutput) and output.status == RequestStatus.FINISHED
        check_entries(output.prompt_logprobs, expected, prompts[1], 0)
    assert plain is not None and plain.prompt_logprobs is None
    assert plain.generated_tokens == reference_generate(model, prompts[1], 4)


def test_generate_batch_takes_prompt_logprobs_from_the_generation_config() -> None:
    model = tiny_model("gemma2-softcap")
    reference = copy.deepcopy(model)
    prompts = random_prompts([14, 3, 25], seed=370)
    config = GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=None, prompt_logprobs=4)
    small = ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=16)
    outputs = generate_batch(model, prompts, config, small, progress_bar=False)
    for index, prompt in enumerate(prompts):
        output = outputs[f"req_{index}"]
        check_entries(output.prompt_logprobs, reference_logprobs(reference, prompt), prompt, 4)
        assert output.generated_tokens == reference_generate(model, prompt, 3)
    bad = GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=None, prompt_logprobs=21)
    failed = generate_batch(model, prompts[:1], bad, small, progress_bar=False)["req_0"]
    assert failed.status == RequestStatus.FAILED and "prompt_logprobs must be None or at most 20, got 21" in (
        failed.error or "")
