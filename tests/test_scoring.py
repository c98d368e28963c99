"""`contbatch.loglikelihood`: continuation scores and greediness equal a plain forward's, contexts are shared."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import PreTrainedModel

from contbatch import loglikelihood
from contbatch.engine.attention import METADATA_KWARG
from contbatch.engine.attention_types import KVShapeProbe
from tests.helpers import TINY_CONFIGS, random_prompts, tiny_model


def reference_score(reference: PreTrainedModel, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """lm-eval's hf backend's computation: one plain forward over context + continuation (float32 log_softmax)."""
    with torch.inference_mode():
        logits = reference(torch.tensor([context + continuation]), use_cache=False).logits[0]
    rows = logits.float().log_softmax(-1)[len(context) - 1:-1]
    targets = torch.tensor(continuation)
    total = float(rows.gather(1, targets.unsqueeze(1)).sum())
    return total, bool((rows.argmax(-1) == targets).all())


def greedy_continuation(reference: PreTrainedModel, context: list[int], length: int) -> list[int]:
    with torch.inference_mode():
        out = reference.generate(torch.tensor([context]), max_new_tokens=length, min_new_tokens=length,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(context):].tolist()


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_scores_equal_a_plain_forward_and_greedy_continuations_are_recognised(name: str) -> None:
    """Multiple-choice style pairs (two contexts, several continuations each, one greedy, one duplicate), in one
    run: every score within 1e-5 of the reference, greedy flags equal, results in input order."""
    model = tiny_model(name)
    reference = copy.deepcopy(model)
    contexts = random_prompts([19, 6], seed=500)
    pairs = []
    for index, context in enumerate(contexts):
        pairs.append((context, greedy_continuation(reference, context, 3)))
        pairs += [(context, continuation) for continuation in random_prompts([1, 4, 2], seed=501 + index)]
    pairs.append(pairs[1])
    scores = loglikelihood(model, pairs, progress_bar=False, block_size=4)
    assert len(scores) == len(pairs)
    for (context, continuation), (total, greedy) in zip(pairs, scores, strict=True):
        expected_total, expected_greedy = reference_score(reference, list(context), list(continuation))
        assert total == pytest.approx(expected_total, abs=1e-5)
        assert greedy == expected_greedy
    assert scores[0][1] and scores[len(pairs) // 2][1], "the greedy continuations"
    assert scores[-1] == scores[1]


def count_computed_tokens(model: PreTrainedModel) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """The tokens of each forward of `model` but the KV cache's probe (two tokens, when an engine is built)."""
    counts: list[int] = []

    def hook(_: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not isinstance(kwargs.get(METADATA_KWARG), KVShapeProbe):
            counts.append(kwargs["input_ids"].shape[1])

    return counts, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_a_shared_context_is_computed_once() -> None:
    """Four continuations of a 21-token context (5 full blocks of 4): the context's blocks are computed once and
    the others take them from the prefix cache, so the forwards compute 20 tokens fewer per later pair than
    scoring each pair alone (context + continuation but its last token)."""
    model = tiny_model("llama")
    context = random_prompts([21], seed=510)[0]
    pairs = [(context, continuation) for continuation in random_prompts([2, 3, 1, 5], seed=511)]
    counts, handle = count_computed_tokens(model)
    try:
        loglikelihood(model, pairs, progress_bar=False, block_size=4, num_blocks=64)
    finally:
        handle.remove()
    alone = sum(len(context) + len(continuation) - 1 for context, continuation in pairs)
    assert sum(counts) == alone - 20 * (len(pairs) - 1)


@pytest.mark.parametrize(("pairs", "message"), [
    ([([1, 2], [3]), ([], [4])], "pair 1: the context must be a non-empty list of token ids"),
    ([([1, 2], [])], "pair 0: the continuation must be a non-empty list"),
    ([([1, 2], [3]), "ab"], "pair 1: expected (context_ids, continuation_ids)"),
    ([([1, 2], [3]), ([1], [10**9])], "pair 1: request 'pair_1': token id 1000000000 is outside the vocabulary"),
    ([([1] * 1000, [2] * 30)], "pair 0: request 'pair_0': prompt (1030 tokens) + max_new_tokens (0) needs 1029"),
])
def test_bad_pairs_are_refused_before_anything_runs_naming_the_pair(pairs: list, message: str) -> None:
    model = tiny_model("llama")
    counts, handle = count_computed_tokens(model)
    try:
        with pytest.raises(ValueError) as error:
            loglikelihood(model, pairs, progress_bar=False)
    finally:
        handle.remove()
    assert message in str(error.value)
    assert counts == [], "nothing was computed"
    assert model.config._attn_implementation != "contbatch_paged", "the model has its own attention back"
