"""`StepPipeline`: runs the engine's steps, schedule -> forward -> sample -> update, one after another or, with
async batching, the next step's host work overlapping the current step's forward."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from contbatch.engine.batch import ScheduledRequest, SchedulerOutput
from contbatch.engine.beam_search import BeamSearch
from contbatch.engine.block_pool import BlockPool
from contbatch.engine.handoff import DrawnStep, PreparedBatch
from contbatch.engine.head_screen import allow_screen
from contbatch.engine.model_runner import ModelRunner
from contbatch.engine.openmp import release_thread_pool
from contbatch.engine.outputs import ModelRunnerOutput, RequestDelta
from contbatch.engine.request import RequestStatus
from contbatch.engine.scheduler import Scheduler
from contbatch.engine.step_timer import StepTimer


@dataclass
class InFlight:
    """A step whose forward runs on the worker thread."""

    output: SchedulerOutput
    logits: Future[torch.Tensor]


def _execute(runner: ModelRunner, output: SchedulerOutput, prepared: PreparedBatch | None) -> torch.Tensor:
    """The runner's forward for a step whose logits go straight to `sample`: plain greedy steps may take the head
    screen."""
    with allow_screen():
        return runner.execute(output, prepared)


class ForwardWorker:
    """Runs the forwards of async batching. On a CPU, where a forward computes as it is called, on one thread of
    its own, with the intra-op thread count of the thread that first submits (torch's count is per thread),
    started on first use; `shutdown` ends it. With `inline` (a CUDA model) on the calling thread: a forward there
    only launches kernels, which the GPU runs while the engine thread goes on with the next step's host work, and
    no second Python thread contends for the GIL (the threaded form measured slower than synchronous steps on an
    H100)."""

    def __init__(self, inline: bool = False) -> None:
        self.inline = inline
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, runner: ModelRunner, output: SchedulerOutput, prepared: PreparedBatch) -> Future[torch.Tensor]:
        if self.inline:
            launched: Future[torch.Tensor] = Future()
            try:
                launched.set_result(_execute(runner, output, prepared))
            except Exception as error:  # a failing forward fails its batch when collected, as on the thread
                launched.set_exception(error)
            return launched
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, "contbatch-forward", initializer=_forward_thread_setup,
                                                initargs=(torch.get_num_threads(), runner.device))
        return self._executor.submit(_execute, runner, output, prepared)

    def release_thread_pool(self) -> None:
        """Gives back the worker thread's OpenMP worker threads (`contbatch.engine.openmp`), once the forwards
        submitted before have run; nothing where no worker thread runs."""
        if self._executor is not None:
            self._executor.submit(release_thread_pool).result()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class StepPipeline:
    """The engine's steps (engine thread only).

    Synchronous (`overlap` False): each `step` schedules a batch, runs its forward, samples and updates its
    requests, and returns their deltas.

    Async batching (`overlap` True): each `step` schedules batch N+1 and builds its inputs while batch N's forward
    runs (on a worker thread on a CPU, on the GPU once launched: `ForwardWorker`); then it samples N, starts N+1's
    forward with the tokens N sampled carried into it on the device (`PreparedBatch.carry`), and only then waits for
    N's tokens on the host (`DrawnStep.resolve`: on a GPU, N+1 is launched before N's tokens reach the host, as in
    vLLM v1's async scheduling) and updates N's requests while N+1 runs. It returns N's deltas, so one step's deltas
    come one `step` call later than synchronously. A request that ends with N (a stop token, a cancel) computed one
    token of N+1 for nothing: its results are dropped, its blocks are free for later steps. Tokens are those of the
    synchronous engine (seeded sampling included), logprobs too up to rounding: only which requests share a batch
    may differ. Requests N+1 cannot continue before N's results are known are left for the step after
    (`Request.can_schedule_ahead`); while beam groups run, steps are synchronous.

    Step timings (`StepTimer`) describe the batch whose forward a step waited for: "scheduled" is when the
    engine thread began waiting for it, having prepared the next.
    """

    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner, beam_search: BeamSearch,
                 block_pool: BlockPool, overlap: bool) -> None:
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.beam_search = beam_search
        self.block_pool = block_pool
        self.overlap = overlap
        self._worker = ForwardWorker(inline=model_runner.device.type == "cuda")
        self._in_flight: InFlight | None = None
        self._undelivered: list[RequestDelta] = []
        self.num_scheduled_tokens_total = 0

    @property
    def is_busy(self) -> bool:
        """Whether a step is in flight or deltas wait for the next `step`."""
        return self._in_flight is not None or bool(self._undelivered)

    def step(self, timer: StepTimer) -> list[RequestDelta]:
        """Runs one step (see the class); returns the deltas of the requests that produced a token or went
        through an event."""
        if self.overlap and not self.beam_search.is_active:
            return self._step_overlapped(timer)
        if self.is_busy:
            self.settle()
            deltas, self._undelivered = self._undelivered, []
            return deltas
        return self._step_sync(timer)

    def settle(self) -> None:
        """Ends the step in flight, if any (waits for its forward, samples, updates its requests); its deltas
        come with the next `step`."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            result = _resolve(self._collect(in_flight))
            self._undelivered += self._update(in_flight.output, result)

    def release_thread_pools(self) -> None:
        """Gives back the OpenMP worker threads of the calling thread and of the forward worker's thread
        (`contbatch.engine.openmp`): for an idle engine, so that other threads compute undisturbed."""
        release_thread_pool()
        self._worker.release_thread_pool()

    def close(self) -> None:
        """Settles and stops the worker thread (a later step starts it again)."""
        self.settle()
        self._worker.shutdown()

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self.scheduler.waiting and self.scheduler.preempt_idle():
            scheduler_output = self.scheduler.schedule()
        self.num_scheduled_tokens_total += scheduler_output.total_num_scheduled_tokens
        return scheduler_output

    def _step_sync(self, timer: StepTimer) -> list[RequestDelta]:
        timer.begin()
        scheduler_output = self._schedule()
        if scheduler_output.is_empty:
            return self.beam_search.update(self._fail_unschedulable(), {})
        timer.scheduled(self.scheduler, scheduler_output)
        try:
            logits = _execute(self.model_runner, scheduler_output, None)
            timer.forwarded()
            runner_output = self.model_runner.sample(logits, scheduler_output)
        except Exception as error:  # a failing batch fails its own requests, never the engine
            return self.beam_search.update(self._fail_batch(scheduler_output.requests, _describe(error)), {})
        timer.sampled()
        deltas = self.scheduler.update_from_output(scheduler_output, runner_output)
        return self.beam_search.update(deltas, runner_output.beam_scores)

    def _step_overlapped(self, timer: StepTimer) -> list[RequestDelta]:
        timer.begin()
        upcoming = self._schedule()
        deltas, self._undelivered = self._undelivered, []
        prepared = None
        if not upcoming.is_empty:
            try:
                prepared = self.model_runner.prepare(upcoming)
            except Exception as error:
                deltas += self._fail_batch(upcoming.requests, _describe(error))
        previous, self._in_flight = self._in_flight, None
        drawn: DrawnStep | str | None = None
        if previous is not None:
            timer.scheduled(self.scheduler, previous.output)
            drawn = self._collect(previous, timer)
        if prepared is not None:
            if isinstance(drawn, DrawnStep):
                prepared.carry(drawn)
            self._in_flight = InFlight(upcoming, self._worker.submit(self.model_runner, upcoming, prepared))
        if previous is not None:
            deltas += self._update(previous.output, _resolve(drawn))
        elif upcoming.is_empty:
            deltas += self._fail_unschedulable()
        return self.beam_search.update(deltas, {})

    def _collect(self, in_flight: InFlight, timer: StepTimer | None = None) -> DrawnStep | str:
        """Waits for the forward of `in_flight` (on a GPU, for its launch) and draws its live targets' tokens; a
        failure's description instead."""
        try:
            logits = in_flight.logits.result()
            if timer is not None:
                timer.forwarded()
            live = [target.request_id in self.scheduler.requests for target in in_flight.output.sampling_targets]
            result = self.model_runner.draw(logits, in_flight.output, live=live)
        except Exception as error:
            return _describe(error)
        if timer is not None:
            timer.sampled()
        return result

    def _update(self, output: SchedulerOutput, result: ModelRunnerOutput | str | None) -> list[RequestDelta]:
        if isinstance(result, ModelRunnerOutput):
            return self.scheduler.update_from_output(output, result)
        return self._fail_batch(output.requests, result or "the step's forward did not run")

    def _fail_batch(self, scheduled: list[ScheduledRequest], error: str) -> list[RequestDelta]:
        """Fails the unfinished requests of `scheduled`."""
        requests = [self.scheduler.requests[entry.request_id] for entry in scheduled
                    if entry.request_id in self.scheduler.requests]
        return self.scheduler.finish_requests(requests, RequestStatus.FAILED, "error", error)

    def _fail_unschedulable(self) -> list[RequestDelta]:
        """With nothing running and the whole cache free, a waiting request that still cannot start never will:
        it fails alone instead of stalling the engine (validation at admission makes this a last resort)."""
        scheduler = self.scheduler
        if scheduler.running or not scheduler.waiting or not self.block_pool.is_whole:
            return []
        request = scheduler.waiting[0]
        return scheduler.finish_requests([request], RequestStatus.FAILED, "error",
                                         f"request {request.request_id!r} cannot fit in the KV cache even alone")


def resolve_async_batching(use_async_batching: bool | None, device: torch.device) -> bool:
    """`ContinuousBatchingConfig.use_async_batching`: True or False as set; None (auto) is on for a model on a CUDA
    device, whose forwards launch on the engine thread (`ForwardWorker(inline=True)`): on an H200 with decode graphs
    it measured 1.6-1.9x the synchronous engine's generated tok/s (docs/performance.md). On a CPU it is off: there
    the host work it hides is about 2% of a step, and its worker thread measured no faster."""
    if use_async_batching is None:
        return device.type == "cuda"
    return use_async_batching


def _forward_thread_setup(num_threads: int, device: torch.device) -> None:
    torch.set_num_threads(num_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _resolve(drawn: DrawnStep | str | None) -> ModelRunnerOutput | str | None:
    """`drawn`'s output on the host, or the description of why there is none."""
    if not isinstance(drawn, DrawnStep):
        return drawn
    try:
        return drawn.resolve()
    except Exception as error:
        return _describe(error)


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"
