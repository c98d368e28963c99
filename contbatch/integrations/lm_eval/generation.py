"""Generation for `generate_until`: every request of a call submitted at once to one manager session."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, GenerationOutput, RequestStatus
from contbatch.integrations.lm_eval.conventions import GenerationSettings

_calls = itertools.count()


@dataclass(frozen=True)
class GenerationJob:
    """One `generate_until` request: its (already truncated) prompt ids and its settings."""

    prompt: list[int]
    settings: GenerationSettings


def run_generation(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: ContinuousBatchingConfig,
                   jobs: Sequence[GenerationJob], eos_token_ids: list[int], progress_bar: bool = True
                   ) -> list[list[int]]:
    """The generated token ids of every job, in job order, from one manager session that holds them all.

    Each request stops at one of `eos_token_ids` (kept in its tokens), at one of its stop strings (the manager
    matches them on the detokenized text) or after its `max_new_tokens`. The session stops (cancelling what is
    left) before this returns or raises.

    Raises:
        ValueError: a job the engine refuses (named by its index).
        RuntimeError: a request that failed in the engine (named by its index), or a dead engine thread.
    """
    generation_config = GenerationConfig(do_sample=False, eos_token_id=eos_token_ids, max_new_tokens=256)
    manager = ContinuousBatchingManager(model, generation_config, config, tokenizer=tokenizer)
    call = next(_calls)
    request_ids = [f"lm_eval_{call}_{index}" for index in range(len(jobs))]
    manager.start()
    try:
        for index, (request_id, job) in enumerate(zip(request_ids, jobs, strict=True)):
            try:
                manager.add_request(job.prompt, request_id, job.settings.max_new_tokens, eos_token_id=eos_token_ids,
                                    stop=job.settings.until or None, **job.settings.sampling)
            except ValueError as error:
                raise ValueError(f"generate_until request {index}: {error}") from None
        outputs = _collect(manager, request_ids, progress_bar)
    finally:
        manager.stop()
    return [outputs[request_id].generated_tokens for request_id in request_ids]


def _collect(manager: ContinuousBatchingManager, request_ids: list[str], progress_bar: bool
             ) -> dict[str, GenerationOutput]:
    """The final output of every request, waited for in order; raises RuntimeError on a failed or lost one."""
    outputs: dict[str, GenerationOutput] = {}
    for index, request_id in enumerate(tqdm(request_ids, desc="generate_until", unit="req", disable=not progress_bar)):
        output = manager.get_result(request_id)
        if output is None or output.status != RequestStatus.FINISHED:
            status = "no output" if output is None else f"{output.status.name}: {output.error}"
            raise RuntimeError(f"generate_until request {index} ended with {status}")
        outputs[request_id] = output
    return outputs
