"""`ContinuousBatchingManager`: the spec's synchronous client of the engine thread."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from contbatch.frontend.client import DEFAULT_QUEUE_TIMEOUT, EngineClient
from contbatch.outputs import GenerationOutput

__all__ = ["DEFAULT_QUEUE_TIMEOUT", "ContinuousBatchingManager"]


class ContinuousBatchingManager(EngineClient):
    """The spec's manager: `EngineClient` (start, stop, add_request, cancel_request, sleep, wake, ...) plus
    blocking ways to take outputs, usable from any thread. Use it as a context manager for one session."""

    def __enter__(self) -> ContinuousBatchingManager:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def add_requests(self, inputs: Sequence[Sequence[int]], max_new_tokens: int | None = None,
                     streaming: bool = False, record_timestamps: bool = False, **sampling: Any) -> list[str]:
        """`add_request` for each prompt, with generated ids; returns them in order."""
        return [self.add_request(prompt, None, max_new_tokens, streaming, record_timestamps, **sampling)
                for prompt in inputs]

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output of `request_id` (or of any request when None), waiting up to `timeout` seconds.
        Returns None on timeout or when there is nothing more to wait for. Waiting for one request never takes,
        delays or re-queues another's outputs. Raises RuntimeError if the engine thread died."""
        return self._loop.router.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Outputs of any request, as they come, until the manager stops and none are left."""
        router = self._loop.router
        while self.is_running() or router.has_pending():
            output = router.get(None, timeout=0.1)
            if output is not None:
                yield output

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """The outputs of one request; ends by itself after its final output."""
        while (output := self._loop.router.get(request_id)) is not None:
            yield output
            if output.is_finished():
                return
