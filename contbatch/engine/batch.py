"""The hand-off from the scheduler to the model runner: `SchedulerOutput`; and `StepBudget`, what a step may still
schedule while the scheduler fills it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from contbatch.engine.logits_processors import TokenHistory
from contbatch.engine.sampling_params import SamplingParams
from contbatch.engine.structured import GrammarMatcher


@dataclass(frozen=True, slots=True)
class SamplingTarget:
    """A request that samples a token from a row of this step's logits, with its tokens so far (a live view:
    read it during the step only) and, for a structured output, its grammar matcher (engine thread only)."""

    request_id: str
    params: SamplingParams
    generator: torch.Generator | None
    history: TokenHistory | None = None
    matcher: GrammarMatcher | None = None


class PromptLogprobsTask(NamedTuple):
    """The prompt logprobs one scheduled chunk produces: the entries of prompt tokens `first`, `first + 1`, ...

    Attributes:
        first: the prompt index of the chunk's first entry.
        first_scored: the prompt index of `token_ids[0]`; the entries from `first` up to it are None (token 0,
            which nothing precedes, and the tokens before the request's `prompt_logprobs_start`).
        token_ids: the prompt tokens whose logprobs the chunk computes, from prompt index `first_scored` on;
            token i is scored by the logits at position i - 1, which the chunk computes.
        num_top: how many most likely tokens to report with each (the request's `prompt_logprobs`).
    """

    first: int
    first_scored: int
    token_ids: Sequence[int]
    num_top: int


class ScheduledRequest(NamedTuple):
    """One request's share of a step (immutable).

    Attributes:
        request_id: the request.
        token_ids: the tokens this step computes (1 for a request that decodes, up to a whole prompt).
        num_computed_tokens: the position of `token_ids[0]`: how many of its tokens the cache already holds.
        block_tables: one block table per layer group of the cache, covering every token up to the last
            of `token_ids`; read-only, valid until the scheduler's next `update_from_output`.
        samplers: who samples from the logits of its last token: empty when the chunk stops short of the
            request's last token, else the request itself followed by the requests forked from it that wait
            for its prompt (n samples of one prompt share one logits row).
        prompt_logprobs: the prompt logprobs this chunk produces, for a request that asks for them; else None.
        carried: the last of `token_ids` is a placeholder for the token the request samples in the step in
            flight (async batching), filled in once that step has sampled it.
    """

    request_id: str
    token_ids: Sequence[int]
    num_computed_tokens: int
    block_tables: Sequence[list[int]]
    samplers: tuple[SamplingTarget, ...] = ()
    prompt_logprobs: PromptLogprobsTask | None = None
    carried: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's work: which requests run, which of their tokens each computes, and who samples.

    Attributes:
        requests: the scheduled requests, in the order their tokens are packed.
        block_copies: `(src, dst)` blocks to copy before the forward, all read before any is written: copy-on-write
            of shared blocks, and cached blocks whose leading tokens a new request shares (see `PrefixHit`).
        preempted_req_ids: requests evicted from the cache this step to make room; they wait to be recomputed.
    """

    requests: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_scheduled_tokens(self) -> list[int]:
        return [len(scheduled.token_ids) for scheduled in self.requests]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(scheduled.token_ids) for scheduled in self.requests)

    @property
    def sampling_targets(self) -> list[SamplingTarget]:
        """Every request that samples after this step, in logits-row order, followers after their leader."""
        return [target for scheduled in self.requests for target in scheduled.samplers]

    @property
    def sampling_rows(self) -> list[int]:
        """For each of `sampling_targets`, the row of the logits it samples from: the model computes one row
        per scheduled request that samples; requests forked from it share that row."""
        rows: list[int] = []
        for row, scheduled in enumerate(s for s in self.requests if s.samplers):
            rows.extend([row] * len(scheduled.samplers))
        return rows


@dataclass
class StepBudget:
    """The tokens a step may still schedule: `tokens` in all, of which at most `chunk_tokens` for requests that
    compute more than one token (a prompt, whole or a chunk of it, or a sequence recomputed after preemption).
    A request computing one token (a decode) is bounded by `tokens` alone."""

    tokens: int
    chunk_tokens: int

    @classmethod
    def of(cls, max_batch_tokens: int, max_chunk_tokens: int | None) -> StepBudget:
        """A step's whole budget: `max_batch_tokens`, of which `max_chunk_tokens` for chunks (None: no bound)."""
        return cls(max_batch_tokens, max_batch_tokens if max_chunk_tokens is None else min(max_chunk_tokens,
                                                                                             max_batch_tokens))

    def allowance(self, wanted: int) -> int:
        """How many of `wanted` tokens one request may compute this step (0: none)."""
        return max(0, min(wanted, self.tokens, self.chunk_tokens if wanted > 1 else wanted))

    def spend(self, wanted: int, granted: int) -> None:
        """Takes `granted` tokens (from `allowance(wanted)`) of a request that wanted `wanted`."""
        self.tokens -= granted
        if wanted > 1:
            self.chunk_tokens -= granted
