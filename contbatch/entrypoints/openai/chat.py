"""POST /v1/chat/completions: chat history, tools (see `tools` and `tool_parsers`) and `response_format` (see
`structured`)."""

from __future__ import annotations

import itertools
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from contbatch.entrypoints.openai.chat_output import (
    NamedCallShaper,
    ParsedShaper,
    RequiredCallsShaper,
    ShaperFactory,
)
from contbatch.entrypoints.openai.protocol import ChatCompletionRequest
from contbatch.entrypoints.openai.serving import GenerationRequest, ServerState, check_model, respond, server_state
from contbatch.entrypoints.openai.structured import (
    named_tool_constraint,
    required_tools_constraint,
    response_format_constraint,
    structured_output,
)
from contbatch.entrypoints.openai.tool_parsers import make_tool_parser
from contbatch.entrypoints.openai.tools import RenderedChat, TemplateSupport, ToolPlan, plan_tools, render_chat

DEFAULT_CHAT_TOKENS = 1024

router = APIRouter()
_ids = itertools.count()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """A chat completion. With tools, `tool_choice="auto"` parses the reply's calls with the server's tool-call
    parser, a named function constrains the reply to its arguments and "required" to a list of calls (both with
    structured outputs, so the calls are valid); `response_format` constrains the reply to JSON. A call that
    was made ends with finish_reason "tool_calls"."""
    state = server_state(request)
    check_model(state, body.model)
    plan = plan_tools(body)
    rendered = render_chat(state.tokenizer, _template_support(state), body.messages, plan)
    constraint, param = _constraint(body, plan)
    max_tokens = body.max_completion_tokens or body.max_tokens or _default_tokens(state, len(rendered.prompt_ids))
    call = GenerationRequest(f"chatcmpl-{next(_ids)}", [rendered.prompt_ids], max_tokens, body.logprobs,
                             body.top_logprobs or 0, chat=True,
                             structured_output=structured_output(constraint, param), constraint_param=param)
    return await respond(state, request, body, call, _shaping(state, plan, rendered))


def _template_support(state: ServerState) -> TemplateSupport:
    if state.template_support is None:
        state.template_support = TemplateSupport.probe(state.tokenizer)
    return state.template_support


def _constraint(body: ChatCompletionRequest, plan: ToolPlan) -> tuple[dict[str, Any] | None, str]:
    """The request's structured-output constraint and the field it comes from."""
    if plan.mode == "named" and plan.function is not None:
        return named_tool_constraint(plan.function), "tool_choice"
    if plan.mode == "required":
        return required_tools_constraint(plan.functions, plan.parallel), "tools"
    return response_format_constraint(body.response_format), "response_format"


def _shaping(state: ServerState, plan: ToolPlan, rendered: RenderedChat) -> ShaperFactory | None:
    """How the choices' text becomes messages: None (plain content) without tools or with
    `tool_choice="none"`. "auto" parses with the server's parser ("hermes" when the Hermes prompt described
    the tools)."""
    if plan.mode == "named" and plan.function is not None:
        name = plan.function.name
        return lambda: NamedCallShaper(name)
    if plan.mode == "required":
        return RequiredCallsShaper
    if plan.mode == "auto":
        parser = "hermes" if rendered.hermes_tools else state.tool_call_parser
        tools = plan.rendered_tools
        return lambda: ParsedShaper(make_tool_parser(parser, state.tokenizer, rendered.text, tools))
    return None


def _default_tokens(state: ServerState, prompt_len: int) -> int:
    """DEFAULT_CHAT_TOKENS, or fewer when the model's positions end sooner."""
    positions = state.client.engine.max_position_embeddings
    return DEFAULT_CHAT_TOKENS if positions is None else max(1, min(DEFAULT_CHAT_TOKENS, positions - prompt_len))
