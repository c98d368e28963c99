"""The hand-off from the scheduler to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from contbatch.engine.request import Request


@dataclass
class SchedulerOutput:
    """One step's work: which requests run and how many of their tokens each computes.

    Attributes:
        requests: the requests of the batch, in the order their tokens are packed.
        num_scheduled_tokens: for each request, how many tokens this step computes, starting at its
            `num_computed_tokens` (1 for a request that decodes, up to a whole prompt for one that prefills).
        sampling: for each request, whether it samples a token after this step (its chunk reaches its last
            token; a prompt chunk that stops short of it does not sample).
        preempted: requests evicted from the cache this step to make room; they wait to be recomputed.
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    sampling: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def sampling_requests(self) -> list[Request]:
        return [request for request, samples in zip(self.requests, self.sampling, strict=True) if samples]

    def add(self, request: Request, num_tokens: int) -> None:
        """Schedules `num_tokens` tokens of `request`, counted from its `num_computed_tokens`."""
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)
        self.sampling.append(request.num_computed_tokens + num_tokens == request.num_tokens)
