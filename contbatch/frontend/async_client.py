"""`AsyncClient`: the engine thread seen from asyncio — `async for choice in client.generate(...)`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from contbatch.frontend.client import EngineClient
from contbatch.frontend.output_processor import RequestIds
from contbatch.outputs import GenerationOutput


@dataclass(frozen=True)
class ChoiceOutput:
    """An output of choice `index` (sample `index` of the prompt) of one generation."""

    index: int
    output: GenerationOutput


class GenerationStream:
    """The outputs of one submitted generation's n choices, interleaved, as an async iterator that ends after
    every choice's final output. `cancel()` (or leaving an `async with` block) cancels the choices still
    running, so their KV blocks are freed."""

    def __init__(self, client: EngineClient, request_id: str, n: int) -> None:
        self.client = client
        self.request_id = request_id
        self.ids = RequestIds.samples(request_id, n)
        self._queue: asyncio.Queue[ChoiceOutput] = asyncio.Queue()
        self._running = set(range(n))
        for index, choice_id in enumerate(self.ids):
            client.register_result_handler(choice_id, self._handler(index))

    def _handler(self, index: int) -> Callable[[GenerationOutput], None]:
        return lambda output: self._queue.put_nowait(ChoiceOutput(index, output))

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> ChoiceOutput:
        if not self._running:
            raise StopAsyncIteration
        choice = await self._queue.get()
        if choice.output.is_finished():
            self._running.discard(choice.index)
        return choice

    def cancel(self) -> None:
        for index in self._running:
            self.client.cancel_request(self.ids[index])
        self._running.clear()

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()


class AsyncClient:
    """An asyncio client of a started `EngineClient` (e.g. a `ContinuousBatchingManager`, which it shares with
    synchronous callers): many coroutines may generate at once on one event loop, each awaiting only its own
    outputs (delivered with `call_soon_threadsafe`, never polled)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        request_id: str | None = None,
        n: int = 1,
        max_new_tokens: int | None = None,
        streaming: bool = True,
        stop: Sequence[str] | None = None,
        detokenize: bool = False,
        **sampling: Any,
    ) -> GenerationStream:
        """Submits `n` samples of `prompt_ids` (one prefill) and returns their stream: with `streaming`, an output
        per step that brings a choice new tokens, else only the final ones. Must be called on the running event
        loop. Arguments are those of `EngineClient.add_request`, whose ValueError / RuntimeError it raises."""
        request_id = self.client.add_request(prompt_ids, request_id, max_new_tokens, streaming=streaming, n=n,
                                             stop=stop, detokenize=detokenize, **sampling)
        return GenerationStream(self.client, request_id, n)

    async def generate(self, prompt_ids: Sequence[int], **options: Any) -> AsyncIterator[ChoiceOutput]:
        """`submit(prompt_ids, **options)`, iterated: yields the choices' outputs as they come; leaving the loop
        early cancels the choices still running."""
        async with self.submit(prompt_ids, **options) as stream:
            async for choice in stream:
                yield choice
