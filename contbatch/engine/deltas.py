"""`DeltaJournal`: what each request has to report since its previous delta (its events and prompt-logprob
entries), and the `RequestDelta` that reports it."""

from __future__ import annotations

import time

from contbatch.engine.outputs import (
    EventType,
    ModelRunnerOutput,
    PromptLogprob,
    RequestDelta,
    RequestEvent,
    TopLogprobs,
)
from contbatch.engine.request import Request


class DeltaJournal:
    """Per request id, the events and prompt-logprob entries not reported yet; each is reported once, by the
    request's next delta."""

    def __init__(self) -> None:
        self._events: dict[str, list[RequestEvent]] = {}
        self._prompt_logprobs: dict[str, list[PromptLogprob | None]] = {}

    def event(self, request_id: str, kind: EventType) -> None:
        """Records that `kind` happened to `request_id` now."""
        self._events.setdefault(request_id, []).append(RequestEvent(kind, time.time()))

    def add_prompt_logprobs(self, request_id: str, entries: list[PromptLogprob | None]) -> None:
        """Queues prompt-logprob entries (in prompt order) for the next delta of `request_id`."""
        self._prompt_logprobs.setdefault(request_id, []).extend(entries)

    def pending(self) -> list[str]:
        """The ids with something to report, each once, in the order they first had it."""
        return list(dict.fromkeys([*self._events, *self._prompt_logprobs]))

    def forget(self, request_id: str) -> None:
        """Drops whatever `request_id` has not reported (it has left)."""
        self._events.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)

    def delta(self, request: Request, now: float, weights_version: int, result: ModelRunnerOutput | None = None,
              row: int = 0) -> RequestDelta:
        """The delta of `request` at `now`: what it has to report (a FINISHED event first recorded if it has
        finished) and, with `result`, the token sampled in `row` with its logprobs as asked."""
        if request.is_finished:
            self.event(request.request_id, EventType.FINISHED)
        params = request.params
        tokens: tuple[int, ...] = ()
        logprobs: tuple[float, ...] | None = () if params.wants_logprobs else None
        top: tuple[TopLogprobs, ...] | None = () if params.top_logprobs else None
        wants_prompt = params.prompt_logprobs is not None
        prompt = self._prompt_logprobs.pop(request.request_id, []) if wants_prompt else []
        if result is not None:
            tokens = (result.sampled_token_ids[row],)
            if logprobs is not None and result.logprobs is not None:
                logprobs = (result.logprobs[row],)
            if top is not None and result.top_logprobs is not None:
                top = (result.top_logprobs[row][:params.top_logprobs],)
        return RequestDelta(
            request.request_id, request.status, now, tokens, logprobs, top, request.finish_reason, request.error,
            request.num_cached_tokens, tuple(self._events.pop(request.request_id, ())), weights_version,
            tuple(prompt) if wants_prompt else None,
        )
