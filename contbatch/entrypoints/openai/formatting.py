"""OpenAI's response, chunk and logprobs objects, built from contbatch's outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from contbatch.outputs import GenerationOutput


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

    @classmethod
    def of(cls, index: int, output: GenerationOutput, finish_reason: str | None) -> ChoiceDelta:
        """The delta of choice `index` carried by `output` (its new tokens, their logprobs and its new text)."""
        new = len(output.new_tokens)
        logprobs = output.logprobs[len(output.logprobs) - new:] if output.logprobs else []
        tops = output.top_logprobs[len(output.top_logprobs) - new:] if output.top_logprobs else []
        return cls(index, output.new_text, output.new_tokens, logprobs, tops, finish_reason,
                   len(output.generated_tokens))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Formatter:
    """Builds OpenAI's objects for completions (chat=False) or chat completions."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model_name: str, request_id: str, chat: bool,
                 logprobs: bool) -> None:
        self.tokenizer, self.model_name, self.request_id = tokenizer, model_name, request_id
        self.chat, self.logprobs = chat, logprobs
        self.created = int(time.time())

    def header(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model_name}

    def empty_choice(self, index: int) -> dict[str, Any]:
        logprobs = ({"content": []} if self.chat else
                    {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
        return {"index": index, "text": "", "logprobs": logprobs if self.logprobs else None, "finish_reason": None}

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

    def delta_chunk(self, delta: ChoiceDelta) -> dict[str, Any]:
        logprobs = None
        if self.logprobs:
            logprobs = self.empty_choice(delta.index)["logprobs"]
            self._add_logprobs(logprobs, delta, 0)
        content: dict[str, Any] | str = {"content": delta.text} if self.chat else delta.text
        return self.chunk(delta.index, content, logprobs, delta.finish_reason)

    def _add_logprobs(self, target: dict[str, Any], delta: ChoiceDelta, offset: int) -> None:
        decode = self.tokenizer.decode
        tops = delta.top_logprobs or [[] for _ in delta.token_ids]
        for token_id, logprob, top in zip(delta.token_ids, delta.logprobs, tops, strict=False):
            token = decode([token_id])
            if self.chat:
                target["content"].append({
                    "token": token, "logprob": logprob, "bytes": list(token.encode()),
                    "top_logprobs": [{"token": decode([i]), "logprob": lp, "bytes": list(decode([i]).encode())}
                                     for i, lp in top]})
            else:
                target["tokens"].append(token)
                target["token_logprobs"].append(logprob)
                target["top_logprobs"].append({decode([i]): lp for i, lp in top})
                target["text_offset"].append(offset)
                offset += len(token)
