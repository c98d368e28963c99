"""Prompt data: the shipped GSM8K test set (socratic variant, MIT licence) and chat-template tokenization."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

DATA_DIR = Path(__file__).resolve().parent
GSM8K_TEST_PATH = DATA_DIR / "gsm8k_test_socratic.jsonl"


def load_prompts(path: str | Path | None = None, field: str = "question", limit: int | None = None) -> list[str]:
    """Read prompts from a JSON Lines file: the string `field` of each non-blank line, in file order.

    Args:
        path: the `.jsonl` file; default the shipped GSM8K socratic test set (1319 questions).
        field: the key of each record holding the prompt text.
        limit: read at most this many prompts (lines after the limit are not read); None reads them all.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: `limit` is negative, or a line (named by its 1-based number) is not a JSON object
            holding a string under `field`.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    file = Path(path) if path is not None else GSM8K_TEST_PATH
    if not file.is_file():
        raise FileNotFoundError(f"Prompt file not found: {file}")
    prompts: list[str] = []
    with file.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if limit is not None and len(prompts) >= limit:
                break
            if not line.strip():
                continue
            prompts.append(_prompt_from_line(line, field, f"{file}:{lineno}"))
    return prompts


def _prompt_from_line(line: str, field: str, where: str) -> str:
    """Return the string `field` of the JSON object on `line`; errors name `where` (file:line)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: invalid JSON: {exc}") from exc
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if field not in record:
        keys = ", ".join(sorted(record)) or "none"
        raise ValueError(f"{where}: missing field {field!r} (fields present: {keys})")
    value = record[field]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} is a {type(value).__name__}, expected a string")
    return value


def chat_inputs(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    """Tokenize each prompt as a single user turn of a chat, ready for the assistant's reply.

    Uses the tokenizer's chat template with `add_generation_prompt=True`; a tokenizer without a chat template
    gets plain tokenization (with its usual special tokens) instead. Returns one token-id list per prompt.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return [as_token_ids(tokenizer(prompt)["input_ids"]) for prompt in prompts]
    return [
        as_token_ids(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
        )
        for prompt in prompts
    ]


def as_token_ids(encoded: Any) -> list[int]:
    """Normalize a tokenizer result to a flat list of ints.

    transformers 5 returns a BatchEncoding (a Mapping) from `apply_chat_template(tokenize=True)` where
    transformers 4 returned a list; tensors and single-row batches are accepted too.
    """
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        if len(encoded) != 1:
            raise ValueError(f"expected one tokenized sequence, got a batch of {len(encoded)}")
        encoded = encoded[0]
    return [int(token) for token in encoded]
