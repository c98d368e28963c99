"""The tool-call parsers and the chat-output shapers, without a model: hermes replies with 0, 1 and 2 calls,
malformed and unclosed blocks, any chunking of a streamed reply, transformers' response templates, and the
shapers of named and required tool choices."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contbatch.data.embedded import embedded_model_dir
from contbatch.entrypoints.openai.chat_output import (
    ChoiceShaper,
    NamedCallShaper,
    ParsedShaper,
    RequiredCallsShaper,
)
from contbatch.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    TemplateToolParser,
    ToolParser,
    check_tool_parser,
    make_tool_parser,
)

HERMES_LIKE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close": "<|im_end|>", "content": "text"},
    },
}
PREFIX = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
CALL_F = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CALL_G = '<tool_call>{"name": "get_time", "parameters": {}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def whole(shaper: ChoiceShaper, text: str) -> dict[str, Any]:
    return shaper.message(text)


def streamed(shaper: ChoiceShaper, chunks: list[str]) -> tuple[str, list[dict[str, Any]], str]:
    """The concatenated content, the calls and the concatenated reasoning of a reply streamed in `chunks`."""
    deltas = [shaper.delta(chunk, False) for chunk in chunks] + [shaper.delta("", True)]
    calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
    return ("".join(d.get("content", "") for d in deltas), calls,
            "".join(d.get("reasoning_content", "") for d in deltas))


def names_and_arguments(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


def chunkings(text: str, seed: int = 0) -> list[list[str]]:
    """`text` cut every 1 to 7 characters, and at 20 random sets of places."""
    cuts = [[text[i:i + size] for i in range(0, len(text), size)] for size in range(1, 8)]
    rng = random.Random(seed)
    for _ in range(20):
        places = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        cuts.append([text[a:b] for a, b in zip([0, *places], [*places, len(text)], strict=True)])
    return cuts


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Just an answer.", "Just an answer.", []),
    (CALL_F, None, [("get_weather", {"city": "Paris", "days": 2})]),
    (f"Let me check.\n{CALL_F}\n{CALL_G}\n", "Let me check.",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ('<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>', None,
     [("a", {"x": 1}), ("b", {})]),
    ('<tool_call>{"name": "a", "arguments": {"x": 1}}', None, [("a", {"x": 1})]),
], ids=["no-call", "one-call", "two-calls-and-text", "list-in-one-block", "unclosed-but-complete"])
def test_hermes_splits_content_and_calls(text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    message = whole(ParsedShaper(HermesToolParser()), text)
    assert message["content"] == (content if calls or content else "")
    assert names_and_arguments(message.get("tool_calls", [])) == calls
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in message.get("tool_calls", []))
    assert len({call["id"] for call in message.get("tool_calls", [])}) == len(calls)


@pytest.mark.parametrize(("text", "content"), [
    ('Answer: <tool_call>{"name": "f", "arguments": {bad json}</tool_call> done', 'Answer: {"name": "f", '
     '"arguments": {bad json} done'),
    ('<tool_call>{"arguments": {}}</tool_call>', '{"arguments": {}}'),
    ('Cut short <tool_call>{"name": "f", "argu', 'Cut short {"name": "f", "argu'),
    ("Stray </tool_call> closer", "Stray  closer"),
    ("Ends in a partial tag <tool_ca", "Ends in a partial tag"),
], ids=["malformed-json", "no-name", "unclosed-and-cut", "stray-close", "partial-tag-at-end"])
def test_hermes_malformed_blocks_become_content_without_markup(text: str, content: str) -> None:
    """A block that is not a call is returned as content, tags removed (vLLM returns the raw text; "auto" must
    never return tool-call markup)."""
    message = whole(ParsedShaper(HermesToolParser()), text)
    assert message["content"] == content and "tool_calls" not in message
    assert "<tool_call" not in message["content"] and "</tool_call" not in message["content"]


def test_hermes_streaming_gives_the_same_reply_in_any_chunking() -> None:
    text = (f"  I will call two tools. {CALL_F}\n {CALL_G} <tool_call>not json</tool_call> And a tail "
            "with a < sign and <tool without closing  ")
    expected = whole(ParsedShaper(HermesToolParser()), text)
    for chunks in chunkings(text):
        content, calls, _ = streamed(ParsedShaper(HermesToolParser()), chunks)
        assert content == expected["content"]
        assert names_and_arguments(calls) == names_and_arguments(expected["tool_calls"])
        assert [call["index"] for call in calls] == [0, 1]


def test_hermes_holds_back_only_what_may_be_a_tag() -> None:
    shaper = ParsedShaper(HermesToolParser())
    assert shaper.delta("Hello <tool", False) == {"content": "Hello"}
    assert shaper.delta("box> x", False) == {"content": " <toolbox> x"}
    assert shaper.delta(" <tool_call>{\"name\": \"f\"", False) == {}
    delta = shaper.delta(', "arguments": {}}</tool_call>', False)
    assert names_and_arguments(delta["tool_calls"]) == [("f", {})] and shaper.finish_reason("stop") == "tool_calls"
    assert shaper.delta("", True) == {}


@pytest.mark.parametrize("chunked", [False, True])
def test_the_transformers_parser_reads_a_response_template(chunked: bool) -> None:
    text = f"<think>The user wants weather.</think>Checking. {CALL_F}<tool_call>{{oops}}</tool_call><|im_end|>"
    for chunks in chunkings(text, seed=1) if chunked else [[text]]:
        parser = TemplateToolParser(HERMES_LIKE_TEMPLATE, PREFIX, None)
        content, calls, reasoning = streamed(ParsedShaper(parser), chunks)
        assert reasoning == "The user wants weather."
        assert content == "Checking. {oops}"
        assert names_and_arguments(calls) == [("get_weather", {"city": "Paris", "days": 2})]


def test_auto_picks_the_template_when_the_tokenizer_has_one(tokenizer: PreTrainedTokenizerBase) -> None:
    assert isinstance(make_tool_parser("auto", tokenizer, PREFIX, None), HermesToolParser)
    with pytest.raises(ValueError, match="response_template"):
        check_tool_parser("transformers", tokenizer)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        check_tool_parser("nope", tokenizer)
    templated = AutoTokenizer.from_pretrained(embedded_model_dir())
    templated.response_template = HERMES_LIKE_TEMPLATE
    check_tool_parser("transformers", templated)
    parser: ToolParser = make_tool_parser("auto", templated, PREFIX, None)
    assert isinstance(parser, TemplateToolParser)
    assert isinstance(make_tool_parser("hermes", templated, PREFIX, None), HermesToolParser)


def test_a_named_call_streams_its_arguments() -> None:
    arguments = '{"city": "Paris", "unit": "celsius"}'
    shaper = NamedCallShaper("get_weather")
    deltas = [shaper.delta(arguments[i:i + 5], i + 5 >= len(arguments)) for i in range(0, len(arguments), 5)]
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["function"]["name"] == "get_weather" and first["id"] == shaper.call_id
    assert all("id" not in d["tool_calls"][0] and "name" not in d["tool_calls"][0]["function"] for d in deltas[1:])
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == arguments
    assert shaper.finish_reason("stop") == "tool_calls" and shaper.finish_reason("length") == "length"
    message = NamedCallShaper("get_weather").message(arguments)
    assert message["content"] is None and names_and_arguments(message["tool_calls"]) == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_required_calls_come_from_the_json_array() -> None:
    text = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    content, calls, _ = streamed(RequiredCallsShaper(), [text[:10], text[10:]])
    assert content == "" and names_and_arguments(calls) == [("a", {"x": 1}), ("b", {})]
    message = RequiredCallsShaper().message(text)
    assert message["content"] is None and len(message["tool_calls"]) == 2
    cut = RequiredCallsShaper()
    assert cut.message('[{"name": "a", "argu') == {"role": "assistant", "content": '[{"name": "a", "argu'}
    assert cut.finish_reason("length") == "length" and not cut.has_calls
