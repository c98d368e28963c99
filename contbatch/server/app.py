"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health and /metrics."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from transformers import PreTrainedTokenizerBase

from contbatch.manager import ContinuousBatchingManager
from contbatch.server.generation import ChoiceDelta, Generation
from contbatch.server.metrics import ServerMetrics
from contbatch.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 1024
DISCONNECT_POLL_SECONDS = 0.5


@dataclass
class ServerState:
    manager: ContinuousBatchingManager
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    api_key: str | None
    max_body_bytes: int
    metrics: ServerMetrics


def create_app(manager: ContinuousBatchingManager, tokenizer: PreTrainedTokenizerBase, model_name: str,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app serving `manager` (already started) under the model id `model_name`. With `api_key`, every /v1
    route requires `Authorization: Bearer <api_key>`."""
    state = ServerState(manager, tokenizer, model_name, api_key, max_body_bytes, ServerMetrics(manager))
    app = FastAPI(title="contbatch", version="0.1.0")
    ids = itertools.count()

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > state.max_body_bytes):
            return _error(APIError(413, f"request body of {length} bytes exceeds the limit of "
                                        f"{state.max_body_bytes} bytes", code="request_too_large"))
        if state.api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                return _error(APIError(401, "missing or wrong API key", code="invalid_api_key",
                                       kind="authentication_error"))
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return _error(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        if any(problem.get("type") == "json_invalid" for problem in problems):
            return _error(APIError(400, "the request body is not valid JSON", code="invalid_json"))
        first = problems[0] if problems else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return _error(APIError(422, f"{where}: {first.get('msg', 'invalid value')}", param=where or None,
                               code="invalid_value"))

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = state.manager.is_running()
        return JSONResponse({"status": "ok" if alive else "engine not running"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state.model_name)]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return _model_card(model_id)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        prompt_ids = body.prompt if isinstance(body.prompt, list) else state.tokenizer(body.prompt)["input_ids"]
        logprobs = body.logprobs is not None
        return await _respond(state, request, body, f"cmpl-{next(ids)}", list(prompt_ids),
                              body.max_tokens or DEFAULT_COMPLETION_TOKENS, logprobs, body.logprobs or 0, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        messages = [message.model_dump() for message in body.messages]
        prompt_ids = _as_ids(state.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        max_tokens = body.max_completion_tokens or body.max_tokens or _default_chat_tokens(state, len(prompt_ids))
        return await _respond(state, request, body, f"chatcmpl-{next(ids)}", prompt_ids, max_tokens,
                              body.logprobs, body.top_logprobs or 0, chat=True)

    return app


def _error(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _model_card(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "contbatch"}


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       code="model_not_found", param="model")


def _default_chat_tokens(state: ServerState, prompt_len: int) -> int:
    """DEFAULT_CHAT_TOKENS, or fewer when the model's positions end sooner."""
    positions = state.manager.engine.max_position_embeddings
    return DEFAULT_CHAT_TOKENS if positions is None else max(1, min(DEFAULT_CHAT_TOKENS, positions - prompt_len))


def _as_ids(encoded: Any) -> list[int]:
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return list(ids)


async def _respond(state: ServerState, request: Request, body: SamplingFields, request_id: str,
                   prompt_ids: list[int], max_tokens: int, logprobs: bool, top_logprobs: int, chat: bool) -> Response:
    temperature = 1.0 if body.temperature is None else body.temperature
    sampling: dict[str, Any] = {"do_sample": temperature > 0, "temperature": temperature if temperature > 0 else 1.0,
                                "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                                "logprobs": logprobs, "top_logprobs": top_logprobs}
    generation = Generation(state.manager, state.tokenizer, state.metrics, request_id, prompt_ids, body.n,
                            body.stop_strings(), max_tokens, sampling)
    generation.start(streaming=body.stream)
    formatter = _Formatter(state, request_id, chat, logprobs)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(generation, formatter, include_usage), media_type="text/event-stream")
    collecting = asyncio.ensure_future(_collect(generation, formatter))
    while not collecting.done():
        await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_SECONDS)
        if not collecting.done() and await request.is_disconnected():
            collecting.cancel()  # closing the deltas cancels the choices: their blocks are freed
            return Response(status_code=499)
    return JSONResponse(collecting.result())


