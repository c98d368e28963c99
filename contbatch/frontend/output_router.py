"""`OutputRouter`: hands each output of the engine thread to exactly one consumer, in any thread or event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

from contbatch.outputs import GenerationOutput

ResultHandler = Callable[[GenerationOutput], object]


class OutputRouter:
    """Per-request output queues behind one condition variable.

    Contract:
      - every output is delivered once: to the request's registered handler (on the handler's event loop,
        through `call_soon_threadsafe`), else to whoever takes it with `get`;
      - `get(request_id)` takes only that request's outputs, never stealing or re-queuing others';
        `get(None)` takes outputs of any request in production order;
      - once `fail` is called, every waiter wakes up: `get` raises instead of blocking;
      - once `close` is called, `get` returns None instead of blocking when nothing is left.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._pending: dict[str, deque[GenerationOutput]] = {}
        self._order: deque[str] = deque()
        self._handlers: dict[str, tuple[asyncio.AbstractEventLoop, ResultHandler]] = {}
        self._live: set[str] = set()
        self._fatal: BaseException | None = None
        self._closed = False

    def open(self, request_id: str) -> None:
        """Registers a new request id. Raises ValueError if that id is still live (a duplicate)."""
        with self._condition:
            if request_id in self._live:
                raise ValueError(f"request {request_id!r}: a request with this id is already running")
            self._live.add(request_id)
            self._closed = False

    def discard(self, request_id: str) -> None:
        """Forgets a request id that was opened but never submitted."""
        with self._condition:
            self._live.discard(request_id)

    @property
    def live_ids(self) -> set[str]:
        with self._condition:
            return set(self._live)

    def deliver(self, outputs: list[GenerationOutput]) -> list[str]:
        """Routes one step's outputs and wakes the waiters. Returns the ids of live requests nobody can receive
        any more (their handler's event loop is closed): the caller should cancel them. Their handlers are
        dropped and their outputs discarded."""
        orphaned: list[str] = []
        if not outputs:
            return orphaned
        with self._condition:
            for output in outputs:
                handler = self._handlers.get(output.request_id)
                if handler is not None:
                    loop, callback = handler
                    try:
                        loop.call_soon_threadsafe(callback, output)
                    except RuntimeError:  # the handler's event loop is closed
                        self._handlers.pop(output.request_id)
                        self._live.discard(output.request_id)
                        if not output.is_finished():
                            orphaned.append(output.request_id)
                        continue
                else:
                    self._pending.setdefault(output.request_id, deque()).append(output)
                    self._order.append(output.request_id)
                if output.is_finished():
                    self._live.discard(output.request_id)
                    self._handlers.pop(output.request_id, None)
            self._condition.notify_all()
        return orphaned

    def register_handler(self, request_id: str, loop: asyncio.AbstractEventLoop, callback: ResultHandler) -> None:
        """Sends `request_id`'s outputs to `callback` on `loop` from now on, starting with any already waiting.
        The handler is dropped after the request's final output."""
        with self._condition:
            waiting = self._pending.pop(request_id, deque())
            for output in waiting:
                loop.call_soon_threadsafe(callback, output)
            if request_id in self._live:
                self._handlers[request_id] = (loop, callback)

    def get(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of `request_id`, or of any request), waiting up to `timeout` seconds (None: no limit).
        Returns None on timeout, for an id that is neither live nor has outputs waiting, or when the router is
        closed and nothing is left. Raises RuntimeError once the engine thread has failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while True:
                output = self._take(request_id)
                if output is not None:
                    return output
                if self._fatal is not None:
                    raise RuntimeError(f"the engine thread died: {self._fatal!r}") from self._fatal
                if request_id is not None and request_id not in self._live:
                    return None
                if self._closed and (request_id is None and not self._live):
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._condition.wait(remaining)

    def has_pending(self) -> bool:
        with self._condition:
            return any(self._pending.values())

    def _take(self, request_id: str | None) -> GenerationOutput | None:
        if request_id is not None:
            queue = self._pending.get(request_id)
            output = queue.popleft() if queue else None
            if len(self._order) > 64 + 4 * sum(map(len, self._pending.values())):
                self._compact_order()
        else:
            output = None
            while self._order and output is None:
                queue = self._pending.get(self._order.popleft())
                output = queue.popleft() if queue else None
        if output is not None and not self._pending[output.request_id]:
            del self._pending[output.request_id]
        return output

    def _compact_order(self) -> None:
        """Drops the order entries of outputs already taken by `get(request_id)`. Those were each request's
        oldest outputs, so a request's valid entries are its last `len(pending)` ones."""
        remaining = {request_id: len(queue) for request_id, queue in self._pending.items()}
        kept: deque[str] = deque()
        for request_id in reversed(self._order):
            if remaining.get(request_id, 0) > 0:
                remaining[request_id] -= 1
                kept.appendleft(request_id)
        self._order = kept

    def fail(self, error: BaseException) -> None:
        """Records the engine thread's fatal error and wakes every waiter."""
        with self._condition:
            self._fatal = error
            self._condition.notify_all()

    def close(self) -> None:
        """No more outputs will come for requests that are not live: waiters for them stop blocking."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
