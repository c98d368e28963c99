"""Scoring requests: `prompt_logprobs_start` (score only a continuation, taking the context from the prefix cache)
and `max_new_tokens=0` (compute the prompt, generate nothing), checked against a plain forward of a copy."""

from __future__ import annotations

import copy

import pytest
import torch

from contbatch import LLMEngine, RequestStatus
from contbatch.engine.batch import SchedulerOutput
from contbatch.outputs import GenerationOutput
from tests.engine.test_prompt_logprobs import ATOL, Entries, count_kept_rows, reference_logprobs
from tests.helpers import TINY_CONFIGS, add_samples, make_engine, random_prompts, run_engine, tiny_model


def check_scored(entries: Entries, expected: torch.Tensor, prompt: list[int], start: int, k: int) -> None:
    """One entry per prompt token: None before `start` (and for token 0), then each token's logprob and its top
    k within ATOL of the reference log_softmax at the previous position."""
    assert entries is not None and len(entries) == len(prompt)
    first = max(start, 1)
    assert all(entry is None for entry in entries[:first])
    rows = expected[first - 1:-1]
    wanted = rows.gather(1, torch.tensor(prompt[first:]).unsqueeze(1)).squeeze(1)
    actual = [entry.logprob for entry in entries[first:] if entry is not None]
    assert len(actual) == len(prompt) - first
    torch.testing.assert_close(torch.tensor(actual), wanted, atol=ATOL, rtol=0)
    values, ids = rows.topk(k, dim=-1)
    tops = [entry.top_logprobs for entry in entries[first:] if entry is not None]
    assert [[token for token, _ in top] for top in tops] == ids.tolist()
    torch.testing.assert_close(torch.tensor([[value for _, value in top] for top in tops]).reshape(values.shape),
                               values, atol=ATOL, rtol=0)


def scored_only(output: GenerationOutput) -> None:
    assert output.status == RequestStatus.FINISHED and output.finish_reason == "length"
    assert output.generated_tokens == []


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_continuations_after_a_cached_context_are_exact_and_share_its_blocks(name: str) -> None:
    """A context is computed once; every continuation scored after it (`prompt_logprobs_start` = context length,
    `max_new_tokens=0`) takes the context's full blocks from the prefix cache and its entries still equal a plain
    forward's (chunked prefill: the budget is smaller than the prompts). Submitted together, the later ones wait
    for the first to compute the shared blocks rather than compute them again."""
    model = tiny_model(name)
    reference = copy.deepcopy(model)
    context = random_prompts([21], seed=400)[0]
    continuations = random_prompts([3, 1, 6, 2], seed=401)
    with make_engine(model, block_size=4, num_blocks=96, max_batch_tokens=16) as engine:
        for index, continuation in enumerate(continuations):
            engine.add_request(context + continuation, request_id=f"c{index}", max_new_tokens=0,
                               prompt_logprobs=2, prompt_logprobs_start=len(context))
        outputs = run_engine(engine)
    for index, continuation in enumerate(continuations):
        prompt = context + continuation
        output = outputs[f"c{index}"]
        scored_only(output)
        check_scored(output.prompt_logprobs, reference_logprobs(reference, prompt), prompt, len(context), 2)
        if index:
            assert output.num_cached_tokens == 20, "the context's 5 full blocks come from the cache"
    assert outputs["c0"].num_cached_tokens == 0


def test_the_cached_prefix_stops_before_the_first_position_that_scores() -> None:
    """Only the tokens before the position whose logits score the first entry may come from the cache: with the
    start inside a cached block, the cache supplies block 0 and the 3 tokens of block 1 before that position
    (copied), and the position itself is computed (7 tokens cached, not 8)."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    prompt = random_prompts([14], seed=410)[0]
    with make_engine(model, block_size=4, num_blocks=32) as engine:
        engine.add_request(prompt, request_id="warm", max_new_tokens=1)
        run_engine(engine)
        engine.add_request(prompt, request_id="scored", max_new_tokens=1, prompt_logprobs=0, prompt_logprobs_start=8)
        output = run_engine(engine)["scored"]
    assert output.num_cached_tokens == 7
    check_scored(output.prompt_logprobs, reference_logprobs(reference, prompt), prompt, 8, 0)


def test_score_only_requests_compute_all_but_the_last_token_and_sample_nothing() -> None:
    """`max_new_tokens=0`: the request finishes with reason "length" and no tokens in the step that computes its
    prompt but the last token (whose logits nothing needs: no row is kept for sampling), beside a generating
    request whose output is unchanged; a one-token prompt is computed and gets its single None entry; a prompt
    one token longer than the model's positions can be scored (lm-eval's rolling windows are)."""
    model = tiny_model("qwen3")
    reference = copy.deepcopy(model)
    scored, plain = random_prompts([9, 7], seed=420)
    positions = model.config.max_position_embeddings
    long = random_prompts([positions + 1], seed=421)[0]
    kept, handle = count_kept_rows(model)
    try:
        with make_engine(model, block_size=16, num_blocks=160, max_batch_tokens=2048) as engine:
            engine.add_request(scored, request_id="scored", max_new_tokens=0, prompt_logprobs=3)
            engine.add_request(plain, request_id="plain", max_new_tokens=3)
            engine.add_request([5], request_id="single", max_new_tokens=0, prompt_logprobs=0)
            engine.add_request([5, 6], request_id="bare", max_new_tokens=0)
            engine.add_request(long, request_id="long", max_new_tokens=0, prompt_logprobs=0, prompt_logprobs_start=1000)
            steps = record_schedules(engine)
            outputs = run_engine(engine)
    finally:
        handle.remove()
    computed = {entry.request_id: len(entry.token_ids) for entry in steps[0].requests}
    assert computed == {"scored": 8, "plain": 7, "single": 1, "bare": 1, "long": positions}
    assert kept[0] == 1 + 8 + (positions + 1 - 1000), "plain's sampling row, then only the scored rows"
    for rid in ("scored", "single", "bare", "long"):
        scored_only(outputs[rid])
    check_scored(outputs["scored"].prompt_logprobs, reference_logprobs(reference, scored), scored, 0, 3)
    assert outputs["single"].prompt_logprobs == [None] and outputs["bare"].prompt_logprobs is None
    expected_long = reference_logprobs(reference, long[:-1])
    check_scored(outputs["long"].prompt_logprobs, torch.cat([expected_long, expected_long[-1:]]), long, 1000, 0)
    assert len(outputs["plain"].generated_tokens) == 3


def record_schedules(engine: LLMEngine) -> list[SchedulerOutput]:
    """The scheduler outputs of every later step of `engine`, in order."""
    steps: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        steps.append(schedule())
        return steps[-1]

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("n", [1, 3])
def test_score_only_samples_all_finish_with_the_entries_and_the_pool_is_whole(n: int) -> None:
    """n score-only samples of a prompt share one prefill and all finish with its entries, nothing generated."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    prompt = random_prompts([11], seed=430)[0]
    with make_engine(model, block_size=4, num_blocks=32, max_batch_tokens=5) as engine:
        ids = add_samples(engine, prompt, "s", n, max_new_tokens=0, prompt_logprobs=1, prompt_logprobs_start=4)
        outputs = run_engine(engine)
    expected = reference_logprobs(reference, prompt)
    for rid in ids:
        scored_only(outputs[rid])
        check_scored(outputs[rid].prompt_logprobs, expected, prompt, 4, 1)
