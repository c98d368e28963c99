"""One unit of work of a dataset job: an input record turned into a prompt, or into the reason it has none."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["text", "chat", "completion"]

OPENAI_KEYS = frozenset({"custom_id", "url", "body"})
OPENAI_URLS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "stop")


@dataclass
class JobItem:
    """One input record. `item_id` is its id in the output (the `--id-field` value or its 0-based position);
    `kind` says how `prompt` is tokenized: "text" (a user turn of the chat template, or plain without one),
    "chat" (a list of messages, through the chat template) or "completion" (plain text, no template).
    `openai_url` is set for OpenAI batch request lines, whose answer is an OpenAI batch response line.
    `sampling` holds the line's own sampling parameters (OpenAI `body` fields, in `add_request`'s names).
    `error` is set, and `prompt` None, when the record cannot be run."""

    item_id: Any
    kind: Kind = "text"
    prompt: str | list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    openai_url: str | None = None
    error: str | None = None

    @property
    def key(self) -> str:
        """The id as a hashable key, equal for equal JSON values."""
        return id_key(self.item_id)


def id_key(item_id: Any) -> str:
    """The key under which an id is recorded as done: its canonical JSON text."""
    return json.dumps(item_id, sort_keys=True)


def item_from_line(line: str, index: int, text_field: str, id_field: str | None) -> JobItem:
    """Parse one JSONL line (position `index`) into a `JobItem`; an unparsable line becomes an error item."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return JobItem(index, error=f"line {index}: invalid JSON: {exc}")
    if not isinstance(record, dict):
        return JobItem(index, error=f"line {index}: expected a JSON object, got {type(record).__name__}")
    return item_from_record(record, index, text_field, id_field)


def item_from_record(record: Mapping[str, Any], index: int, text_field: str, id_field: str | None) -> JobItem:
    """Turn one input record (position `index`) into a `JobItem`.

    An OpenAI batch request line (keys `custom_id`, `url`, `body`) is recognised by its keys and identified by
    `custom_id`. Otherwise the id is `record[id_field]` (or `index` when `id_field` is None or missing, with an
    error), and the prompt is the string `record[text_field]`, or a list of chat messages under `text_field`
    or `messages`. Every problem becomes the item's `error`, never an exception."""
    if record.keys() >= OPENAI_KEYS:
        return _openai_item(record, index)
    if id_field is not None and id_field not in record:
        return JobItem(index, error=f"record {index}: missing id field {id_field!r}")
    item_id = index if id_field is None else record[id_field]
    if not isinstance(item_id, str | int):
        return JobItem(index, error=f"record {index}: id {item_id!r} is neither a string nor an integer")
    value = record.get(text_field, record.get("messages"))
    if value is None:
        keys = ", ".join(sorted(map(str, record))) or "none"
        return JobItem(item_id, error=f"record {index}: missing field {text_field!r} (fields present: {keys})")
    if isinstance(value, str):
        return _checked(JobItem(item_id, "text", value))
    return _checked(JobItem(item_id, "chat", _messages(value)))


def _openai_item(record: Mapping[str, Any], index: int) -> JobItem:
    """An OpenAI batch request line: `/v1/chat/completions` (body.messages) or `/v1/completions` (body.prompt)."""
    custom_id, url, body = record["custom_id"], record["url"], record["body"]
    if not isinstance(custom_id, str):
        return JobItem(index, error=f"line {index}: custom_id must be a string")
    if url not in OPENAI_URLS:
        return JobItem(custom_id, openai_url=str(url), error=f"unsupported url {url!r} (use {sorted(OPENAI_URLS)})")
    if not isinstance(body, dict):
        return JobItem(custom_id, openai_url=url, error="body must be a JSON object")
    kind = OPENAI_URLS[url]
    if kind == "chat":
        prompt: Any = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        prompt = prompt if isinstance(prompt, str) else None
    sampling = {name: body[name] for name in _SAMPLING_KEYS if body.get(name) is not None}
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        sampling["max_new_tokens"] = limit
    if body.get("n") is not None:
        sampling["n"] = body["n"]
    item = JobItem(custom_id, kind, prompt, sampling, openai_url=url)
    if prompt is None:
        item.error = "body has no " + ("messages list" if kind == "chat" else "prompt string")
        return item
    return _checked(item)


def _messages(value: Any) -> list[dict[str, Any]] | None:
    """`value` when it is a non-empty list of chat messages (objects with a string `role`), else None."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        return None
    return value


def _checked(item: JobItem) -> JobItem:
    """`item`, with an error when its prompt is empty or not a list of chat messages."""
    if item.prompt is None:
        item.error = "the prompt is not a string or a non-empty list of chat messages"
    elif isinstance(item.prompt, str) and not item.prompt.strip():
        item.error = "empty prompt"
    return item
