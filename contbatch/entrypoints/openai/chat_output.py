"""How a chat choice's generated text becomes its message (non-streaming) or its deltas (streaming) when the
request has tools: content, `reasoning_content` and `tool_calls`.

A `ChoiceShaper` serves one choice. `delta(text, finished)` takes the choice's next text and returns the
fields of its next streamed delta (`{}` when nothing is certain yet); `message(text)` returns the whole
message of a choice from its whole text. Both views of a reply agree: the streamed content deltas concatenate
to the message's content, and the streamed calls are the message's calls (streamed calls carry `index`, their
place among the choice's calls, and each complete call comes in one delta, except a named call, whose arguments
stream as they are generated).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from contbatch.entrypoints.openai.tool_parsers import ParsedCall, ToolParser, calls_in, new_call_id


def call_entry(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's tool-call object of `call`; with `index`, the streamed form."""
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index, **entry}


class ChoiceShaper(ABC):
    """Shapes one choice (see the module's docstring). `has_calls` tells whether it produced a tool call, which
    turns the finish reason "stop" into "tool_calls"."""

    has_calls: bool = False

    @abstractmethod
    def delta(self, text: str, finished: bool) -> dict[str, Any]: ...

    @abstractmethod
    def message(self, text: str) -> dict[str, Any]: ...

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.has_calls else reason


ShaperFactory = Callable[[], ChoiceShaper]


class _Trimmer:
    """Streams text with its leading and trailing whitespace removed: leading whitespace is dropped, and
    whitespace is held back until more non-whitespace text follows it."""

    def __init__(self) -> None:
        self._pending, self._started = "", False

    def push(self, text: str) -> str:
        text = self._pending + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._pending = text[len(body):]
        self._started = self._started or bool(body)
        return body


class ParsedShaper(ChoiceShaper):
    """`tool_choice="auto"`: the reply is split by a tool-call parser; content and reasoning are stripped of
    leading and trailing whitespace (None in the message when empty and calls were made)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.calls: list[ParsedCall] = []
        self._content, self._reasoning = _Trimmer(), _Trimmer()

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        pieces = self.parser.feed(text) if text else []
        if finished:
            pieces += self.parser.finish()
        content = "".join(self._content.push(piece.content) for piece in pieces if piece.content)
        reasoning = "".join(self._reasoning.push(piece.reasoning) for piece in pieces if piece.reasoning)
        fields: dict[str, Any] = {}
        if reasoning:
            fields["reasoning_content"] = reasoning
        if content:
            fields["content"] = content
        calls = [piece.call for piece in pieces if piece.call is not None]
        if calls:
            fields["tool_calls"] = [call_entry(call, len(self.calls) + i) for i, call in enumerate(calls)]
            self.calls += calls
            self.has_calls = True
        return fields

    def message(self, text: str) -> dict[str, Any]:
        fields = self.delta(text, finished=True)
        message: dict[str, Any] = {"role": "assistant", "content": fields.get("content") or
                                   (None if self.calls else "")}
        if "reasoning_content" in fields:
            message["reasoning_content"] = fields["reasoning_content"]
        if self.calls:
            message["tool_calls"] = [call_entry(call) for call in self.calls]
        return message


class NamedCallShaper(ChoiceShaper):
    """A named `tool_choice`: the reply is the arguments of a call to `name` (the engine constrains it to the
    function's parameters schema); streamed, the first delta names the call and the next ones extend its
    arguments."""

    def __init__(self, name: str) -> None:
        self.name, self.call_id = name, new_call_id()

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        if not text:
            return {}
        if not self.has_calls:
            self.has_calls = True
            return {"tool_calls": [call_entry(ParsedCall(self.name, text, self.call_id), 0)]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

    def message(self, text: str) -> dict[str, Any]:
        self.has_calls = True
        return {"role": "assistant", "content": None,
                "tool_calls": [call_entry(ParsedCall(self.name, text, self.call_id))]}


class RequiredCallsShaper(ChoiceShaper):
    """`tool_choice="required"`: the reply is a JSON array of `{"name", "arguments"}` objects (the engine
    constrains it so); its calls come in the last delta. A reply that is not such an array (cut by max_tokens)
    is returned as content."""

    def __init__(self) -> None:
        self._text = ""

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        self._text += text
        if not finished:
            return {}
        calls = calls_in(self._text)
        if calls is None:
            return {"content": self._text} if self._text else {}
        self.has_calls = True
        return {"tool_calls": [call_entry(call, index) for index, call in enumerate(calls)]}

    def message(self, text: str) -> dict[str, Any]:
        calls = calls_in(text)
        if calls is None:
            return {"role": "assistant", "content": text}
        self.has_calls = True
        return {"role": "assistant", "content": None, "tool_calls": [call_entry(call) for call in calls]}
