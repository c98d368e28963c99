"""`MetricsSink`: what receives contbatch's numbers (the OpenTelemetry instruments, the server's Prometheus
collectors), and the `RequestSummary` of an ended request."""

from __future__ import annotations

from typing import NamedTuple

from contbatch.engine.step_timer import StepRecord


class RequestSummary(NamedTuple):
    """The numbers of one ended request.

    Attributes:
        operation: its `gen_ai.operation.name` ("text_completion", "chat").
        model: its `gen_ai.request.model`.
        duration: seconds from its arrival to its final output.
        time_per_output_token: seconds per generated token after the first (decode time over output tokens - 1),
            for a request that finished (not cancelled or failed) with at least two tokens; else None.
        input_tokens: its prompt tokens.
        output_tokens: the tokens it generated.
        cached_tokens: its prompt tokens taken from the prefix cache (or shared with the sample it was forked
            from) instead of computed.
        error_type: `error.type` of a failed request; None otherwise.
    """

    operation: str
    model: str
    duration: float
    time_per_output_token: float | None
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    error_type: str | None


class MetricsSink:
    """Receives contbatch's per-request and per-step numbers on the engine thread; this base class ignores them.
    Methods must be quick; an exception is logged once and otherwise ignored."""

    def first_token(self, operation: str, model: str, seconds: float) -> None:
        """A request produced its first token `seconds` after its arrival."""

    def request_ended(self, summary: RequestSummary) -> None:
        """A request gave its final output (finished, cancelled or failed)."""

    def preempted(self) -> None:
        """A request was preempted (its blocks freed; it will recompute its tokens)."""

    def step(self, record: StepRecord) -> None:
        """A step ran a forward and sampled."""
