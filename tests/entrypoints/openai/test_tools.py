"""Tool calling on /v1/chat/completions: rendering tools and tool-call histories with the chat template (or
the Hermes fallback), and, against a live server of the embedded model with the `openai` client, named and
required tool choices (constrained by structured outputs, so their arguments validate), "auto" (content or
parsed calls, never raw markup), streamed and not, and the 400s of bad tool requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contbatch.data.embedded import embedded_model_dir
from contbatch.entrypoints.openai.protocol import APIError, ChatCompletionRequest, ChatMessage
from contbatch.entrypoints.openai.tools import TemplateSupport, plan_tools, render_chat
from tests.entrypoints.openai.embedded_server import EMBEDDED, EmbeddedServed, schema_errors

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMETERS: dict[str, Any] = {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 12}}, "required": ["timezone"],
    "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a timezone",
                                      "parameters": TIME_PARAMETERS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now? Use the get_weather tool."}]
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"},
    {"role": "assistant", "content": [{"type": "text", "text": "It is 22 degrees and sunny in Rome."}]},
    *ASK]
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}|{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} city={{ c.function.arguments.city }}{% endfor %}"
    "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="module")
def served() -> Iterator[EmbeddedServed]:
    server = EmbeddedServed()
    yield server
    server.close()


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": EMBEDDED, "messages": ASK, **fields})


def test_a_template_without_tools_gets_the_hermes_prompt_and_history(tokenizer: PreTrainedTokenizerBase) -> None:
    support = TemplateSupport.probe(tokenizer)
    assert support == TemplateSupport(tools=False, tool_calls=False)
    body = request(messages=HISTORY, tools=TOOLS)
    rendered = render_chat(tokenizer, support, body.messages, plan_tools(body))
    assert rendered.hermes_tools and rendered.text.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(TOOLS[0]) in rendered.text and "<tool_call>\n{\"name\": <function-name>" in rendered.text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": '
            '"celsius"}}\n</tool_call><|im_end|>') in rendered.text
    assert "<|im_start|>user\n<tool_response>\n22 degrees, sunny\n</tool_response><|im_end|>" in rendered.text
    assert rendered.text.endswith("<|im_start|>assistant\n")
    assert rendered.prompt_ids == tokenizer(rendered.text, add_special_tokens=False)["input_ids"]
    plain = render_chat(tokenizer, support, request(tools=TOOLS, tool_choice="none").messages,
                        plan_tools(request(tools=TOOLS, tool_choice="none")))
    assert "# Tools" not in plain.text and not plain.hermes_tools


def test_a_template_with_tools_renders_them_and_the_calls_natively(tokenizer: PreTrainedTokenizerBase) -> None:
    templated = AutoTokenizer.from_pretrained(embedded_model_dir())
    templated.chat_template = TOOL_TEMPLATE
    support = TemplateSupport.probe(templated)
    assert support == TemplateSupport(tools=True, tool_calls=True)
    body = request(messages=HISTORY, tools=TOOLS)
    rendered = render_chat(templated, support, body.messages, plan_tools(body))
    assert not rendered.hermes_tools
    assert rendered.text.startswith("TOOLS:[get_weather][get_time]|<user>Weather in Rome?|")
    assert "<assistant>CALL get_weather city=Rome|<tool>22 degrees, sunny for call_1|" in rendered.text


@pytest.mark.parametrize(("fields", "message"), [
    ({"tool_choice": "auto"}, "tool_choice is only allowed when tools are given"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tools": TOOLS, "tool_choice": "always"}, "'always'"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "more than once"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "forced"),
], ids=["choice-without-tools", "unknown-function", "unknown-choice", "duplicate-tools", "forced-and-json"])
def test_bad_tool_requests_are_rejected(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(APIError, match=message) as caught:
        plan_tools(request(**fields))
    assert caught.value.status == 400


def test_messages_accept_tool_calls_and_text_parts() -> None:
    messages = [ChatMessage.model_validate(message) for message in HISTORY]
    assert messages[1].content is None and messages[1].tool_calls is not None
    with pytest.raises(ValueError, match="needs content"):
        ChatMessage.model_validate({"role": "user", "content": None})


def check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    """The arguments of the call `call` (an `openai` object), checked valid under its function's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    arguments = json.loads(call.function.arguments)
    assert schema_errors(arguments, SCHEMAS[call.function.name]) == []
    return arguments


def test_a_named_tool_choice_calls_it_with_valid_arguments(served: EmbeddedServed) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = served.client.chat.completions.create(model=EMBEDDED, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                  max_tokens=64, temperature=0)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert len(message.tool_calls) == 1
    check_call(message.tool_calls[0], "get_weather")
    stream = served.client.chat.completions.create(model=EMBEDDED, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                   max_tokens=64, temperature=0, stream=True)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    deltas = [call for chunk in chunks for call in chunk.delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert {delta.index for delta in deltas} == {0}
    streamed = "".join(delta.function.arguments or "" for delta in deltas)
    assert streamed == message.tool_calls[0].function.arguments
    assert [chunk.finish_reason for chunk in chunks if chunk.finish_reason] == ["tool_calls"]


def test_required_tool_choice_makes_valid_calls(served: EmbeddedServed) -> None:
    reply = served.client.chat.completions.create(model=EMBEDDED, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  max_tokens=96, temperature=0, parallel_tool_calls=False)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
    check_call(message.tool_calls[0])


@pytest.mark.parametrize("messages", [ASK, HISTORY], ids=["ask", "after-a-call"])
def test_auto_returns_content_or_parsed_calls_never_markup(served: EmbeddedServed,
                                                           messages: list[dict[str, Any]]) -> None:
    reply = served.client.chat.completions.create(model=EMBEDDED, messages=messages, tools=TOOLS, max_tokens=32,
                                                  temperature=0)
    message = reply.choices[0].message
    assert message.content or message.tool_calls
    assert "<tool_call>" not in (message.content or "") and "</tool_call>" not in (message.content or "")
    for call in message.tool_calls or []:
        assert call.function.name in SCHEMAS and isinstance(json.loads(call.function.arguments), dict)
    stream = served.client.chat.completions.create(model=EMBEDDED, messages=messages, tools=TOOLS, max_tokens=32,
                                                   temperature=0, stream=True)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert "".join(chunk.delta.content or "" for chunk in chunks) == (message.content or "")
    streamed_calls = [call for chunk in chunks for call in chunk.delta.tool_calls or []]
    assert [call.function.name for call in streamed_calls] == [call.function.name for call in message.tool_calls or []]


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
], ids=["choice-without-tools", "unknown-function", "unknown-choice", "bad-history-arguments", "image-part",
        "invalid-parameters-schema", "forced-and-json"])
def test_bad_tool_requests_get_400s_naming_the_problem(served: EmbeddedServed, body: dict[str, Any],
                                                       param: str) -> None:
    response = httpx.post(f"{served.url}/v1/chat/completions",
                          json={"model": EMBEDDED, "messages": ASK, "max_tokens": 2, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    with pytest.raises(openai.BadRequestError):
        served.client.chat.completions.create(model=EMBEDDED, messages=ASK, max_tokens=2, tool_choice="required")
