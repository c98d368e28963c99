"""What leaves the engine: the model runner's output of one step, and the per-request deltas of `step()`.

Both are plain values: no live `Request`, no tensors. The scheduler turns a `ModelRunnerOutput` into
`RequestDelta`s; everything above the engine (the frontend's output processor) builds its results from those.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from contbatch.engine.request import RequestStatus

TopLogprobs = tuple[tuple[int, float], ...]


class PromptLogprob(NamedTuple):
    """One prompt token's entry of `prompt_logprobs` (the first prompt token has no entry: None).

    Attributes:
        logprob: the log-probability of the prompt token given the tokens before it: log_softmax of the model's
            raw logits at the previous position (no temperature, top-k or top-p), in float32.
        top_logprobs: the request's `prompt_logprobs` most likely tokens at that position as (token id,
            log-probability), most likely first; empty for `prompt_logprobs=0`.
    """

    logprob: float
    top_logprobs: TopLogprobs = ()


class EventType(enum.Enum):
    """Moments of a request's life inside the engine."""

    QUEUED = "queued"
    SCHEDULED = "scheduled"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """`type` happened at `timestamp` (`time.time()`)."""

    type: EventType
    timestamp: float


class RequestDelta(NamedTuple):
    """What one request did since its previous delta (immutable: a named tuple, cheap to make every step).

    Attributes:
        request_id: the request.
        status: its status after this step.
        timestamp: `time.time()` when the delta was made (the time its new tokens were produced).
        new_token_ids: tokens generated since the previous delta (0 or 1 per step).
        new_logprobs: their log-probabilities, when the request asked for logprobs; else None.
        new_top_logprobs: for each new token, the request's `top_logprobs` most likely (token id, logprob)
            pairs, most likely first, when asked; else None.
        finish_reason: "stop", "length", "cancelled" or "error" once finished; None before.
        error: the error of a FAILED request.
        num_cached_tokens: prompt tokens that came from the prefix cache (or from the request it was forked from).
        events: what happened to the request since its previous delta, in order.
        weights_version: the engine's weights version when the delta was made.
        new_prompt_logprobs: the prompt logprobs entries computed since the previous delta, in prompt order (the
            first delta's first entry is None, for prompt token 0), when the request asked for prompt logprobs;
            else None. Requests forked from one whose prompt is not computed yet (n samples) get its entries.
        sequence_score: a beam search output's score (`generate`'s `sequences_scores`: the sum of its tokens'
            log-probabilities over its length ** length_penalty); None otherwise.
    """

    request_id: str
    status: RequestStatus
    timestamp: float
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[float, ...] | None = None
    new_top_logprobs: tuple[TopLogprobs, ...] | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    events: tuple[RequestEvent, ...] = ()
    weights_version: int = 0
    new_prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None
    sequence_score: float | None = None

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """The tokens sampled in one step, one row per request that sampled (n samples of a prompt included).

    Attributes:
        request_ids: the sampling requests, in the order of `SchedulerOutput.sampling_targets`.
        sampled_token_ids: the token chosen for each.
        logprobs: for each, the log-probability of its token under the distribution its `logprobs_mode` names;
            None when no row asked.
        top_logprobs: for each, the k most likely (token id, logprob) pairs, k the largest `top_logprobs`
            asked in the step; None when no row asked.
        prompt_logprobs: per request id whose chunk has a `PromptLogprobsTask`, the entries of the task's
            `token_ids`, in order (the None of prompt token 0 is the scheduler's to add).
        beam_scores: per beam (a request with `num_beams > 1`) that computed its last token, its [vocab] float32
            CPU log-probabilities after the logits processors, for its group to rank (its `sampled_token_ids`
            entry is meaningless); they stay inside the engine.
    """

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)
    beam_scores: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load; `is_sleeping` while the KV cache's memory is given back (`sleep()`).
    `num_free_blocks` counts the blocks a request can take (evictable cached ones included); `num_cached_blocks`
    the blocks holding a cached prefix, in use or evictable; `num_touched_blocks` the blocks written at least once
    since the cache was allocated (on CPU, what the cache holds in memory; see `BlockPool.touch_limit`)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    is_sleeping: bool = False
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    num_touched_blocks: int = 0
