"""Fixtures of the dataset-job tests: a tiny random model sharing the embedded model's tokenizer, saved to disk
so that the `contbatch generate` command can load it, and a runner of jobs in this process."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch import ContinuousBatchingConfig
from contbatch.data.embedded import embedded_model_dir
from contbatch.jobs import JobInput, JobSettings, JobSummary, OutputLog, run_job

ENGINE = ContinuousBatchingConfig(block_size=8, num_blocks=256, max_batch_tokens=256)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a tiny random Llama over the embedded tokenizer's vocabulary, and that tokenizer."""
    directory = tmp_path_factory.mktemp("tiny_chat_model")
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.5, eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_dir)


def write_jsonl(path: Path, records: Iterable[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_id(records: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """The records keyed by id; fails on a duplicate id."""
    keyed = {r.get("custom_id", r.get("id")): r for r in records}
    assert len(keyed) == len(records), "duplicate ids in the output"
    return keyed


def job(tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase], source: Path, output: Path,
        settings: JobSettings | None = None, limit: int | None = None, **log: bool) -> JobSummary:
    """Run a job in this process: the tiny model, 6 new tokens unless `settings` say otherwise."""
    model, tokenizer = tiny
    settings = settings or JobSettings(model="tiny", max_new_tokens=6)
    job_input = JobInput(source, settings.text_field, settings.id_field)
    out = OutputLog(output, settings.record(tokenizer), **log)
    return run_job(model, tokenizer, job_input, out, settings, ENGINE, limit, progress=False)
