"""A chat request's tools: checking `tools`/`tool_choice`, and rendering the history and the tools with the
model's chat template.

Rendering: the tools go to the template as `apply_chat_template(messages, tools=[...])`, the history's
assistant calls as `tool_calls` whose `function.arguments` is a dict (as Hugging Face chat templates expect),
and `tool` messages as `{"role": "tool", "content", "tool_call_id"}`. A template that ignores `tools` (the
embedded SmolLM2's does) gets the Hermes convention instead, which the "hermes" parser reads back: a system
prompt listing the tools in `<tools></tools>` and asking for `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` replies (prepended to the first system message, or added as one); and a template that ignores
`tool_calls` gets the history's calls as such `<tool_call>` blocks in the assistant's content, and tool results
as user messages `<tool_response>...</tool_response>`. `tool_choice="none"` renders no tools (the reply is
plain content).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

from transformers import PreTrainedTokenizerBase

from contbatch.data.prompts import as_token_ids
from contbatch.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    NamedToolChoice,
)

TOOL_CHOICES = ("none", "auto", "required")
HERMES_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)
_PROBE_NAME, _PROBE_RESULT = "contbatch_probe_function", "contbatch_probe_result"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for: `mode` "none" (no tools, or `tool_choice="none"`), "auto", "required"
    or "named" (`function` is the named one). `functions` are the request's tools."""

    mode: Literal["none", "auto", "required", "named"]
    functions: list[FunctionDefinition]
    function: FunctionDefinition | None = None
    parallel: bool = True

    @property
    def rendered_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (None when none are rendered)."""
        if self.mode == "none" or not self.functions:
            return None
        return [{"type": "function", "function": function.model_dump(exclude_none=True)}
                for function in self.functions]


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """The request's `ToolPlan`. Raises APIError(400) for `tool_choice` without `tools`, an unknown
    `tool_choice` string, a named function not among `tools`, duplicate tool names, or a forced tool choice
    ("required" or named) together with a JSON `response_format`."""
    functions = [tool.function for tool in body.tools or []]
    choice = body.tool_choice
    if choice is not None and not functions:
        raise APIError(400, "tool_choice is only allowed when tools are given", code="invalid_request",
                       param="tool_choice")
    names = [function.name for function in functions]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise APIError(400, f"tools: the function names {duplicates} are given more than once",
                       code="invalid_request", param="tools")
    if not functions:
        return ToolPlan("none", [])
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                                f"the tools {names}", code="invalid_request", param="tool_choice")
        plan = ToolPlan("named", functions, functions[names.index(choice.function.name)], body.parallel_tool_calls)
    elif choice is None or choice in TOOL_CHOICES:
        plan = ToolPlan(choice or "auto", functions, parallel=body.parallel_tool_calls)  # type: ignore[arg-type]
    else:
        raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                       code="invalid_request", param="tool_choice")
    forced = plan.mode in ("required", "named")
    if forced and body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, f"response_format {body.response_format.type!r} cannot be combined with a forced "
                            "tool_choice ('required' or a named function)", code="invalid_request",
                       param="response_format")
    return plan


@dataclass(frozen=True)
class TemplateSupport:
    """What the tokenizer's chat template renders: `tools`, and the history's `tool_calls` and tool results."""

    tools: bool
    tool_calls: bool

    @classmethod
    def probe(cls, tokenizer: PreTrainedTokenizerBase) -> TemplateSupport:
        """Renders a probe conversation to see whether the template shows the tools and the calls."""
        user = {"role": "user", "content": "probe"}
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}]}
        result = {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": "call_0"}
        return cls(_renders(tokenizer, [user], [_PROBE_TOOL], _PROBE_NAME),
                   _renders(tokenizer, [user, call, result, user], None, _PROBE_NAME, _PROBE_RESULT))


def _renders(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None, *needles: str) -> bool:
    try:
        text = tokenizer.apply_chat_template(messages, tools=_template_tools(tools), add_generation_prompt=True,
                                             tokenize=False)
    except Exception:
        return False
    return isinstance(text, str) and all(needle in text for needle in needles)


def _template_tools(tools: list[dict[str, Any]] | None) -> list[dict[Any, Any] | Callable[..., Any]] | None:
    """`tools` as `apply_chat_template` types them (the same list)."""
    return cast("list[dict[Any, Any] | Callable[..., Any]] | None", tools)


@dataclass(frozen=True)
class RenderedChat:
    """The prompt of a chat request: its text, its ids, and whether its tools were described by the Hermes
    system prompt (the template ignoring them)."""

    text: str
    prompt_ids: list[int]
    hermes_tools: bool = False


def render_chat(tokenizer: PreTrainedTokenizerBase, support: TemplateSupport, messages: list[ChatMessage],
                plan: ToolPlan) -> RenderedChat:
    """The prompt of `messages` with `plan`'s tools (see the module's docstring). A history the template cannot
    render (or a content part that is not text) is answered 400."""
    history = template_messages(messages, native_calls=support.tool_calls)
    tools = plan.rendered_tools
    hermes = tools is not None and not support.tools
    if hermes and tools is not None:
        history = with_hermes_prompt(history, tools)
        tools = None
    try:
        text = tokenizer.apply_chat_template(history, tools=_template_tools(tools), add_generation_prompt=True,
                                             tokenize=False)
    except Exception as error:
        raise APIError(400, f"the chat template could not render the messages: {error}", code="invalid_request",
                       param="messages") from None
    ids = as_token_ids(tokenizer(text, add_special_tokens=False)["input_ids"])
    return RenderedChat(str(text), ids, hermes)


def message_text(message: ChatMessage, index: int) -> str:
    """The message's content as one string: text parts joined with newlines (None content: "")."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part_index, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages[{index}].content[{part_index}]: only text parts are supported, got "
                                f"{part.type!r}", code="invalid_request", param=f"messages[{index}].content")
        texts.append(part.text)
    return "\n".join(texts)


