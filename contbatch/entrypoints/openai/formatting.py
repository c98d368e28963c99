"""OpenAI's response, chunk and logprobs objects, built from contbatch's outputs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from contbatch.entrypoints.openai.protocol import LOGPROB_FLOOR
from contbatch.outputs import GenerationOutput, PromptLogprob


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice produced since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None = None
    num_generated: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @classmethod
    def of(cls, index: int, output: GenerationOutput, finish_reason: str | None) -> ChoiceDelta:
        """The delta of choice `index` carried by `output` (its new tokens, their logprobs and its new text), with
        the output's prompt and prompt logprobs (for echo)."""
        new = len(output.new_tokens)
        logprobs = output.logprobs[len(output.logprobs) - new:] if output.logprobs else []
        tops = output.top_logprobs[len(output.top_logprobs) - new:] if output.top_logprobs else []
        return cls(index, output.new_text, output.new_tokens, logprobs, tops, finish_reason,
                   len(output.generated_tokens), output.prompt_ids, output.prompt_logprobs)


@dataclass(frozen=True)
class Echo:
    """What `echo` prepends: choice i starts with the text `texts[i // n]` of its prompt (and, when logprobs are
    asked for, with its prompt tokens' entries)."""

    texts: list[str]
    n: int


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Formatter:
    """Builds OpenAI's objects for completions (chat=False) or chat completions.

    Completions' logprobs are OpenAI's legacy object: per token its string (`tokens`, each id decoded alone),
    `token_logprobs`, `top_logprobs` (a dict token string -> logprob of the top entries plus the chosen token,
    so up to k + 1 keys, as OpenAI documents; ids decoding to the same string keep the highest logprob, so the
    dict's maximum is always the position's maximum) and `text_offset` (the running length of the token
    strings, from where the token's part of the text starts). With `echo`, a choice first holds its prompt: its
    text, and per prompt token an entry whose logprob and top dict are None for the first token (nothing
    precedes it). -inf logprobs are reported as LOGPROB_FLOOR. With `prompt_logprobs` (vLLM's field), a
    completions choice also holds `prompt_logprobs` (see `CompletionRequest`).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model_name: str, request_id: str, chat: bool,
                 logprobs: bool, echo: Echo | None = None, top_logprobs: int = 0,
                 prompt_logprobs: int | None = None) -> None:
        self.tokenizer, self.model_name, self.request_id = tokenizer, model_name, request_id
        self.chat, self.logprobs, self.echo = chat, logprobs, echo
        self.top_logprobs, self.prompt_logprobs = top_logprobs, prompt_logprobs
        self.created = int(time.time())

    def header(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model_name}

    def empty_choice(self, index: int) -> dict[str, Any]:
        logprobs: dict[str, list[Any]] = ({"content": []} if self.chat else
                                          {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
        return {"index": index, "text": "", "logprobs": logprobs if self.logprobs else None, "finish_reason": None}

    def first_choice(self, delta: ChoiceDelta) -> dict[str, Any]:
        """The choice of `delta.index` before its first delta is added: empty, or holding its prompt with echo, and
        its `prompt_logprobs` when asked."""
        choice = self.empty_choice(delta.index)
        if self.prompt_logprobs is not None and not self.chat:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(delta)
        if self.echo is None:
            return choice
        choice["text"] = self.echo.texts[delta.index // self.echo.n]
        if self.logprobs:
            entries = delta.prompt_logprobs or [None] * len(delta.prompt_ids)
            offset = 0
            for token_id, entry in zip(delta.prompt_ids, entries, strict=True):
                logprob, top = (None, None) if entry is None else (entry.logprob,
                                                                    entry.top_logprobs[:self.top_logprobs])
                offset = self._add_entry(choice["logprobs"], token_id, logprob, top, offset)
        return choice

    def _vllm_prompt_logprobs(self, delta: ChoiceDelta) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs` of a choice: per prompt token None or {token id: logprob, rank, text}."""
        entries = delta.prompt_logprobs or [None] * len(delta.prompt_ids)
        result: list[dict[str, dict[str, Any]] | None] = []
        for token_id, entry in zip(delta.prompt_ids, entries, strict=True):
            if entry is None:
                result.append(None)
                continue
            top = entry.top_logprobs[:self.prompt_logprobs]
            ranks = {i: rank for rank, (i, _) in enumerate(top, 1)}
            values = {token_id: entry.logprob, **dict(top)}
            result.append({str(i): {"logprob": max(lp, LOGPROB_FLOOR), "rank": ranks.get(i),
                                    "decoded_token": self.tokenizer.decode([i])} for i, lp in values.items()})
        return result

    def extend(self, choice: dict[str, Any], delta: ChoiceDelta) -> None:
        if self.logprobs:
            self._add_logprobs(choice["logprobs"], delta, len(choice["text"]))
        choice["text"] += delta.text
        choice["finish_reason"] = delta.finish_reason or choice["finish_reason"]

    def response(self, choices: list[dict[str, Any]], prompt_tokens: int, generated: int) -> dict[str, Any]:
        if self.chat:
            choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                        "logprobs": c["logprobs"], "finish_reason": c["finish_reason"]} for c in choices]
        return {**self.header(chunk=False), "choices": choices, "usage": usage(prompt_tokens, generated)}

    def chunk(self, index: int, content: dict[str, Any] | str, logprobs: Any, finish_reason: str | None
              ) -> dict[str, Any]:
        choice = ({"index": index, "delta": content} if self.chat else {"index": index, "text": content})
        return {**self.header(chunk=True),
                "choices": [{**choice, "logprobs": logprobs, "finish_reason": finish_reason}]}

    @property
    def has_prompt_part(self) -> bool:
        """Whether a completions choice starts with something of its prompt (echo or `prompt_logprobs`), which its
        first streamed chunk carries."""
        return not self.chat and (self.echo is not None or self.prompt_logprobs is not None)

    def delta_chunk(self, delta: ChoiceDelta, first: bool = False) -> dict[str, Any]:
        """The chunk of `delta`; the `first` delta of a choice also carries its prompt part (`has_prompt_part`)."""
        if first and self.has_prompt_part:
            choice = self.first_choice(delta)
            self.extend(choice, delta)
            chunk = self.chunk(delta.index, choice["text"], choice["logprobs"], delta.finish_reason)
            if "prompt_logprobs" in choice:
                chunk["choices"][0]["prompt_logprobs"] = choice["prompt_logprobs"]
            return chunk
        logprobs = None
        if self.logprobs:
            logprobs = self.empty_choice(delta.index)["logprobs"]
            self._add_logprobs(logprobs, delta, 0)
        content: dict[str, Any] | str = {"content": delta.text} if self.chat else delta.text
        return self.chunk(delta.index, content, logprobs, delta.finish_reason)

    def _add_logprobs(self, target: dict[str, Any], delta: ChoiceDelta, offset: int) -> None:
        decode = cast("Callable[[list[int]], str]", self.tokenizer.decode)
        tops = delta.top_logprobs or [[] for _ in delta.token_ids]
        for token_id, logprob, top in zip(delta.token_ids, delta.logprobs, tops, strict=False):
            if self.chat:
                token = decode([token_id])
                target["content"].append({
                    "token": token, "logprob": logprob, "bytes": list(token.encode()),
                    "top_logprobs": [{"token": decode([i]), "logprob": lp, "bytes": list(decode([i]).encode())}
                                     for i, lp in top]})
            else:
                offset = self._add_entry(target, token_id, logprob, top, offset)

    def _add_entry(self, target: dict[str, Any], token_id: int, logprob: float | None,
                   top: Iterable[tuple[int, float]] | None, offset: int) -> int:
        """Appends one token's legacy entry (no logprob: None, None) to `target`; returns the next offset."""
        decode = cast("Callable[[list[int]], str]", self.tokenizer.decode)
        token = decode([token_id])
        target["tokens"].append(token)
        target["text_offset"].append(offset)
        if logprob is None or top is None:
            target["token_logprobs"].append(None)
            target["top_logprobs"].append(None)
            return offset + len(token)
        tops: dict[str, float] = {}
        for key, value in [*((decode([i]), lp) for i, lp in top), (token, logprob)]:
            tops[key] = max(tops.get(key, value), value, LOGPROB_FLOOR)
        target["token_logprobs"].append(max(logprob, LOGPROB_FLOOR))
        target["top_logprobs"].append(tops)
        return offset + len(token)
