"""POST /v1/completions."""

from __future__ import annotations

import itertools

from fastapi import APIRouter, Request
from fastapi.responses import Response

from contbatch.entrypoints.openai.protocol import CompletionRequest
from contbatch.entrypoints.openai.serving import GenerationRequest, check_model, respond, server_state

DEFAULT_COMPLETION_TOKENS = 16

router = APIRouter()
_ids = itertools.count()


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    check_model(state, body.model)
    prompt_ids = body.prompt if isinstance(body.prompt, list) else state.tokenizer(body.prompt)["input_ids"]
    call = GenerationRequest(f"cmpl-{next(_ids)}", list(prompt_ids), body.max_tokens or DEFAULT_COMPLETION_TOKENS,
                             logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0, chat=False)
    return await respond(state, request, body, call)
