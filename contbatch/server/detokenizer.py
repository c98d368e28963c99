"""Incremental detokenization with stop strings matched exactly across token boundaries."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, cutting at the first stop string.

    Contract: the concatenated deltas equal the decoded text up to (not including) the first occurrence of any
    stop string, or the whole text when none occurs. Text that could still turn into a stop string, or that ends
    in an incomplete character, is held back until the next tokens (or `flush`) decide it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def update(self, token_ids: list[int]) -> str:
        """The new text given all generated `token_ids` so far; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        self.text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        longest = max((len(stop) for stop in self.stop), default=0)
        start = max(0, self.emitted - longest + 1)
        hits = [index for stop in self.stop if (index := self.text.find(stop, start)) >= 0]
        if hits:
            self.stopped = True
            return self._emit_to(min(hits))
        safe = len(self.text) - self._held_back()
        return self._emit_to(max(safe, self.emitted))

    def flush(self) -> str:
        """The rest of the text, once no more tokens will come."""
        return "" if self.stopped else self._emit_to(len(self.text))

    def _held_back(self) -> int:
        if self.text.endswith("\ufffd"):
            return 1
        for size in range(min(len(self.text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            tail = self.text[-size:]
            if any(stop.startswith(tail) for stop in self.stop):
                return size
        return 0

    def _emit_to(self, end: int) -> str:
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta
