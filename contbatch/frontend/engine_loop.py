"""`EngineLoop`: the one thread that owns the engine. Commands come in through an inbox; each step's deltas go
through the output processor and out through the output router."""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

from contbatch.engine.engine import LLMEngine
from contbatch.engine.openmp import release_thread_pool
from contbatch.engine.outputs import EngineStats, EventType, RequestDelta
from contbatch.engine.request import Request, RequestStatus
from contbatch.frontend.output_processor import OutputProcessor, RequestState
from contbatch.frontend.output_router import OutputRouter
from contbatch.outputs import GenerationOutput
from contbatch.telemetry import MetricsSink, Telemetry, TelemetryRecorder

T = TypeVar("T")


class LoopState(enum.IntEnum):
    """The loop's life; the state only ever increases within a session (`start()` opens a new one)."""

    CREATED = 0
    RUNNING = 1
    STOPPING = 2
    STOPPED = 3
    FAILED = 4


@dataclass(frozen=True)
class AddRequests:
    """Queue `requests[0]` and fork the others from it (n samples of one prompt), reporting through `states`."""

    requests: Sequence[Request]
    states: Sequence[RequestState]


@dataclass(frozen=True)
class CancelRequest:
    request_id: str


@dataclass(frozen=True)
class EngineCall:
    """Run `function(engine)` on the engine thread between two steps (e.g. `LLMEngine.reset_prefix_cache`).

    Without `done` the call is fire-and-forget, and its exception ends the loop (FAILED). With `done` the loop
    sets its result or exception there and goes on; a caller that cancels `done` while still pending is sure the
    call never runs (`EngineLoop.call`)."""

    function: Callable[[LLMEngine], object]
    done: Future[object] | None = None


class Stop:
    pass


Command = AddRequests | CancelRequest | EngineCall | Stop


def _ran(done: Future[object], thread: threading.Thread) -> bool:
    """Waits until the engine call of `done` has run (True), or until `thread` ended without running it (False:
    it is cancelled, so it never will)."""
    while not wait([done], timeout=0.1).done:
        if not thread.is_alive() and done.cancel():
            return False
    return True


class AdmissionGate:
    """Bounds the requests waiting to be admitted (`limit` 0: unbounded). Clients `acquire` a place per request;
    the loop gives it back when the request is first scheduled or ends."""

    def __init__(self, limit: int, timeout: float) -> None:
        self.limit, self.timeout = limit, timeout
        self._condition = threading.Condition()
        self._num_waiting = 0

    def acquire(self, request_id: str) -> None:
        """Takes a place, waiting up to `timeout` seconds; raises RuntimeError when the queue stays full."""
        if not self.limit:
            return
        with self._condition:
            if not self._condition.wait_for(lambda: self._num_waiting < self.limit, self.timeout):
                raise RuntimeError(f"request {request_id!r}: the queue stayed full ({self.limit} waiting requests) "
                                   f"for {self.timeout} s")
            self._num_waiting += 1

    @property
    def num_waiting(self) -> int:
        """Places taken by requests not admitted yet."""
        with self._condition:
            return self._num_waiting

    def release(self, count: int) -> None:
        if count and self.limit:
            with self._condition:
                self._num_waiting -= count
                self._condition.notify_all()


