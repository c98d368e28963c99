"""POST /v1/chat/completions."""

from __future__ import annotations

import itertools

from fastapi import APIRouter, Request
from fastapi.responses import Response

from contbatch.data.prompts import as_token_ids
from contbatch.entrypoints.openai.protocol import ChatCompletionRequest
from contbatch.entrypoints.openai.serving import GenerationRequest, ServerState, check_model, respond, server_state

DEFAULT_CHAT_TOKENS = 1024

router = APIRouter()
_ids = itertools.count()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    check_model(state, body.model)
    messages = [message.model_dump() for message in body.messages]
    prompt_ids = as_token_ids(state.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    max_tokens = body.max_completion_tokens or body.max_tokens or _default_tokens(state, len(prompt_ids))
    call = GenerationRequest(f"chatcmpl-{next(_ids)}", [prompt_ids], max_tokens, body.logprobs,
                             body.top_logprobs or 0, chat=True)
    return await respond(state, request, body, call)


def _default_tokens(state: ServerState, prompt_len: int) -> int:
    """DEFAULT_CHAT_TOKENS, or fewer when the model's positions end sooner."""
    positions = state.client.engine.max_position_embeddings
    return DEFAULT_CHAT_TOKENS if positions is None else max(1, min(DEFAULT_CHAT_TOKENS, positions - prompt_len))
