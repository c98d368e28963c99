"""Tool-call parsers: they split a model's reply, fed chunk by chunk as it streams, into content, reasoning and
tool calls.

Registered parsers (`TOOL_PARSERS`, the server's `--tool-call-parser`):

- "hermes": calls written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (several allowed; the
  object may also hold a list of such calls, and "parameters" is accepted for "arguments"). A block whose JSON
  is not a call (malformed JSON, or a block left open when the reply ends) is not a call: its inner text, tags
  removed, is returned as content. Stray `</tool_call>` tags are dropped, and so is the start of a tag that
  the reply ends in (`<tool_ca`, a reply cut by max_tokens). So content never holds tool-call markup.
- "transformers": the tokenizer's `response_template` (transformers' response parsing), for models that ship
  one: its `content` field is content, its `thinking`/`reasoning` field reasoning and its `tool_calls` field the
  calls. A region whose text the template cannot parse is returned as content.
- "auto": "transformers" when the tokenizer has a `response_template`, else "hermes".
"""

from __future__ import annotations

import contextlib
import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_parsing import ResponseParser

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
REASONING_FIELDS = ("thinking", "reasoning", "reasoning_content")


def new_call_id() -> str:
    """A fresh OpenAI-style tool-call id (`call_` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as a JSON object's text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    @classmethod
    def of(cls, value: Any) -> ParsedCall | None:
        """The call `value` describes (`{"name", "arguments"|"parameters"}`, or OpenAI's `{"function": {...}}`),
        or None when it is not one (no string name, or arguments that are not an object)."""
        if not isinstance(value, dict):
            return None
        if isinstance(value.get("function"), dict):
            value = value["function"]
        name = value.get("name")
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        return cls(name, json.dumps(arguments, ensure_ascii=False))


@dataclass(frozen=True)
class Piece:
    """What a parser emits: some content, some reasoning, or one complete call."""

    content: str = ""
    reasoning: str = ""
    call: ParsedCall | None = None


class ToolParser(ABC):
    """Parses one reply. `feed` takes the reply's next chunk and returns what is now certain; text that may
    still turn into markup (a partial tag) is held back. `finish` ends the reply and returns the rest. Feeding a
    reply in any chunking gives the same pieces, merged."""

    @abstractmethod
    def feed(self, text: str) -> list[Piece]: ...

    @abstractmethod
    def finish(self) -> list[Piece]: ...


def calls_in(text: str) -> list[ParsedCall] | None:
    """The calls `text` holds as JSON (one call object or a list of them), or None when it holds something
    else."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    values = value if isinstance(value, list) else [value]
    calls = [ParsedCall.of(item) for item in values]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _held_suffix(text: str, tags: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins one of `tags` (and may grow into it)."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return longest


class HermesToolParser(ToolParser):
    """The "hermes" format (see the module's docstring)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE_TAG)
                if end < 0 and not final:
                    return pieces
                body, self._buffer = (self._buffer, "") if end < 0 else (self._buffer[:end],
                                                                          self._buffer[end + len(CLOSE_TAG):])
                self._inside = False
                pieces.extend(self._block(body))
                continue
            hits = [(self._buffer.find(tag), tag) for tag in (OPEN_TAG, CLOSE_TAG) if tag in self._buffer]
            if hits:
                start, tag = min(hits)
                pieces.append(Piece(content=self._buffer[:start]))
                self._buffer = self._buffer[start + len(tag):]
                self._inside = tag == OPEN_TAG
                continue
            keep = _held_suffix(self._buffer, (OPEN_TAG, CLOSE_TAG))
            pieces.append(Piece(content=self._buffer[:len(self._buffer) - keep]))
            self._buffer = "" if final else self._buffer[len(self._buffer) - keep:]
            return [piece for piece in pieces if piece.content or piece.call]

    @staticmethod
    def _block(body: str) -> list[Piece]:
        calls = calls_in(body)
        if calls is None:
            return [Piece(content=body.strip())]
        return [Piece(call=call) for call in calls]


class _LenientResponseParser(ResponseParser):
    """transformers' `ResponseParser`, except that a region whose text its content parser rejects (malformed
    JSON, say) closes as an "unparsed" event carrying its text, and parsing goes on after it."""

    def _close_current(self, events: list[dict[str, Any]]) -> None:
        try:
            super()._close_current(events)
        except ValueError:
            events.append({"type": "region_unparsed", "field": self._current, "text": self._body})
            self._reset_to_implicit()


class TemplateToolParser(ToolParser):
    """The "transformers" format: the tokenizer's `response_template`, run by transformers' streaming
    `ResponseParser` over the reply after the prompt (`prefix`, whose pre-written part of the reply counts). A
    region the template cannot parse becomes content (its text, stripped)."""

    def __init__(self, template: dict[str, Any], prefix: str, tools: list[dict[str, Any]] | None) -> None:
        self._parser = _LenientResponseParser(
            template, prefix=prefix, tools=cast("list[dict[Any, Any] | Callable[..., Any]] | None", tools))
        self._pending = list(self._parser.initial_events)

    def feed(self, text: str) -> list[Piece]:
        events, self._pending = self._pending + self._parser.feed(text), []
        return self._pieces(events)

    def finish(self) -> list[Piece]:
        """The rest of the reply; a template whose required fields the reply lacks gives nothing more."""
        events, self._pending = self._pending, []
        with contextlib.suppress(ValueError):
            events += self._parser.finalize()[1]
        return self._pieces(events)

    @staticmethod
    def _pieces(events: list[dict[str, Any]]) -> list[Piece]:
        pieces: list[Piece] = []
        for event in events:
            name = event.get("field")
            if event["type"] == "region_chunk" and not event.get("dirty"):
                if name == "content":
                    pieces.append(Piece(content=event["text"]))
                elif name in REASONING_FIELDS:
                    pieces.append(Piece(reasoning=event["text"]))
            elif event["type"] == "region_unparsed":
                pieces.append(Piece(content=event["text"].strip()))
            elif event["type"] == "region_close" and name == "tool_calls":
                values = event["value"] if isinstance(event["value"], list) else [event["value"]]
                calls = [ParsedCall.of(value) for value in values]
                pieces += [Piece(call=call) if call else Piece(content=json.dumps(value))
                           for call, value in zip(calls, values, strict=True)]
        return pieces


ParserFactory = Callable[[PreTrainedTokenizerBase, str, "list[dict[str, Any]] | None"], ToolParser]


def _template_parser(tokenizer: PreTrainedTokenizerBase, prefix: str, tools: list[dict[str, Any]] | None
                     ) -> ToolParser:
    return TemplateToolParser(tokenizer.response_template, prefix, tools)


def _auto_parser(tokenizer: PreTrainedTokenizerBase, prefix: str, tools: list[dict[str, Any]] | None
                 ) -> ToolParser:
    if getattr(tokenizer, "response_template", None):
        return _template_parser(tokenizer, prefix, tools)
    return HermesToolParser()


TOOL_PARSERS: dict[str, ParserFactory] = {
    "auto": _auto_parser,
    "hermes": lambda tokenizer, prefix, tools: HermesToolParser(),
    "transformers": _template_parser,
}


def check_tool_parser(name: str, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raises ValueError when `name` is not a registered parser, or is "transformers" for a tokenizer without a
    `response_template`."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    if name == "transformers" and not getattr(tokenizer, "response_template", None):
        raise ValueError("the 'transformers' tool-call parser needs a tokenizer with a response_template")


def make_tool_parser(name: str, tokenizer: PreTrainedTokenizerBase, prefix: str,
                     tools: list[dict[str, Any]] | None) -> ToolParser:
    """A fresh parser `name` (see `TOOL_PARSERS`) for one reply to the prompt text `prefix`."""
    return TOOL_PARSERS[name](tokenizer, prefix, tools)
