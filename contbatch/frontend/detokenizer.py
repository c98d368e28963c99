"""Incremental detokenization (linear in the length of a generation) with stop strings matched exactly across
token boundaries."""

from __future__ import annotations

from typing import cast

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Turns tokens, fed as they are generated, into text deltas, cutting at the first stop string.

    Contract: the concatenated deltas equal `tokenizer.decode(tokens, skip_special_tokens=True)` up to (not
    including) the first occurrence of any stop string, or the whole text when none occurs. Text that could
    still turn into a stop string is held back until the next tokens (or `flush`) decide it. Each token costs
    time independent of how many came before it: a fast tokenizer's `DecodeStream` decodes only the new token
    (holding back incomplete characters), and the stop-string search looks only at the text not yet emitted.
    A tokenizer without a fast backend falls back to decoding the whole text per token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [text for text in stop or [] if text]
        self.longest_stop = max((len(text) for text in self.stop), default=0)
        self._backend: Tokenizer | None = getattr(tokenizer, "_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        self._tokens: list[int] = []
        self._num_decoded = 0
        self._pending = ""
        self.chunks: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything emitted so far (the concatenated deltas)."""
        return "".join(self.chunks)

    def update(self, token_ids: list[int] | tuple[int, ...]) -> str:
        """The new text once `token_ids` (the tokens generated since the previous call) are added; sets `stopped`
        when a stop string appeared (nothing after it is ever emitted)."""
        if self.stopped:
            return ""
        self._pending += self._decode(token_ids)
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            return self._emit(cut)
        return self._emit(len(self._pending) - self._held_back())

    def flush(self) -> str:
        """The rest of the text, once no more tokens will come."""
        return "" if self.stopped else self._emit(len(self._pending))

    def _decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        if self._stream is not None and self._backend is not None:
            return "".join(chunk for token in token_ids if (chunk := self._stream.step(self._backend, token)))
        self._tokens.extend(token_ids)
        full = cast(str, self.tokenizer.decode(self._tokens, skip_special_tokens=True))
        if full.endswith("\ufffd"):  # an incomplete character: wait for the tokens that complete it
            return ""
        new, self._num_decoded = full[self._num_decoded:], len(full)
        return new

    def _first_stop(self) -> int | None:
        hits = [index for text in self.stop if (index := self._pending.find(text)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Characters at the end of the pending text that could be the start of a stop string."""
        for size in range(min(len(self._pending), self.longest_stop - 1), 0, -1):
            tail = self._pending[-size:]
            if any(text.startswith(tail) for text in self.stop):
                return size
        return 0

    def _emit(self, end: int) -> str:
        delta, self._pending = self._pending[:end], self._pending[end:]
        if delta:
            self.chunks.append(delta)
        return delta
