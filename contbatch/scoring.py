"""`loglikelihood`: score continuations given contexts (lm-eval's loglikelihood requests) in one engine run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel

from contbatch.engine.config import ContinuousBatchingConfig
from contbatch.manager import ContinuousBatchingManager
from contbatch.outputs import GenerationOutput, PromptLogprob, RequestStatus

SCORING_BLOCK_SIZE = 16
Pair = tuple[Sequence[int], Sequence[int]]
Key = tuple[tuple[int, ...], tuple[int, ...]]


def loglikelihood(
    model: PreTrainedModel,
    pairs: Sequence[Pair],
    *,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    progress_bar: bool = True,
    **config_kwargs: Any,
) -> list[tuple[float, bool]]:
    """For each `(context_ids, continuation_ids)` pair, `(sum of the continuation tokens' log-probabilities, whether
    every continuation token is the most likely one)`, in order: what lm-eval's `loglikelihood` returns.

    Token i of the continuation is scored given the context and the continuation tokens before it (log_softmax of
    the raw logits, float32). All pairs run through one engine run as score-only requests (`max_new_tokens=0`,
    `prompt_logprobs_start` at the continuation): a context shared by several pairs is computed once, the later
    pairs taking its full blocks from the prefix cache, and identical pairs are scored once. Without a
    `block_size` (in `continuous_batching_config` or `config_kwargs`, which override it field by field) blocks
    are SCORING_BLOCK_SIZE tokens, so that contexts shorter than the engine's default block still share.

    The caller truncates: a context needs at least 1 token and a continuation at least 1, and context +
    continuation may be at most one token longer than the model's positions (the last token is scored, never
    computed). Raises ValueError naming a bad pair before anything runs, and RuntimeError naming a pair
    the engine failed.
    """
    keys = [_key(index, pair) for index, pair in enumerate(pairs)]
    first_index: dict[Key, int] = {}
    for index, key in enumerate(keys):
        first_index.setdefault(key, index)
    base = continuous_batching_config or ContinuousBatchingConfig(block_size=SCORING_BLOCK_SIZE)
    config = ContinuousBatchingConfig.from_sources(base, config_kwargs)
    manager = ContinuousBatchingManager(model, GenerationConfig(do_sample=False), config)
    order = sorted(first_index, key=lambda pair: pair[0])
    try:
        for key in order:
            _check(manager, key, first_index[key])
        manager.start()
        ids = {key: _add(manager, key, first_index[key]) for key in order}
        outputs = _collect(manager, len(ids), progress_bar)
    finally:
        manager.stop()
    scores = {key: _score(outputs[request_id], len(key[1]), first_index[key]) for key, request_id in ids.items()}
    return [scores[key] for key in keys]


def _key(index: int, pair: Pair) -> Key:
    """The pair as two tuples of ints; ValueError naming the pair when it is not two non-empty id sequences."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(f"pair {index}: expected (context_ids, continuation_ids), got {pair!r}")
    parts = []
    for name, ids in zip(("context", "continuation"), pair, strict=True):
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
            raise ValueError(f"pair {index}: the {name} must be a non-empty list of token ids, got {ids!r}")
        parts.append(tuple(ids))
    return parts[0], parts[1]


def _options(key: Key) -> dict[str, Any]:
    """A score-only request scoring the continuation of `key` with its top-1 (for greediness)."""
    return {"max_new_tokens": 0, "prompt_logprobs": 1, "prompt_logprobs_start": len(key[0])}


def _check(manager: ContinuousBatchingManager, key: Key, index: int) -> None:
    """Raises ValueError naming pair `index` when the engine would refuse it (nothing is queued)."""
    try:
        manager.engine.make_request(list(key[0] + key[1]), f"pair_{index}", **_options(key))
    except ValueError as error:
        raise ValueError(f"pair {index}: {error}") from None


def _add(manager: ContinuousBatchingManager, key: Key, index: int) -> str:
    """Queues pair `index` (`key`); pairs are queued grouped by context, so a context's first pair computes it
    and the others wait for its blocks and take them from the prefix cache."""
    return manager.add_request(list(key[0] + key[1]), f"pair_{index}", **_options(key))


def _collect(manager: ContinuousBatchingManager, count: int, progress_bar: bool) -> dict[str, GenerationOutput]:
    """The final outputs of the `count` requests of `manager`, by request id."""
    outputs: dict[str, GenerationOutput] = {}
    with tqdm(total=count, desc="loglikelihood", unit="pair", disable=not progress_bar) as bar:
        while len(outputs) < count:
            output = manager.get_result(timeout=1.0)
            if output is not None and output.is_finished():
                outputs[output.request_id] = output
                bar.update(1)
    return outputs


def _score(output: GenerationOutput, num_continuation: int, index: int) -> tuple[float, bool]:
    """The pair's (sum of its continuation's logprobs, whether each continuation token is a most likely one)."""
    if output.status != RequestStatus.FINISHED or output.prompt_logprobs is None:
        raise RuntimeError(f"pair {index}: the engine could not score it: {output.error or output.status.name}")
    entries = output.prompt_logprobs[-num_continuation:]
    tokens = output.prompt_ids[-num_continuation:]
    total, greedy = 0.0, True
    for token, entry in zip(tokens, entries, strict=True):
        assert isinstance(entry, PromptLogprob)
        total += entry.logprob
        top_id, top_logprob = entry.top_logprobs[0]
        greedy = greedy and (token == top_id or entry.logprob >= top_logprob)
    return total, greedy
