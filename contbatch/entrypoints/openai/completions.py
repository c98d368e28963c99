"""POST /v1/completions."""

from __future__ import annotations

import itertools
from typing import cast

from fastapi import APIRouter, Request
from fastapi.responses import Response

from contbatch.data.prompts import as_token_ids
from contbatch.entrypoints.openai.protocol import MAX_TOP_LOGPROBS, APIError, CompletionRequest
from contbatch.entrypoints.openai.serving import GenerationRequest, ServerState, check_model, respond, server_state
from contbatch.entrypoints.openai.structured import response_format_constraint, structured_output

DEFAULT_COMPLETION_TOKENS = 16

router = APIRouter()
_ids = itertools.count()


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    """Completions of one or more prompts (see `CompletionRequest`). The prompts of a list are answered
    together: every prompt is checked before any runs, and a bad one (empty, ids outside the vocabulary, too
    long for the model's positions or the cache, ...) makes the whole call a 400 naming it (`prompt[i]: ...`),
    with nothing computed, so no other prompt's work is lost; the caller resends the list without it.
    `response_format` constrains every choice as on chat completions."""
    state = server_state(request)
    check_model(state, body.model)
    for name, value in (("logprobs", body.logprobs), ("prompt_logprobs", body.prompt_logprobs)):
        if value is not None and value > MAX_TOP_LOGPROBS:
            raise APIError(400, f"{name} must be at most {MAX_TOP_LOGPROBS}, got {value}", code="invalid_request",
                           param=name)
    prompts, texts = _prompts(state, body.prompt)
    max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
    constraint = structured_output(response_format_constraint(body.response_format), "response_format")
    call = GenerationRequest(f"cmpl-{next(_ids)}", prompts, max_tokens, logprobs=body.logprobs is not None,
                             top_logprobs=body.logprobs or 0, chat=False, echo=body.echo, prompt_texts=texts,
                             prompt_logprobs=body.prompt_logprobs, structured_output=constraint)
    return await respond(state, request, body, call)


def _prompts(state: ServerState, prompt: str | list[str] | list[int] | list[list[int]]
             ) -> tuple[list[list[int]], list[str] | None]:
    """The prompts' token ids, and their texts when they came as text (a string or a list of strings; an empty
    list is one empty prompt)."""
    if isinstance(prompt, str):
        return [as_token_ids(state.tokenizer(prompt)["input_ids"])], [prompt]
    if prompt and all(isinstance(text, str) for text in prompt):
        texts = [str(text) for text in prompt]
        return [as_token_ids(ids) for ids in state.tokenizer(texts)["input_ids"]], texts
    if prompt and isinstance(prompt[0], list):
        return [list(ids) for ids in prompt], None
    return [list(cast(list[int], prompt))], None
