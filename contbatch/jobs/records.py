"""Output records of a dataset job: a plain result line per id, or an OpenAI batch response line."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

from contbatch.jobs.items import JobItem

_OPENAI_REASONS = {"stop", "length"}


def error_record(item: JobItem, message: str) -> dict[str, Any]:
    """The line of an item that could not run: its id and the reason (an OpenAI batch error line for an OpenAI
    request line)."""
    if item.openai_url is not None:
        return {"id": _batch_id(item, "batch_req"), "custom_id": item.item_id, "response": None,
                "error": {"code": "invalid_request", "message": message}}
    return {"id": item.item_id, "error": message}


def result_record(item: JobItem, texts: Sequence[str], reasons: Sequence[str | None], prompt_tokens: int,
                  completion_tokens: int, model_name: str) -> dict[str, Any]:
    """The line of an item whose samples all finished: `texts` and `reasons` hold one entry per sample.

    A plain line is `{"id", "prompt", "completion", "finish_reason", "prompt_tokens", "completion_tokens"}`,
    with `completions` and `finish_reasons` lists instead when the item has several samples. An OpenAI request
    line gets a batch response line whose `response.body` is a chat completion or a text completion object."""
    if item.openai_url is not None:
        return _openai_record(item, texts, reasons, prompt_tokens, completion_tokens, model_name)
    record: dict[str, Any] = {"id": item.item_id, "prompt": item.prompt}
    if len(texts) == 1:
        record.update(completion=texts[0], finish_reason=reasons[0])
    else:
        record.update(completions=list(texts), finish_reasons=list(reasons))
    record.update(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    return record


def _openai_record(item: JobItem, texts: Sequence[str], reasons: Sequence[str | None], prompt_tokens: int,
                   completion_tokens: int, model_name: str) -> dict[str, Any]:
    chat = item.kind == "chat"
    choices = []
    for index, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
        finish = reason if reason in _OPENAI_REASONS else "stop"
        content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        choices.append({"index": index, **content, "finish_reason": finish, "logprobs": None})
    body = {"id": _batch_id(item, "chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    response = {"status_code": 200, "request_id": _batch_id(item, "req"), "body": body}
    return {"id": _batch_id(item, "batch_req"), "custom_id": item.item_id, "response": response, "error": None}


def _batch_id(item: JobItem, prefix: str) -> str:
    """A stable id derived from the item's id, so that a resumed run writes what an uninterrupted one would."""
    return f"{prefix}_{hashlib.sha256(item.key.encode()).hexdigest()[:24]}"
