"""GSM8K as a GRPO task: the embedded test questions as chat prompts, and a numeric-answer reward."""

from __future__ import annotations

import re
from typing import Any

from datasets import Dataset

from contbatch.data.prompts import load_prompts

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def numeric_answer_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the last number of a completion equals the GSM8K answer (after `####`), 0.1 when the completion
    ends on another number (it gave an answer: a small model gets a learning signal before it is ever right), else
    0.0."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = _NUMBER.findall(text)
        expected = gold.split("####")[-1].strip().replace(",", "")
        if not numbers:
            rewards.append(0.0)
        else:
            rewards.append(1.0 if numbers[-1].replace(",", "").rstrip(".") == expected else 0.1)
    return rewards


def gsm8k_dataset(num_prompts: int) -> Dataset:
    """The first `num_prompts` GSM8K test questions as chat prompts, with their answers."""
    questions = load_prompts(limit=num_prompts)
    answers = load_prompts(field="answer", limit=num_prompts)
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions], "answer": answers})