async def _collect(generation: Generation, formatter: _Formatter) -> dict[str, Any]:
    choices: dict[int, dict[str, Any]] = {}
    generated = 0
    async for delta in generation.deltas():
        choice = choices.setdefault(delta.index, formatter.empty_choice(delta.index))
        formatter.extend(choice, delta)
        if delta.finish_reason is not None:
            generated += delta.num_generated
    return formatter.response([choices[i] for i in sorted(choices)], len(generation.prompt_ids), generated)


async def _stream(generation: Generation, formatter: _Formatter, include_usage: bool) -> AsyncIterator[str]:
    generated = 0
    if formatter.chat:
        for index in range(generation.n):
            yield _event(formatter.chunk(index, {"role": "assistant", "content": ""}, None, None))
    try:
        async for delta in generation.deltas():
            if delta.finish_reason is not None:
                generated += delta.num_generated
            if delta.text or delta.finish_reason is not None:
                yield _event(formatter.delta_chunk(delta))
    except APIError as error:
        yield _event(error.body())
    if include_usage:
        yield _event({**formatter.header(chunk=True), "choices": [],
                      "usage": _usage(len(generation.prompt_ids), generated)})
    yield "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Formatter:
    """Builds OpenAI's response, chunk and logprobs objects for completions (chat=False) or chat completions."""

    def __init__(self, state: ServerState, request_id: str, chat: bool, logprobs: bool) -> None:
        self.state, self.request_id, self.chat, self.logprobs = state, request_id, chat, logprobs
        self.created = int(time.time())

    def header(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.state.model_name}

    def empty_choice(self, index: int) -> dict[str, Any]:
        logprobs = ({"content": []} if self.chat else
                    {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
        return {"index": index, "text": "", "logprobs": logprobs if self.logprobs else None, "finish_reason": None}

    def extend(self, choice: dict[str, Any], delta: ChoiceDelta) -> None:
        if self.logprobs:
            self._add_logprobs(choice["logprobs"], delta, len(choice["text"]))
        choice["text"] += delta.text
        choice["finish_reason"] = delta.finish_reason or choice["finish_reason"]

    def response(self, choices: list[dict[str, Any]], prompt_tokens: int, generated: int) -> dict[str, Any]:
        if self.chat:
            choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                        "logprobs": c["logprobs"], "finish_reason": c["finish_reason"]} for c in choices]
        return {**self.header(chunk=False), "choices": choices, "usage": _usage(prompt_tokens, generated)}

    def chunk(self, index: int, content: dict[str, Any] | str, logprobs: Any, finish_reason: str | None
              ) -> dict[str, Any]:
        choice = ({"index": index, "delta": content} if self.chat else {"index": index, "text": content})
        return {**self.header(chunk=True),
                "choices": [{**choice, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def delta_chunk(self, delta: ChoiceDelta) -> dict[str, Any]:
        logprobs = None
        if self.logprobs:
            logprobs = self.empty_choice(delta.index)["logprobs"]
            self._add_logprobs(logprobs, delta, 0)
        content: dict[str, Any] | str = {"content": delta.text} if self.chat else delta.text
        return self.chunk(delta.index, content, logprobs, delta.finish_reason)

    def _add_logprobs(self, target: dict[str, Any], delta: ChoiceDelta, offset: int) -> None:
        decode = self.state.tokenizer.decode
        tops = delta.top_logprobs or [[] for _ in delta.token_ids]
        for token_id, logprob, top in zip(delta.token_ids, delta.logprobs, tops, strict=False):
            token = decode([token_id])
            if self.chat:
                target["content"].append({
                    "token": token, "logprob": logprob, "bytes": list(token.encode()),
                    "top_logprobs": [{"token": decode([i]), "logprob": lp, "bytes": list(decode([i]).encode())}
                                     for i, lp in top]})
            else:
                target["tokens"].append(token)
                target["token_logprobs"].append(logprob)
                target["top_logprobs"].append({decode([i]): lp for i, lp in top})
                target["text_offset"].append(offset)
                offset += len(token)
