"""Incremental detokenization: exact against `tokenizer.decode`, cut at stop strings, linear in length."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contbatch.data.embedded import embedded_model_dir
from contbatch.data.prompts import load_prompts
from contbatch.frontend.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def token_stream(tokenizer: PreTrainedTokenizerBase, length: int) -> list[int]:
    """`length` real tokens: GSM8K text with multi-byte characters (split across byte-level tokens)."""
    text = " naïve café 東京 🙂 ∑x² " + " ".join(load_prompts(limit=400))
    ids = tokenizer(text * (1 + length // 2000))["input_ids"]
    assert len(ids) >= length
    return ids[:length]


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], step: int = 1) -> str:
    deltas = [detokenizer.update(ids[i:i + step]) for i in range(0, len(ids), step)]
    return "".join(deltas) + detokenizer.flush()


@pytest.mark.parametrize("step", [1, 3])
def test_concatenated_deltas_equal_decode(tokenizer: PreTrainedTokenizerBase, step: int) -> None:
    ids = token_stream(tokenizer, 1500) + tokenizer(" 🙂🙂 done")["input_ids"]
    assert stream(IncrementalDetokenizer(tokenizer), ids, step) == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("Hello there")["input_ids"] + [tokenizer.eos_token_id]
    assert stream(IncrementalDetokenizer(tokenizer), ids) == "Hello there"


@pytest.mark.parametrize("stop", [["How many"], ["café 東"], ["zzz-never", "🙂"]])
def test_stop_strings_cut_the_text_exactly_and_nothing_follows(tokenizer: PreTrainedTokenizerBase,
                                                               stop: list[str]) -> None:
    ids = token_stream(tokenizer, 3000)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    cut = min(full.find(text) for text in stop if text in full)
    detokenizer = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for token in ids:
        deltas.append(detokenizer.update([token]))
        if detokenizer.stopped:
            break
    assert detokenizer.stopped and "".join(deltas) == full[:cut] == detokenizer.text
    assert detokenizer.update(ids[:5]) == "" and detokenizer.flush() == ""


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, ["STOP here"])
    assert detokenizer.update(tokenizer("one STOP")["input_ids"]) == "one "
    assert detokenizer.update(tokenizer(" there")["input_ids"]) == "STOP there"
    assert not detokenizer.stopped


def per_token_seconds(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> float:
    """Best of 5 runs of streaming `ids` one token at a time (with stop strings to search), per token."""
    best = float("inf")
    for _ in range(5):
        detokenizer = IncrementalDetokenizer(tokenizer, ["never appears 1", "never appears 2"])
        start = time.perf_counter()
        for token in ids:
            detokenizer.update([token])
        best = min(best, time.perf_counter() - start)
    return best / len(ids)


def test_streaming_detokenization_is_linear_in_length(tokenizer: PreTrainedTokenizerBase) -> None:
    """Per-token cost at 4,000 tokens is under 2x that at 500 (a re-decode per token would be ~8x)."""
    ids = token_stream(tokenizer, 4000)
    short, long = per_token_seconds(tokenizer, ids[:500]), per_token_seconds(tokenizer, ids)
    assert long < 2 * short, f"{long * 1e6:.1f} us/token at 4000 tokens vs {short * 1e6:.1f} at 500"


def test_the_old_full_redecode_would_fail_the_linearity_bound(tokenizer: PreTrainedTokenizerBase) -> None:
    """The bound above can fail: decoding the whole text per token (the server's old way) breaks it."""
    def redecode_seconds(ids: list[int]) -> float:
        start = time.perf_counter()
        for end in range(1, len(ids) + 1):
            tokenizer.decode(ids[:end], skip_special_tokens=True)
        return (time.perf_counter() - start) / len(ids)

    ids = token_stream(tokenizer, 4000)
    assert redecode_seconds(ids) > 2 * redecode_seconds(ids[:500])
