"""Per-step timings and batch composition, for telemetry: `LLMEngine.step` calls its `step_timer` at each phase.

The default timer does nothing, so an engine nobody observes pays four empty method calls per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from contbatch.engine.batch import SchedulerOutput
    from contbatch.engine.scheduler import Scheduler


class StepRecord(NamedTuple):
    """One step that ran a forward and sampled.

    Attributes:
        start_ns: `time.time_ns()` when the step began (before scheduling).
        scheduled_ns: when the batch was chosen; the forward starts then.
        forwarded_ns: when the forward returned; sampling starts then.
        sampled_ns: when sampling returned.
        num_requests: requests in the batch.
        num_prefill_tokens: tokens computed for requests still computing their prompt (a prompt recomputed after
            preemption included).
        num_decode_tokens: tokens computed for requests past their prompt (one each, usually).
        num_preempted: requests preempted while scheduling this step.
        max_batch_tokens: the step's token budget.
    """

    start_ns: int
    scheduled_ns: int
    forwarded_ns: int
    sampled_ns: int
    num_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    max_batch_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def fill(self) -> float:
        """The share of the token budget the batch used, in [0, 1]."""
        return self.num_tokens / self.max_batch_tokens if self.max_batch_tokens else 0.0


class StepTimer:
    """Observes the phases of each step; this base class ignores them. Called on the engine thread only."""

    def begin(self) -> None:
        """A step begins (before scheduling)."""

    def scheduled(self, scheduler: Scheduler, output: SchedulerOutput) -> None:
        """The step's non-empty batch `output` was chosen by `scheduler`; the forward begins."""

    def forwarded(self) -> None:
        """The forward returned; sampling begins."""

    def sampled(self) -> None:
        """Sampling returned: the step ran (a step whose forward or sampler failed never gets here)."""


NO_STEP_TIMER = StepTimer()


class RecordingStepTimer(StepTimer):
    """Makes a `StepRecord` of every step that samples and hands it to `on_step` (on the engine thread)."""

    def __init__(self, on_step: Callable[[StepRecord], None]) -> None:
        self.on_step = on_step
        self._start = self._scheduled = self._forwarded = 0
        self._counts = (0, 0, 0, 0, 0)

    def begin(self) -> None:
        self._start = time.time_ns()

    def scheduled(self, scheduler: Scheduler, output: SchedulerOutput) -> None:
        self._scheduled = time.time_ns()
        requests = scheduler.requests
        prefill = decode = 0
        for entry in output.requests:
            if entry.num_computed_tokens >= requests[entry.request_id].num_prompt_tokens:
                decode += len(entry.token_ids)
            else:
                prefill += len(entry.token_ids)
        self._counts = (len(output.requests), prefill, decode, len(output.preempted_req_ids),
                        scheduler.max_batch_tokens)

    def forwarded(self) -> None:
        self._forwarded = time.time_ns()

    def sampled(self) -> None:
        self.on_step(StepRecord(self._start, self._scheduled, self._forwarded, time.time_ns(), *self._counts))