def template_messages(messages: list[ChatMessage], native_calls: bool) -> list[dict[str, Any]]:
    """The history as chat-template dicts: with `native_calls`, assistant `tool_calls` (arguments as dicts) and
    `tool` messages; without, calls as `<tool_call>` blocks in the content and tool results as user
    `<tool_response>` messages."""
    history: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        text = message_text(message, index)
        entry: dict[str, Any] = {"role": message.role, "content": text}
        if message.tool_calls:
            calls = [{"name": call.function.name, "arguments": _arguments(call.function.arguments, index, number)}
                     for number, call in enumerate(message.tool_calls)]
            if native_calls:
                entry["tool_calls"] = [{"id": tool_call.id, "type": "function", "function": call}
                                       for tool_call, call in zip(message.tool_calls, calls, strict=True)]
            else:
                blocks = [f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>" for call in calls]
                entry["content"] = "\n".join([text, *blocks] if text else blocks)
        if message.role == "tool":
            if native_calls:
                entry["tool_call_id"] = message.tool_call_id
            else:
                entry = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
        if message.name is not None and message.role != "tool":
            entry["name"] = message.name
        history.append(entry)
    return history


def _arguments(arguments: str | dict[str, Any], index: int, number: int) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    where = f"messages[{index}].tool_calls[{number}].function.arguments"
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as error:
        raise APIError(400, f"{where} is not valid JSON: {error}", code="invalid_request", param=where) from None
    if not isinstance(parsed, dict):
        raise APIError(400, f"{where} must be a JSON object", code="invalid_request", param=where)
    return parsed


def with_hermes_prompt(history: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`history` with the Hermes tools prompt in its system message: after the first message's content when
    that is a system (or developer) message, else as a new first system message."""
    prompt = HERMES_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
    if history and history[0]["role"] in ("system", "developer"):
        first = history[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}" if first["content"] else prompt},
                *history[1:]]
    return [{"role": "system", "content": prompt}, *history]
