"""`Request`: one prompt's state as it moves through the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from contbatch.outputs import GenerationOutput, RequestStatus
from contbatch.sampling_params import SamplingParams


@dataclass
class Request:
    """A request's tokens and progress.

    `token_ids` holds the prompt followed by the generated tokens. The KV cache holds the first
    `num_computed_tokens` of them; the scheduler moves that counter towards `num_tokens`:

        token_ids:  [ prompt ............ | generated ...... ]
                    [ computed (in cache)     | to compute ]
                                              ^ num_computed_tokens

    A request samples a new token after a step whose forward brings `num_computed_tokens` to `num_tokens`.

    `leader` is set on the other samples of a prompt sampled n times: they wait for the leader's prompt to be
    computed, sample their first token from its logits, then share its blocks (see `Scheduler`).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    record_timestamps: bool = False
    status: RequestStatus = RequestStatus.PENDING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    timestamps: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    created_time: float = field(default_factory=time.time)
    generator: torch.Generator | None = None
    num_reported_tokens: int = 0
    num_cached_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    leader: Request | None = None

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

    def append_token(self, token_id: int, logprob: float | None, now: float,
                     top: list[tuple[int, float]] | None = None) -> None:
        """Records a sampled token (with its logprob and the top alternatives when asked) and finishes the
        request if it is an EOS token or the last one allowed."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
        if self.record_timestamps:
            self.timestamps.append(now)
        if token_id in self.params.eos_token_ids:
            self.finish(RequestStatus.FINISHED, "stop")
        elif self.num_generated_tokens >= self.params.max_new_tokens:
            self.finish(RequestStatus.FINISHED, "length")
        else:
            self.status = RequestStatus.DECODING

    def finish(self, status: RequestStatus, reason: str, error: str | None = None) -> None:
        """Moves to a terminal status. Terminal states never change again: a second call is ignored."""
        if self.is_finished:
            return
        self.status, self.finish_reason, self.error = status, reason, error

    def to_output(self) -> GenerationOutput:
        """A snapshot of the request; `new_tokens` holds what was generated since the previous snapshot."""
        generated = self.generated_tokens
        new_tokens = generated[self.num_reported_tokens:]
        self.num_reported_tokens = len(generated)
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            generated_tokens=generated,
            logprobs=list(self.logprobs) if self.params.wants_logprobs else None,
            top_logprobs=list(self.top_logprobs) if self.params.top_logprobs else None,
            status=self.status,
            finish_reason=self.finish_reason,
            error=self.error,
            created_time=self.created_time,
            timestamps=list(self.timestamps) if self.record_timestamps else None,
            new_tokens=new_tokens,
            num_cached_tokens=self.num_cached_tokens,
        )
