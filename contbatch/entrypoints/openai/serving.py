"""What every generation endpoint shares: the server's state, submitting a request through the asyncio client,
and answering it as one JSON body or as server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from contbatch.entrypoints.openai.formatting import ChoiceDelta, Formatter, usage
from contbatch.entrypoints.openai.metrics import ServerMetrics
from contbatch.entrypoints.openai.protocol import LOGPROB_FLOOR, APIError, SamplingFields
from contbatch.frontend.async_client import AsyncClient, GenerationStream
from contbatch.frontend.client import EngineClient
from contbatch.outputs import RequestStatus

DISCONNECT_POLL_SECONDS = 0.5


@dataclass
class ServerState:
    """What the routes share, kept on `app.state.contbatch`."""

    client: EngineClient
    async_client: AsyncClient
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    api_key: str | None
    max_body_bytes: int
    metrics: ServerMetrics


def server_state(request: Request) -> ServerState:
    return request.app.state.contbatch


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       code="model_not_found", param="model")


@dataclass(frozen=True)
class GenerationRequest:
    """One API call's generation, in engine terms."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    logprobs: bool
    top_logprobs: int
    chat: bool


async def respond(state: ServerState, http: Request, body: SamplingFields, call: GenerationRequest) -> Response:
    """Runs `call` and answers it (SSE when `body.stream`). A client that disconnects has its choices cancelled."""
    stream = _submit(state, body, call)
    formatter = Formatter(state.tokenizer, state.model_name, call.request_id, call.chat, call.logprobs)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_events(stream, formatter, len(call.prompt_ids), include_usage, state.metrics),
                                 media_type="text/event-stream")
    collecting = asyncio.ensure_future(_collect(stream, formatter, len(call.prompt_ids), state.metrics))
    while not collecting.done():
        await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_SECONDS)
        if not collecting.done() and await http.is_disconnected():
            collecting.cancel()
            stream.cancel()
            return Response(status_code=499)
    return JSONResponse(collecting.result())


def _submit(state: ServerState, body: SamplingFields, call: GenerationRequest) -> GenerationStream:
    temperature = 1.0 if body.temperature is None else body.temperature
    sampling: dict[str, Any] = {"do_sample": temperature > 0, "temperature": temperature if temperature > 0 else 1.0,
                                "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                                "logprobs": call.logprobs, "top_logprobs": call.top_logprobs,
                                "logprobs_mode": body.logprobs_mode}
    try:
        stream = state.async_client.submit(call.prompt_ids, request_id=call.request_id, n=body.n,
                                     max_new_tokens=call.max_tokens, streaming=body.stream,
                                     stop=body.stop_strings(), detokenize=True, record_timestamps=True, **sampling)
    except ValueError as error:
        raise APIError(400, str(error), code="invalid_request") from None
    except RuntimeError as error:
        raise APIError(503, str(error), code="engine_unavailable", kind="server_error") from None
    state.metrics.prompt_tokens.inc(len(call.prompt_ids))
    return stream


async def _deltas(stream: GenerationStream, metrics: ServerMetrics) -> AsyncIterator[ChoiceDelta]:
    """The stream's outputs as OpenAI choice deltas; a failed choice raises APIError(500)."""
    async with stream:
        async for choice in stream:
            output = choice.output
            if output.status == RequestStatus.FAILED:
                raise APIError(500, f"generation failed: {output.error}", code="engine_error", kind="server_error")
            reason = None
            if output.is_finished():
                reason = "length" if output.finish_reason == "length" else "stop"
                metrics.observe_finished(output)
            yield _finite(ChoiceDelta.of(choice.index, output, reason))


def _finite(delta: ChoiceDelta) -> ChoiceDelta:
    """`delta` with every -inf log-probability (a token top-k or top-p removed, in "processed" mode) raised to
    LOGPROB_FLOOR, as vLLM does: JSON has no infinity."""
    values = [*delta.logprobs, *(lp for top in delta.top_logprobs for _, lp in top)]
    if all(lp != float("-inf") for lp in values):
        return delta
    return dataclasses.replace(
        delta, logprobs=[max(lp, LOGPROB_FLOOR) for lp in delta.logprobs],
        top_logprobs=[[(i, max(lp, LOGPROB_FLOOR)) for i, lp in top] for top in delta.top_logprobs])


async def _collect(stream: GenerationStream, formatter: Formatter, prompt_tokens: int,
                   metrics: ServerMetrics) -> dict[str, Any]:
    choices: dict[int, dict[str, Any]] = {}
    generated = 0
    async for delta in _deltas(stream, metrics):
        choice = choices.setdefault(delta.index, formatter.empty_choice(delta.index))
        formatter.extend(choice, delta)
        if delta.finish_reason is not None:
            generated += delta.num_generated
    return formatter.response([choices[i] for i in sorted(choices)], prompt_tokens, generated)


async def _events(stream: GenerationStream, formatter: Formatter, prompt_tokens: int, include_usage: bool,
                  metrics: ServerMetrics) -> AsyncIterator[str]:
    generated = 0
    if formatter.chat:
        for index in range(len(stream.ids)):
            yield _event(formatter.chunk(index, {"role": "assistant", "content": ""}, None, None))
    try:
        async for delta in _deltas(stream, metrics):
            if delta.finish_reason is not None:
                generated += delta.num_generated
            if delta.text or delta.finish_reason is not None:
                yield _event(formatter.delta_chunk(delta))
    except APIError as error:
        yield _event(error.body())
    if include_usage:
        yield _event({**formatter.header(chunk=True), "choices": [], "usage": usage(prompt_tokens, generated)})
    yield "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
