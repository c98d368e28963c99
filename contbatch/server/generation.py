"""One HTTP request's generation: its n choices submitted to the manager and followed as text and logprobs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from contbatch.manager import ContinuousBatchingManager
from contbatch.outputs import GenerationOutput, RequestStatus
from contbatch.server.detokenizer import IncrementalDetokenizer
from contbatch.server.metrics import ServerMetrics
from contbatch.server.protocol import APIError


@dataclass
class ChoiceDelta:
    """What one choice produced since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None = None
    num_generated: int = 0


@dataclass
class Generation:
    """The n choices of one API request, running as n manager requests `<id>-<i>`.

    `deltas()` yields each choice's new text as its tokens arrive, cut at the first stop string (the request is
    then cancelled in the engine). Closing the iterator early (a client that went away) cancels every choice
    still running, so their KV blocks are freed.
    """

    manager: ContinuousBatchingManager
    tokenizer: PreTrainedTokenizerBase
    metrics: ServerMetrics
    request_id: str
    prompt_ids: list[int]
    n: int
    stop: list[str]
    max_tokens: int
    sampling: dict[str, Any]
    _queue: asyncio.Queue[tuple[int, GenerationOutput]] = field(default_factory=asyncio.Queue)
    _running: set[int] = field(default_factory=set)

    def choice_id(self, index: int) -> str:
        """The manager's id of choice `index` (see `ContinuousBatchingManager.add_request`'s `n`)."""
        return self.request_id if self.n == 1 else f"{self.request_id}_{index}"

    def start(self, streaming: bool) -> None:
        """Submits the n choices as n samples of one prompt (its prefill is shared). Raises APIError(400) for
        input the engine rejects."""
        try:
            self.manager.add_request(self.prompt_ids, self.request_id, self.max_tokens,
                                     streaming=streaming or bool(self.stop), record_timestamps=True, n=self.n,
                                     **self.sampling)
            for index in range(self.n):
                self._running.add(index)
                self.manager.register_result_handler(
                    self.choice_id(index), lambda output, index=index: self._queue.put_nowait((index, output))
                )
        except ValueError as error:
            self.cancel()
            raise APIError(400, str(error), code="invalid_request") from None
        except RuntimeError as error:
            self.cancel()
            raise APIError(503, str(error), code="engine_unavailable", kind="server_error") from None
        self.metrics.prompt_tokens.inc(len(self.prompt_ids))

    def cancel(self) -> None:
        for index in self._running:
            self.manager.cancel_request(self.choice_id(index))

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        detokenizers = [IncrementalDetokenizer(self.tokenizer, self.stop) for _ in range(self.n)]
        reported = [0] * self.n
        try:
            while self._running:
                index, output = await self._queue.get()
                if index not in self._running:
                    continue
                if output.status == RequestStatus.FAILED:
                    raise APIError(500, f"generation failed: {output.error}", code="engine_error",
                                   kind="server_error")
                detokenizer = detokenizers[index]
                text = detokenizer.update(output.generated_tokens)
                reason = None
                if detokenizer.stopped:
                    reason = "stop"
                    self.manager.cancel_request(self.choice_id(index))
                elif output.is_finished():
                    text += detokenizer.flush()
                    reason = "length" if output.finish_reason == "length" else "stop"
                if reason is not None:
                    self._running.discard(index)
                    self.metrics.observe_finished(output)
                start, reported[index] = reported[index], len(output.generated_tokens)
                yield ChoiceDelta(index, text, output.generated_tokens[start:],
                                  (output.logprobs or [])[start:], (output.top_logprobs or [])[start:],
                                  reason, len(output.generated_tokens))
        finally:
            self.cancel()
