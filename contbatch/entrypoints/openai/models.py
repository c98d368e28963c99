"""/v1/models, and the service routes /health and /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from contbatch.entrypoints.openai.serving import check_model, server_state

router = APIRouter()


def _model_card(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "contbatch"}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    alive = server_state(request).client.is_running()
    return JSONResponse({"status": "ok" if alive else "engine not running"}, status_code=200 if alive else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(server_state(request).model_name)]}


@router.get("/v1/models/{model_id}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    check_model(server_state(request), model_id)
    return _model_card(model_id)