class EngineLoop:
    """Runs `engine_factory()`'s engine on a background thread, one session per `start()`/`stop()`.

    Only the loop's thread touches the engine once started (clients may call `engine.make_request`, which reads
    fixed settings only). Every request gets exactly one terminal output. If the thread dies, every waiter of
    the router gets the error at once. `telemetry` records the requests and steps (off by default).
    """

    def __init__(self, engine_factory: Callable[[], LLMEngine], max_queue_size: int = 0,
                 queue_timeout: float = 60.0, telemetry: TelemetryRecorder | None = None) -> None:
        self.telemetry = telemetry or TelemetryRecorder(Telemetry(), "")
        self._engine_factory = engine_factory
        self._engine: LLMEngine | None = self._new_engine()
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.router = OutputRouter()
        self.processor = OutputProcessor()
        self.gate = AdmissionGate(max_queue_size, queue_timeout)
        self._unadmitted: set[str] = set()
        self._thread: threading.Thread | None = None
        self._keep_engine = False
        self.state = LoopState.CREATED
        self.stats = EngineStats()

    def _new_engine(self) -> LLMEngine:
        engine = self._engine_factory()
        engine.close()  # the model keeps its own attention until start()
        return engine

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("the manager was stopped without keep_for_next_session: call start() again")
        return self._engine

    def is_running(self) -> bool:
        return self.state == LoopState.RUNNING and self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Starts a session (a new engine if the last one was released); does nothing while one runs. Weights
        changed since the previous session are detected on the engine thread before any request of the session
        is admitted (`LLMEngine.check_weights`)."""
        if self._thread is not None and self._thread.is_alive():
            return
        if self._engine is None:
            self._engine = self._new_engine()
        engine = self._engine
        engine.model_runner.attach()
        engine.step_timer = self.telemetry.step_timer()
        self.telemetry.watch(self)
        self.state = LoopState.RUNNING
        threads = torch.get_num_threads()  # OpenMP's thread count is per thread: the engine thread inherits ours
        self._thread = threading.Thread(target=self._run, args=(engine, threads), name="contbatch-engine",
                                        daemon=True)
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_engine: bool = False) -> None:
        """Ends the session: unfinished requests are cancelled. With `keep_engine` the engine and its cache are
        kept for the next `start()`. `block` waits for the thread."""
        if self.state >= LoopState.STOPPING or self._thread is None:
            self.state = max(self.state, LoopState.STOPPED)
            self._release_engine(keep_engine)
            return
        self._keep_engine = keep_engine
        self.state = LoopState.STOPPING
        self._inbox.put(Stop())
        if block:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def add_metrics_sink(self, sink: MetricsSink) -> None:
        """Sends the numbers of later requests and of every step to `sink` too (see `TelemetryRecorder`)."""
        self.telemetry.add_sink(sink)
        if self._engine is not None:
            self._engine.step_timer = self.telemetry.step_timer()

    def submit(self, command: Command) -> None:
        """Queues `command` for the engine thread. The calling thread gives back its OpenMP worker threads
        first (`release_thread_pool`): the engine thread computes meanwhile, and an idle pool elsewhere slows
        every parallel region of its steps."""
        release_thread_pool()
        self._inbox.put(command)

    def call(self, function: Callable[[LLMEngine], T]) -> T | None:
        """Runs `function(engine)` synchronously: returns its result, or raises its exception in the caller.
        While the engine thread lives, the call runs there between two steps (at once if the caller is that
        thread); otherwise (not started, or stopped) on the caller's thread, which must not start the loop
        meanwhile. Returns None without calling `function` when no engine is held (stopped without
        `keep_engine`: the next `start()` makes a new one)."""
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            done: Future[object] = Future()
            self.submit(EngineCall(function, done))
            if _ran(done, thread):
                return cast(T, done.result())
        if self._engine is None:
            return None
        result = function(self._engine)
        self.stats = self._engine.stats()
        return result

    def _run(self, engine: LLMEngine, threads: int) -> None:
        torch.set_num_threads(threads)
        try:
            engine.check_weights()
            while self._apply_commands(engine, block=not engine.has_unfinished_requests()):
                self._publish(engine, engine.step())
                if not engine.has_unfinished_requests():
                    engine.check_integrity()
            self._cancel_all(engine)
            self.state = LoopState.STOPPED
        except BaseException as error:  # the loop itself broke: no waiter may hang on it
            self.state = LoopState.FAILED
            self._fail_all(error)
        finally:
            self.telemetry.unwatch(self)
            self.router.close()
            self._release_engine(self._keep_engine)

    def _apply_commands(self, engine: LLMEngine, block: bool) -> bool:
        """Applies queued commands, waiting for one when `block` (the engine is idle: its thread and async
        batching's forward thread give back their OpenMP worker threads first, so that other threads compute
        undisturbed meanwhile). Returns False on stop."""
        if block:
            engine.release_thread_pools()
        while True:
            try:
                command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if isinstance(command, Stop):
                return False
            self._apply(engine, command)

    def _apply(self, engine: LLMEngine, command: Command) -> None:
        if isinstance(command, AddRequests):
            self._add(engine, command)
        elif isinstance(command, CancelRequest):
            delta = engine.cancel_request(command.request_id)
            self._publish(engine, [delta] if delta is not None else [])
        elif isinstance(command, EngineCall):
            self._call(engine, command)

    def _call(self, engine: LLMEngine, command: EngineCall) -> None:
        """Runs `command` unless its caller cancelled it; a waited-for call's exception goes to its caller."""
        done = command.done
        if done is None:
            command.function(engine)
        elif done.set_running_or_notify_cancel():
            try:
                done.set_result(command.function(engine))
            except BaseException as error:
                done.set_exception(error)
                if not isinstance(error, Exception):
                    raise
        self.stats = engine.stats()

    def _add(self, engine: LLMEngine, command: AddRequests) -> None:
        """Adds the command's requests, all or none: if the engine refuses one, those already added are taken
        back and every request of the command fails with the engine's error."""
        for state in command.states:
            self.processor.add(state)
        first, *forks = command.requests
        added: list[str] = []
        try:
            engine.add(first)
            added.append(first.request_id)
            for request in forks:
                engine.fork(first.request_id, request)
                added.append(request.request_id)
        except ValueError as error:
            for request_id in added:
                engine.cancel_request(request_id)
            self.gate.release(len(command.states))
            self.router.deliver(self.processor.finish(
                [state.request_id for state in command.states], RequestStatus.FAILED, "error", str(error)))
            return
        if self.gate.limit:
            self._unadmitted.update(state.request_id for state in command.states)

    def _publish(self, engine: LLMEngine, deltas: list[RequestDelta]) -> None:
        """Turns deltas into outputs and delivers them; aborts the requests a stop string ended."""
        processed = self.processor.process(deltas)
        orphaned = self.router.deliver(processed.outputs)
        for request_id in processed.stopped + orphaned:
            self.processor.states.pop(request_id, None)
            engine.cancel_request(request_id)
        if self._unadmitted:
            self._release_admitted(deltas)
        self.stats = engine.stats()

    def _release_admitted(self, deltas: list[RequestDelta]) -> None:
        """Gives back the queue places of requests that left the waiting queue (scheduled or ended)."""
        left = {delta.request_id for delta in deltas if delta.request_id in self._unadmitted
                and (delta.is_finished or any(event.type == EventType.SCHEDULED for event in delta.events))}
        self._unadmitted -= left
        self.gate.release(len(left))

    def _cancel_all(self, engine: LLMEngine) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, AddRequests):
                self._add(engine, command)
        self._publish(engine, [delta for rid in list(engine.requests) if (delta := engine.cancel_request(rid))])
        self.router.deliver(self.processor.finish(list(self.processor.states), RequestStatus.CANCELLED,
                                                  "cancelled"))

    def _fail_all(self, error: BaseException) -> None:
        message = f"the engine thread died: {type(error).__name__}: {error}"
        outputs = self.processor.finish(list(self.processor.states), RequestStatus.FAILED, "error", message)
        reported = {output.request_id for output in outputs}
        outputs += [GenerationOutput(rid, status=RequestStatus.FAILED, finish_reason="error", error=message)
                    for rid in self.router.live_ids - reported]
        self.router.deliver(outputs)
        self.router.fail(error)

    def _release_engine(self, keep: bool) -> None:
        if self._engine is None:
            return
        self._engine.close()
        if not keep:
            self._engine = None
