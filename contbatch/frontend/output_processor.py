"""Output processing: per-request deltas of the engine become `GenerationOutput`s, with text and stop strings.

This is the one place where engine deltas are accumulated, detokenized and cut at stop strings, and where
request ids are made. It runs on the engine thread, right after each step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from contbatch.engine.outputs import PromptLogprob, RequestDelta
from contbatch.engine.request import RequestStatus
from contbatch.frontend.detokenizer import IncrementalDetokenizer
from contbatch.outputs import GenerationOutput
from contbatch.telemetry import RequestTelemetry


class RequestIds:
    """Request ids: `req_<n>` for requests submitted without one, `<id>_<j>` for the j-th of n samples."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def new(self) -> str:
        return self.numbered(next(self._counter))

    @staticmethod
    def numbered(index: int) -> str:
        return f"req_{index}"

    @staticmethod
    def samples(request_id: str, n: int) -> list[str]:
        """The ids of the n samples of `request_id`: the id itself when n == 1."""
        return [request_id] if n == 1 else [f"{request_id}_{j}" for j in range(n)]


@dataclass
class RequestState:
    """What the frontend knows of one request: how to report it, and what it produced so far.

    `streaming` requests get an output after every delta that brings tokens (or text); the others get only
    their final output. With a `detokenizer`, outputs carry text, and a stop string ends the request (reason
    "stop") with the text cut before it. Prompt logprobs entries accumulate as their deltas come (a prompt
    computed in chunks sends them chunk by chunk); every output carries those received so far. With `telemetry`,
    each delta is recorded there, and the processor closes it with the final output.
    """

    request_id: str
    prompt_ids: list[int]
    streaming: bool = False
    record_timestamps: bool = False
    detokenizer: IncrementalDetokenizer | None = None
    created_time: float = field(default_factory=time.time)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None
    timestamps: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    weights_version: int = 0
    num_reported: int = 0
    num_chunks_reported: int = 0
    sequence_score: float | None = None
    telemetry: RequestTelemetry | None = None

    def apply(self, delta: RequestDelta) -> GenerationOutput | None:
        """Adds `delta`; returns the output to deliver for it, if any."""
        if self.telemetry is not None:
            self.telemetry.observe(delta)
        new = delta.new_token_ids
        self.generated.extend(new)
        if delta.new_logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(delta.new_logprobs)
        if delta.new_top_logprobs is not None:
            self.top_logprobs = self.top_logprobs if self.top_logprobs is not None else []
            self.top_logprobs.extend(list(top) for top in delta.new_top_logprobs)
        if delta.new_prompt_logprobs is not None:
            self.prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else []
            self.prompt_logprobs.extend(delta.new_prompt_logprobs)
        if self.record_timestamps:
            self.timestamps.extend([delta.timestamp] * len(new))
        self.status, self.finish_reason, self.error = delta.status, delta.finish_reason, delta.error
        self.num_cached_tokens, self.weights_version = delta.num_cached_tokens, delta.weights_version
        self.sequence_score = delta.sequence_score
        if self.detokenizer is not None:
            self._detokenize(self.detokenizer, new, delta.is_finished)
        if self.status.is_finished or (self.streaming and bool(new)):
            return self.output()
        return None

    def _detokenize(self, detokenizer: IncrementalDetokenizer, new: tuple[int, ...], finished: bool) -> None:
        detokenizer.update(new)
        if detokenizer.stopped:
            self.status, self.finish_reason, self.error = RequestStatus.FINISHED, "stop", None
        elif finished:
            detokenizer.flush()

    def output(self) -> GenerationOutput:
        """A snapshot; `new_tokens` and `new_text` hold what came since the previous snapshot."""
        new_tokens = self.generated[self.num_reported:]
        self.num_reported = len(self.generated)
        text, new_text = None, ""
        if self.detokenizer is not None:
            chunks = self.detokenizer.chunks
            text, new_text = self.detokenizer.text, "".join(chunks[self.num_chunks_reported:])
            self.num_chunks_reported = len(chunks)
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            generated_tokens=list(self.generated),
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            top_logprobs=list(self.top_logprobs) if self.top_logprobs is not None else None,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            status=self.status,
            finish_reason=self.finish_reason,
            error=self.error,
            created_time=self.created_time,
            timestamps=list(self.timestamps) if self.record_timestamps else None,
            new_tokens=new_tokens,
            num_cached_tokens=self.num_cached_tokens,
            text=text,
            new_text=new_text,
            weights_version=self.weights_version,
            sequence_score=self.sequence_score,
        )


@dataclass
class ProcessedOutputs:
    """One step's outputs, and the requests a stop string ended (the engine must abort them)."""

    outputs: list[GenerationOutput] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)


class OutputProcessor:
    """Keeps a `RequestState` per live request and applies the engine's deltas to it.

    Deltas of ids it does not know (never registered, or already ended by a stop string) are ignored. A state
    is dropped with its request's final output.
    """

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state

    def process(self, deltas: Iterable[RequestDelta]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        for delta in deltas:
            state = self.states.get(delta.request_id)
            if state is None:
                continue
            output = state.apply(delta)
            if output is None:
                continue
            result.outputs.append(output)
            if output.is_finished():
                del self.states[delta.request_id]
                if state.telemetry is not None:
                    state.telemetry.finish(output)
                if not delta.is_finished:
                    result.stopped.append(delta.request_id)
        return result

    def finish(self, request_ids: Iterable[str], status: RequestStatus, reason: str,
               error: str | None = None) -> list[GenerationOutput]:
        """Ends the live requests among `request_ids` with `status` (the engine stopped, died, or refused them);
        returns their final outputs."""
        outputs = []
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                state.status, state.finish_reason, state.error = status, reason, error
                outputs.append(state.output())
                if state.telemetry is not None:
                    state.telemetry.finish(outputs[-1])
        return outputs


class OutputCollector:
    """Accumulates the deltas of an `LLMEngine` stepped by hand into outputs (its prompts are not known to it:
    `prompt_ids` stay empty). `finished` holds the final output of every request that ended."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}
        self.finished: dict[str, GenerationOutput] = {}

    def add(self, deltas: Iterable[RequestDelta]) -> list[GenerationOutput]:
        """Applies one step's deltas; returns the outputs of the requests that ended in it."""
        ended = []
        for delta in deltas:
            state = self.states.setdefault(delta.request_id, RequestState(delta.request_id, [],
                                                                            record_timestamps=True))
            output = state.apply(delta)
            if output is not None and output.is_finished():
                del self.states[delta.request_id]
                self.finished[delta.request_id] = output
                ended.append(output)
        return ended
