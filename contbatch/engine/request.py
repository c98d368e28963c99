"""`Request`: one prompt's state as it moves through the engine, and its lifecycle `RequestStatus`."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import torch

from contbatch.engine.batch import PromptLogprobsTask, SamplingTarget
from contbatch.engine.logits_processors import TokenHistory
from contbatch.engine.sampling_params import SamplingParams
from contbatch.engine.structured import GrammarMatcher


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Terminal states compare greater than every live state.

    PENDING -> PREFILLING -> DECODING -> FINISHED | FAILED | CANCELLED
    """

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED


@dataclass(eq=False)
class Request:
    """A request's tokens and progress. Owned by the engine thread; clients only ever see `RequestDelta`s.

    `token_ids` holds the prompt followed by the generated tokens. The KV cache holds the first
    `num_computed_tokens` of them; the scheduler moves that counter towards `num_tokens`:

        token_ids:  [ prompt ............ | generated ...... ]
                    [ computed (in cache)     | to compute ]
                                              ^ num_computed_tokens

    A request samples a new token after a step whose forward brings `num_computed_tokens` to `num_tokens`.

    `leader` is set on a request forked from another whose prompt is not computed yet (n samples of one
    prompt): it waits for the leader's prompt, samples its first token from the same logits, then shares the
    leader's blocks (see `Scheduler.fork`).

    `num_prompt_logprobs` counts the prompt logprobs entries already reported (the None of token 0 and of the
    tokens before `params.prompt_logprobs_start` included): a request recomputing its prompt after preemption
    reports only the entries it has not reported yet.

    Async batching (`LLMEngine` with `use_async_batching`) schedules a step while the previous one runs: the
    request's tokens of the steps in flight (`num_in_flight_tokens`) are computed once those end, and the tokens
    they sample (`num_awaited_tokens`) are known then; `next_position` is where its next scheduled token goes.
    Both counters are 0 between steps of a synchronous engine.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    status: RequestStatus = RequestStatus.PENDING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    num_cached_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    leader: Request | None = None
    num_prompt_logprobs: int = 0
    matcher: GrammarMatcher | None = None
    num_in_flight_tokens: int = 0
    num_awaited_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def generated_tokens(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the request asks for prompt logprobs and some are still to be computed (and reported)."""
        return self.params.prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens

    @property
    def first_scored_prompt_token(self) -> int:
        """The prompt index of the next prompt token whose logprob is computed (its logits are those of the
        position before it): the first not reported yet, at least `params.prompt_logprobs_start` and 1."""
        return max(self.num_prompt_logprobs, self.params.prompt_logprobs_start, 1)

    @property
    def next_position(self) -> int:
        """The position of the next token to schedule: after those computed and those of the steps in flight."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def can_schedule_ahead(self) -> bool:
        """Whether a step may compute more of this request while a step computing some of it is in flight: not
        when the awaited token is surely its last (it finishes by length), nor for a beam (its group chooses its
        next token), nor while prompt logprobs are computed (the next chunk's entries depend on those in flight)."""
        if not self.num_in_flight_tokens:
            return True
        if self.needs_prompt_logprobs:
            return False
        last = self.num_generated_tokens + self.num_awaited_tokens >= self.params.max_new_tokens
        return not self.num_awaited_tokens or (not last and self.params.num_beams == 1)

    @property
    def is_score_only(self) -> bool:
        """A request with `max_new_tokens=0`: it computes its prompt (and prompt logprobs) and finishes."""
        return self.params.max_new_tokens == 0

    @property
    def num_tokens_to_compute(self) -> int:
        """How many tokens the cache holds when the request samples its next token (all of them), or, for a
        score-only request, when it finishes: every prompt token but the last, whose logits nothing needs (at
        least one token)."""
        if self.is_score_only:
            return max(self.num_tokens - 1, 1)
        return self.num_tokens

    @property
    def max_cached_tokens(self) -> int:
        """The most leading tokens the prefix cache may supply: at least one token is left to compute, and no
        position whose logits score a prompt logprob still to report comes from the cache (a cached prefix has
        no logits)."""
        limit = self.num_tokens_to_compute - 1
        if self.needs_prompt_logprobs:
            limit = min(limit, self.first_scored_prompt_token - 1)
        return limit

    def prompt_logprobs_task(self, end: int) -> PromptLogprobsTask | None:
        """The prompt logprobs a chunk computing this request's tokens up to `end` (exclusive) produces: the
        entries not reported yet, up to that of prompt token `end` (scored by the chunk's last row) or the
        prompt's end. None when it reports none."""
        if not self.needs_prompt_logprobs:
            return None
        first = self.num_prompt_logprobs
        last = min(end + 1, self.num_prompt_tokens)
        if last <= first:
            return None
        first_scored = min(self.first_scored_prompt_token, last)
        return PromptLogprobsTask(first, first_scored, self.prompt_ids[first_scored:last],
                                  self.params.prompt_logprobs or 0)

    @functools.cached_property
    def sampling_target(self) -> SamplingTarget:
        """How this request samples (its parameters and generator never change)."""
        return SamplingTarget(self.request_id, self.params, self.generator,
                              TokenHistory(self.token_ids, self.num_prompt_tokens), self.matcher)

    def append_token(self, token_id: int) -> None:
        """Records a sampled token and finishes the request if it is a stop token (`SamplingParams.stop_ids`),
        completes its grammar, or is the last one allowed. A token its grammar rejects (which sampling never
        picks) fails the request."""
        self.token_ids.append(token_id)
        if self.matcher is not None and not self.matcher.accept(token_id):
            self.finish(RequestStatus.FAILED, "error", f"the grammar does not allow token {token_id} here")
        elif token_id in self.params.stop_ids or (self.matcher is not None and self.matcher.is_terminated()):
            self.finish(RequestStatus.FINISHED, "stop")
        elif self.num_generated_tokens >= self.params.max_new_tokens:
            self.finish(RequestStatus.FINISHED, "length")
        else:
            self.status = RequestStatus.DECODING

    def tokens_appended_by(self, samplers: tuple[SamplingTarget, ...]) -> int:
        """1 when this request appends the token it samples as one of `samplers` (a beam's group chooses)."""
        return int(bool(samplers) and self.params.num_beams == 1)

    def check_fork_prompt_logprobs(self, child: Request) -> None:
        """Prompt logprobs of a fork of this request: a follower (forked before this request's first token)
        shares its prefill and its entries, so it asks for the same `prompt_logprobs`; a child asking for them
        must be forked before this request computed any of its prompt. Raises ValueError otherwise."""
        asked = child.params.prompt_logprobs
        if self.num_generated_tokens == 0 and self.params.prompt_logprobs != asked:
            raise ValueError(f"request {child.request_id!r}: prompt_logprobs={asked} differs from its parent "
                             f"{self.request_id!r}'s ({self.params.prompt_logprobs}), whose prefill it shares")
        if asked is not None and (self.num_prompt_logprobs or self.num_generated_tokens):
            raise ValueError(f"request {child.request_id!r}: prompt_logprobs={asked} needs a fork made before "
                             f"its parent {self.request_id!r} computed any of its prompt")

    def finish(self, status: RequestStatus, reason: str, error: str | None = None) -> None:
        """Moves to a terminal status. Terminal states never change again: a second call is ignored."""
        if self.is_finished:
            return
        self.status, self.finish_reason, self.error = status, reason, error
