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
        followers: for the index of a request whose prompt this step completes, the other samples of the same
            prompt waiting on it: they sample their first token from its logits and then share its blocks.
        block_copies: `(src, dst)` blocks to copy before the forward (copy-on-write of shared blocks).
        preempted: requests evicted from the cache this step to make room; they wait to be recomputed.
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    sampling: list[bool] = field(default_factory=list)
    followers: dict[int, list[Request]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def sampling_requests(self) -> list[Request]:
        """Every request that samples after this step, each sampling request followed by its followers."""
        return [request for request, _ in self._samplers()]

    @property
    def sampling_rows(self) -> list[int]:
        """For each of `sampling_requests`, the row of the logits it samples from (the model computes one row per
        sampling request of `requests`; followers share their leader's)."""
        return [row for _, row in self._samplers()]

    def _samplers(self) -> list[tuple[Request, int]]:
        samplers: list[tuple[Request, int]] = []
        row = 0
        for index, request in enumerate(self.requests):
            if self.sampling[index]:
                samplers.append((request, row))
                samplers.extend((follower, row) for follower in self.followers.get(index, ()))
                row += 1
        return samplers

    def add(self, request: Request, num_tokens: int, followers: list[Request] | None = None) -> None:
        """Schedules `num_tokens` tokens of `request`, counted from its `num_computed_tokens`."""
        samples = request.num_computed_tokens + num_tokens == request.num_tokens
        if samples and followers:
            self.followers[len(self.requests)] = list(followers)
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)
        self.sampling.append(samples)
