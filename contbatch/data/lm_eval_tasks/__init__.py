"""lm-evaluation-harness tasks built from the shipped GSM8K test set, for offline evaluation.

`TASKS_DIR` holds the task YAML files; pass it as lm-eval's `include_path` (`contbatch eval` does by default):

- `contbatch_gsm8k_mc` (multiple choice, loglikelihood): the question, then the correct final number among four
  candidates (`multiple_choice_docs`); metrics `acc` and `acc_norm`.
- `contbatch_gsm8k_gen` (`generate_until`): the question, then a free answer; `exact_match` on the final number
  (strict "#### N" format and a flexible last-number extraction), as lm-eval's own `gsm8k` task scores it.

Both tasks are tagged `contbatch_gsm8k`. Their data comes from the YAML's `custom_dataset` functions below, which
read the shipped JSONL file next to this package: nothing is downloaded and the tasks work from any working
directory. Importing this module needs nothing beyond the standard library; the dataset functions import
`datasets` (a dependency of lm-eval) when called.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent
GSM8K_PATH = TASKS_DIR.parent / "gsm8k_test_socratic.jsonl"
MC_TASK = "contbatch_gsm8k_mc"
GEN_TASK = "contbatch_gsm8k_gen"
NUM_CHOICES = 4

_CALCULATOR_RESULT = re.compile(r"<<[^=<>]*=(-?\d+(?:\.\d+)?)>>")
_FALLBACK_OFFSETS = (1, -1, 10, -10, 2, -2, 5, -5)


def final_answer(solution: str) -> int:
    """The final number of a GSM8K solution: the integer after its last "####", thousands separators removed.

    Raises:
        ValueError: the solution has no "####" line or its value is not an integer.
    """
    if "####" not in solution:
        raise ValueError(f"GSM8K solution without a '#### <answer>' line: {solution[-80:]!r}")
    return int(solution.rsplit("####", 1)[1].strip().replace(",", ""))


def distractors(answer: int, solution: str, count: int = NUM_CHOICES - 1) -> list[int]:
    """`count` wrong answers for a question, derived deterministically from its solution.

    First the integer intermediate results of the solution's calculator annotations (`<<48/2=24>>`), the latest
    first (the plausible mistakes of stopping early), then `answer` plus fixed offsets, then `answer * 2`. Never
    `answer` itself, never a repeat, and never negative when `answer` is not.
    """
    candidates = [int(float(value)) for value in reversed(_CALCULATOR_RESULT.findall(solution))
                  if float(value).is_integer()]
    candidates += [answer + offset for offset in _FALLBACK_OFFSETS] + [answer * 2]
    chosen: list[int] = []
    for value in candidates:
        if value != answer and value not in chosen and (value >= 0 or answer < 0):
            chosen.append(value)
        if len(chosen) == count:
            return chosen
    step = max(abs(answer), 1)
    while len(chosen) < count:
        step += 1
        chosen.append(answer + step)
    return chosen


def multiple_choice_doc(record: dict[str, str]) -> dict[str, Any]:
    """One `contbatch_gsm8k_mc` document: the record's `question` and `answer` (the worked solution) plus
    `choices`, the final answer and its three distractors as decimal strings in ascending numeric order, and
    `label`, the index of the correct one."""
    answer = final_answer(record["answer"])
    values = sorted([answer, *distractors(answer, record["answer"])])
    return {"question": record["question"], "answer": record["answer"],
            "choices": [str(value) for value in values], "label": values.index(answer)}


def load_records(path: str | Path = GSM8K_PATH) -> list[dict[str, str]]:
    """The GSM8K records (`question`, `answer`) of a JSON Lines file, in file order; default the shipped test set."""
    with Path(path).open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def multiple_choice_dataset(**_metadata: Any) -> Any:
    """The `custom_dataset` of `contbatch_gsm8k_mc`: a `datasets.DatasetDict` with one split, "test", of
    `multiple_choice_doc`s in file order. lm-eval passes the task metadata and model arguments; they are unused."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(
        [multiple_choice_doc(record) for record in load_records()])})


def generation_dataset(**_metadata: Any) -> Any:
    """The `custom_dataset` of `contbatch_gsm8k_gen`: a `datasets.DatasetDict` with one split, "test", of the
    GSM8K records (`question`, `answer`) in file order. lm-eval's arguments are unused."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(load_records())})
