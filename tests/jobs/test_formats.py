"""Each input format gives the same completions for the same prompts; Parquet output; per-line failures, and a
model's failure ending the job; OpenAI batch files round-trip through the `openai` package's types."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
import torch
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion
from transformers import BloomConfig, BloomForCausalLM

from contbatch import UnsupportedModelError
from contbatch.jobs import JobSettings
from tests.jobs.conftest import by_id, job, read_jsonl, write_jsonl

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Count to three.", "Say hello in French."]
ROWS = [{"key": f"q{i}", "question": q} for i, q in enumerate(QUESTIONS)]


def _completions(path: Path) -> dict[str, str]:
    return {k: r["completion"] for k, r in by_id(read_jsonl(path)).items()}


def test_jsonl_csv_parquet_and_dataset_dir_give_the_same_completions(tiny, tmp_path: Path) -> None:
    settings = JobSettings(model="tiny", max_new_tokens=5, id_field="key")
    table = datasets.Dataset.from_list(ROWS)
    table.to_csv(tmp_path / "in.csv", index=False)
    table.to_parquet(tmp_path / "in.parquet")
    table.save_to_disk(tmp_path / "saved")
    sources = [write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "in.csv", tmp_path / "in.parquet",
               tmp_path / "saved"]
    results = []
    for index, source in enumerate(sources):
        summary = job(tiny, source, tmp_path / f"out{index}.jsonl", settings)
        assert summary.ok and summary.succeeded == len(ROWS), source
        results.append(_completions(tmp_path / f"out{index}.jsonl"))
    assert sorted(results[0]) == [r["key"] for r in ROWS]
    assert all(result == results[0] for result in results), "formats disagree"

    messages = [{"key": r["key"], "messages": [{"role": "user", "content": r["question"]}]} for r in ROWS]
    job(tiny, write_jsonl(tmp_path / "chat.jsonl", messages), tmp_path / "chat_out.jsonl", settings)
    assert _completions(tmp_path / "chat_out.jsonl") == results[0], "a one-turn chat equals its text prompt"

    assert job(tiny, sources[0], tmp_path / "out.parquet", settings).ok
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert {r["id"]: r["completion"] for r in table} == results[0]


def test_bad_lines_become_error_records_and_the_job_goes_on(tiny, tmp_path: Path) -> None:
    lines = ['{"question": "Fine?"}', "{not json", '{"other": 1}', '{"question": "   "}', "[1, 2]",
             json.dumps({"question": "word " * 80}), "", '{"question": "Also fine?"}']
    settings = JobSettings(model="tiny", max_new_tokens=4, max_prompt_tokens=60)
    summary = job(tiny, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", settings)
    records = by_id(read_jsonl(tmp_path / "out.jsonl"))
    assert sorted(records) == [0, 1, 2, 3, 4, 5, 7], "one line per non-blank input line, by position"
    assert "completion" in records[0] and "completion" in records[7]
    assert "invalid JSON" in records[1]["error"]
    assert "missing field 'question'" in records[2]["error"]
    assert records[3]["error"] == "empty prompt"
    assert "expected a JSON object" in records[4]["error"]
    assert "more than --max-prompt-tokens 60" in records[5]["error"]
    assert (summary.succeeded, summary.failed, summary.ok) == (2, 5, False)


def test_openai_batch_file_round_trip(tiny, tmp_path: Path) -> None:
    chat = {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 3, "n": 2}}
    text = {"custom_id": "text-1", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}}
    bad = {"custom_id": "emb-1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
    summary = job(tiny, write_jsonl(tmp_path / "batch.jsonl", [chat, text, bad]), tmp_path / "out.jsonl")
    assert (summary.succeeded, summary.failed) == (2, 1)
    lines = by_id(read_jsonl(tmp_path / "out.jsonl"))

    chat_body = ChatCompletion.model_validate(lines["chat-1"]["response"]["body"])
    assert [c.index for c in chat_body.choices] == [0, 1]
    assert all(c.message.role == "assistant" and isinstance(c.message.content, str) for c in chat_body.choices)
    assert chat_body.usage is not None and chat_body.usage.completion_tokens <= 2 * 3
    text_body = Completion.model_validate(lines["text-1"]["response"]["body"])
    assert len(text_body.choices) == 1 and text_body.choices[0].finish_reason in ("stop", "length")
    assert text_body.usage is not None and 0 < text_body.usage.completion_tokens <= 5
    assert lines["chat-1"]["response"]["status_code"] == 200 and lines["chat-1"]["error"] is None
    error = BatchError.model_validate(lines["emb-1"]["error"])
    assert lines["emb-1"]["response"] is None and "/v1/embeddings" in (error.message or "")


def test_a_model_contbatch_cannot_run_ends_the_job_without_writing_its_lines(tiny, tmp_path: Path) -> None:
    """The model's error is not a line's: the job raises it, and no line claims those ids as done."""
    _, tokenizer = tiny
    torch.manual_seed(0)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=2, n_head=2,
                                         bos_token_id=0, eos_token_id=0)).eval()
    with pytest.raises(UnsupportedModelError, match=r"^BloomForCausalLM: 0 of its 2 layers ran"):
        job((bloom, tokenizer), write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl",
            JobSettings(model="bloom", max_new_tokens=4, id_field="key"))
    assert read_jsonl(tmp_path / "out.jsonl") == []
