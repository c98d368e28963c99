"""`ContinuousBatchingManager`: the engine on a background thread, fed and drained through thread-safe queues."""

from __future__ import annotations

import asyncio
import enum
import itertools
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from contbatch.config import ContinuousBatchingConfig
from contbatch.engine.engine import LLMEngine
from contbatch.engine.request import Request
from contbatch.output_router import OutputRouter, ResultHandler
from contbatch.outputs import GenerationOutput, RequestStatus

DEFAULT_QUEUE_TIMEOUT = 60.0


class ManagerState(enum.IntEnum):
    """The manager's life; the state only ever increases within a session (start() opens a new one)."""

    CREATED = 0
    RUNNING = 1
    STOPPING = 2
    STOPPED = 3
    FAILED = 4


@dataclass(frozen=True)
class _Add:
    request: Request
    streaming: bool
    leader: Request | None = None


@dataclass(frozen=True)
class _Cancel:
    request_id: str


class _Stop:
    pass


class _ResetPrefixCache:
    pass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine, published by the engine thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


class ContinuousBatchingManager:
    """Continuous batching on a background thread that alone owns the engine; every other thread talks to it
    through queues, so every public method is thread safe.

    Requests may be added before `start()`; they run once it is called. `stop()` ends the session: requests
    still unfinished get a CANCELLED output with their tokens so far, and adding a request raises until
    `start()` is called again. Every request gets exactly one terminal output (FINISHED, FAILED or CANCELLED).
    If the engine thread dies, every waiter gets the error at once.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
    ) -> None:
        """`queue_timeout`: how long `add_request` waits for room when `max_queue_size` requests are waiting."""
        self.model = model
        self.generation_config = generation_config or model.generation_config
        self.config = continuous_batching_config or ContinuousBatchingConfig()
        self.queue_timeout = queue_timeout
        self._engine: LLMEngine | None = self._new_engine()
        self._inbox: queue.SimpleQueue[_Add | _Cancel | _Stop | _ResetPrefixCache] = queue.SimpleQueue()
        self._router = OutputRouter()
        self._thread: threading.Thread | None = None
        self._state = ManagerState.CREATED
        self._keep_engine = False
        self._ids = itertools.count()
        self._room = threading.Condition()
        self._num_queued = 0
        self.stats = EngineStats()

    def _new_engine(self) -> LLMEngine:
        engine = LLMEngine(self.model, self.generation_config, self.config)
        engine.close()  # the model keeps its own attention until start()
        return engine

    @property
    def engine(self) -> LLMEngine:
        """The engine. While the manager runs, only the engine thread may change it; other threads may only
        call its `make_request`."""
        if self._engine is None:
            raise RuntimeError("the manager was stopped without keep_for_next_session: call start() again")
        return self._engine

    # --- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the background thread (a new session after `stop`); does nothing if it is running."""
        if self._thread is not None and self._thread.is_alive():
            return
        if self._engine is None:
            self._engine = self._new_engine()
        engine = self._engine
        engine.check_weights()
        engine.model_runner.attach()
        self._state = ManagerState.RUNNING
        threads = torch.get_num_threads()  # OpenMP's thread count is per thread: the engine thread inherits ours
        self._thread = threading.Thread(target=self._run, args=(engine, threads), name="contbatch-engine",
                                        daemon=True)
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False) -> None:
        """Ends the session: unfinished requests are cancelled. With `keep_for_next_session` the engine and its
        cache are kept for the next `start()`; otherwise they are released. `block` waits for the thread."""
        if self._state >= ManagerState.STOPPING or self._thread is None:
            self._state = max(self._state, ManagerState.STOPPED)
            self._release_engine(keep_for_next_session)
            return
        self._keep_engine = keep_for_next_session
        self._state = ManagerState.STOPPING
        self._inbox.put(_Stop())
        if block:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Waits for the background thread to finish (at most `timeout` seconds)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def is_running(self) -> bool:
        return self._state == ManagerState.RUNNING and self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> ContinuousBatchingManager:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- requests --------------------------------------------------------------------------------------------

    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        n: int = 1,
        **sampling: Any,
    ) -> str:
        """Submits a request; returns its id. A streaming request gets an output after every token, the others
        one final output. `sampling` overrides the generation config for this request (`do_sample`,
        `temperature`, `top_k`, `top_p`, `seed`, `logprobs`, `top_logprobs`).

        With `n > 1`, n samples of the prompt run as requests `<id>_0` ... `<id>_<n-1>` (sample j seeded with
        `seed + j` when a seed is given); the prompt is computed once, and the samples share its KV blocks (a
        partly filled last block is copied when a sample first writes into it). Raises
        ValueError for bad input or a duplicate id, RuntimeError after `stop()` or when the queue stays full for
        `queue_timeout` seconds."""
        if self._state >= ManagerState.STOPPING:
            raise RuntimeError("the manager is stopped: call start() before adding requests")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        request_id = f"req_{next(self._ids)}" if request_id is None else request_id
        seed = sampling.pop("seed", None)
        ids = [request_id] if n == 1 else [f"{request_id}_{j}" for j in range(n)]
        requests = [self.engine.make_request(input_ids, rid, max_new_tokens, record_timestamps,
                                             eos_token_id=eos_token_id, seed=None if seed is None else seed + j,
                                             **sampling) for j, rid in enumerate(ids)]
        opened: list[str] = []
        reserved = 0
        try:
            for rid in ids:
                self._router.open(rid)
                opened.append(rid)
                self._wait_for_room(rid)
                reserved += 1
        except (ValueError, RuntimeError):
            for rid in opened:
                self._router.discard(rid)
            self._release_room(reserved)
            raise
        for j, request in enumerate(requests):
            self._inbox.put(_Add(request, streaming, requests[0] if j else None))
        return request_id

    def add_requests(self, inputs: Sequence[Sequence[int]], max_new_tokens: int | None = None,
                     streaming: bool = False, record_timestamps: bool = False, **sampling: Any) -> list[str]:
        """`add_request` for each prompt, with generated ids; returns them in order."""
        return [self.add_request(prompt, None, max_new_tokens, streaming, record_timestamps, **sampling)
                for prompt in inputs]

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (call it after changing the weights in place while the manager runs;
        weight changes between sessions are detected by `start()`)."""
        self._inbox.put(_ResetPrefixCache())

    def cancel_request(self, request_id: str) -> None:
        """Cancels a request: it gets a CANCELLED output with its tokens so far and its blocks are freed. An
        unknown or finished id is ignored."""
        self._inbox.put(_Cancel(request_id))

    def _wait_for_room(self, request_id: str) -> None:
        limit = self.config.max_queue_size
        if not limit:
            return
        with self._room:
            if not self._room.wait_for(lambda: self._num_queued < limit, self.queue_timeout):
                raise RuntimeError(f"request {request_id!r}: the queue stayed full ({limit} waiting requests) "
                                   f"for {self.queue_timeout} s")
            self._num_queued += 1

    # --- results ---------------------------------------------------------------------------------------------

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output of `request_id` (or of any request when None), waiting up to `timeout` seconds.
        Returns None on timeout or when there is nothing more to wait for. Waiting for one request never takes,
        delays or re-queues another's outputs. Raises RuntimeError if the engine thread died."""
        return self._router.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Outputs of any request, as they come, until the manager stops and none are left."""
        while self.is_running() or self._router.has_pending():
            output = self._router.get(None, timeout=0.1)
            if output is not None:
                yield output

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """The outputs of one request; ends by itself after its final output."""
        while (output := self._router.get(request_id)) is not None:
            yield output
            if output.is_finished():
                return

    def register_result_handler(self, request_id: str, callback: ResultHandler) -> None:
        """Calls `callback(output)` on the running asyncio loop of the caller, through `call_soon_threadsafe`,
        for each output of `request_id` (each token when streaming, else the final one); dropped after the
        final output. Must be called from inside a running event loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("register_result_handler must be called from a running asyncio event loop") from None
        self._router.register_handler(request_id, loop, callback)

    # --- the engine thread -----------------------------------------------------------------------------------

    def _run(self, engine: LLMEngine, threads: int) -> None:
        torch.set_num_threads(threads)
        streaming: set[str] = set()
        unadmitted: dict[str, Request] = {}
        try:
            while not self._drain_inbox(engine, streaming, unadmitted):
                produced = engine.step()
                self._router.deliver([r.to_output() for r in produced if r.is_finished or r.request_id in streaming])
                streaming.difference_update(r.request_id for r in produced if r.is_finished)
                self.stats = _snapshot(engine)
                self._release_admitted(unadmitted)
                if not engine.has_unfinished_requests():
                    engine.check_integrity()
            self._cancel_all(engine)
            self._state = ManagerState.STOPPED
        except BaseException as error:  # the loop itself broke: no waiter may hang on it
            self._state = ManagerState.FAILED
            self._fail_all(error)
        finally:
            self._router.close()
            self._release_engine(self._keep_engine)

    def _drain_inbox(self, engine: LLMEngine, streaming: set[str], unadmitted: dict[str, Request]) -> bool:
        """Applies queued commands, waiting for one when the engine is idle. Returns True on stop."""
        block = not engine.has_unfinished_requests()
        while True:
            try:
                command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return False
            block = False
            if isinstance(command, _Stop):
                return True
            if isinstance(command, _Add):
                engine.add(command.request, command.leader)
                if self.config.max_queue_size:
                    unadmitted[command.request.request_id] = command.request
                if command.streaming:
                    streaming.add(command.request.request_id)
            elif isinstance(command, _ResetPrefixCache):
                engine.reset_prefix_cache()
            else:
                request = engine.cancel_request(command.request_id)
                if request is not None:
                    self._router.deliver([request.to_output()])
                    self._release_admitted(unadmitted)

    def _release_admitted(self, unadmitted: dict[str, Request]) -> None:
        """Frees queue room for requests that left the waiting queue (admitted, finished or cancelled)."""
        if not unadmitted:
            return
        left = [rid for rid, request in unadmitted.items() if request.status != RequestStatus.PENDING]
        for rid in left:
            del unadmitted[rid]
        self._release_room(len(left))

    def _release_room(self, count: int) -> None:
        if count and self.config.max_queue_size:
            with self._room:
                self._num_queued -= count
                self._room.notify_all()

    def _cancel_all(self, engine: LLMEngine) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                engine.add(command.request)
        cancelled = [engine.cancel_request(rid) for rid in list(engine.requests)]
        self._router.deliver([request.to_output() for request in cancelled if request is not None])

    def _fail_all(self, error: BaseException) -> None:
        now = time.time()
        self._router.deliver([
            GenerationOutput(rid, status=RequestStatus.FAILED, finish_reason="error", created_time=now,
                             error=f"the engine thread died: {type(error).__name__}: {error}")
            for rid in self._router.live_ids
        ])
        self._router.fail(error)

    def _release_engine(self, keep: bool) -> None:
        if self._engine is None:
            return
        self._engine.close()
        if not keep:
            self._engine = None


def _snapshot(engine: LLMEngine) -> EngineStats:
    pool = engine.block_pool
    return EngineStats(len(engine.scheduler.running), len(engine.scheduler.waiting),
                       1.0 - pool.num_free_blocks / pool.num_blocks)
