"""The FastAPI app: one router per endpoint family, the API-key and body-size guard, and OpenAI-style errors."""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from contbatch.entrypoints.openai import chat, completions, models, tokenization
from contbatch.entrypoints.openai.metrics import ServerMetrics
from contbatch.entrypoints.openai.protocol import APIError
from contbatch.entrypoints.openai.serving import ServerState
from contbatch.entrypoints.openai.tool_parsers import check_tool_parser
from contbatch.entrypoints.openai.tools import TemplateSupport
from contbatch.frontend.async_client import AsyncClient
from contbatch.frontend.client import EngineClient

DEFAULT_MAX_BODY_BYTES = 1 << 20


def create_app(engine: EngineClient, tokenizer: PreTrainedTokenizerBase, model_name: str,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               tool_call_parser: str = "auto") -> FastAPI:
    """The app serving `engine` (a started `ContinuousBatchingManager`, say) under the model id `model_name`.
    Requests are tokenized and outputs detokenized with `tokenizer` (which becomes the client's tokenizer if it
    has none). With `api_key`, every /v1 route requires `Authorization: Bearer <api_key>`. `tool_call_parser`
    names the parser of chat replies' tool calls (see `tool_parsers.TOOL_PARSERS`); an unknown name, or
    "transformers" for a tokenizer without a response template, raises ValueError. Each request's span (with the
    engine client's telemetry) is parented on the HTTP request's `traceparent`; `/metrics` gets the engine's
    numbers through `engine.add_metrics_sink`."""
    check_tool_parser(tool_call_parser, tokenizer)
    if engine.tokenizer is None:
        engine.tokenizer = tokenizer
    app = FastAPI(title="contbatch", version="0.1.0")
    metrics = ServerMetrics(engine)
    engine.add_metrics_sink(metrics)
    state = ServerState(engine, AsyncClient(engine), tokenizer, model_name, api_key, max_body_bytes, metrics,
                        tool_call_parser, TemplateSupport.probe(tokenizer))
    app.state.contbatch = state
    app.add_middleware(RequestGuard, state=state)
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    for module in (models, completions, chat, tokenization):
        app.include_router(module.router)
    return app


class RequestGuard:
    """Rejects bodies over the size limit (413) and /v1 calls without the API key (401), from the request's
    headers, before the app sees them. A plain ASGI middleware: a streamed response's chunks pass straight through
    (Starlette's `BaseHTTPMiddleware` relays each one through a memory stream and a task of its own)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = _rejection(self.state, Headers(scope=scope), scope["path"])
            if error is not None:
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _rejection(state: ServerState, headers: Headers, path: str) -> APIError | None:
    length = headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > state.max_body_bytes):
        return APIError(413, f"request body of {length} bytes exceeds the limit of {state.max_body_bytes} bytes",
                        code="request_too_large")
    if state.api_key and path.startswith("/v1"):
        given = headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            return APIError(401, "missing or wrong API key", code="invalid_api_key", kind="authentication_error")
    return None


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return _error(error)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    problems = error.errors()
    if any(problem.get("type") == "json_invalid" for problem in problems):
        return _error(APIError(400, "the request body is not valid JSON", code="invalid_json"))
    first = problems[0] if problems else {}
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return _error(APIError(422, f"{where}: {first.get('msg', 'invalid value')}", param=where or None,
                           code="invalid_value"))


def _error(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)
