"""A dataset job in one process: an input read lazily, one manager, an output appended line by line."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch.engine.config import ContinuousBatchingConfig
from contbatch.jobs.items import JobItem
from contbatch.jobs.output import OutputLog, ResumeState
from contbatch.jobs.sources import JobInput
from contbatch.jobs.stream import JobSettings, RecordStream
from contbatch.manager import ContinuousBatchingManager


@dataclass
class JobSummary:
    """How a job went. `succeeded` and `failed` count the output's lines (earlier runs' included), `skipped` the
    ids already in the output, `duplicates` input ids seen twice (not written again, counted as failures),
    `generated_tokens` and `wall_s` this run's."""

    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    duplicates: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether every line of the output is a success and no id came twice."""
        return self.failed == 0 and self.duplicates == 0

    def __str__(self) -> str:
        rate = self.generated_tokens / self.wall_s if self.wall_s else 0.0
        return (f"{self.succeeded} succeeded, {self.failed} failed, {self.skipped} already done, "
                f"{self.duplicates} duplicate ids; {self.generated_tokens} tokens in {self.wall_s:.1f} s "
                f"({rate:.1f} tok/s)")


def pending_items(job_input: JobInput, resume: ResumeState, summary: JobSummary,
                  limit: int | None = None) -> Iterator[JobItem]:
    """The items of `job_input` (its first `limit` records) that the output does not hold yet, counted in
    `summary.skipped`. Ids that are not positions are remembered for the run, so that a second occurrence is
    counted in `summary.duplicates` and skipped."""
    seen: set[str] = set()
    for item in itertools.islice(job_input.items(), limit):
        key = item.key
        if key in resume.done:
            summary.skipped += 1
            continue
        if job_input.id_field is not None or item.openai_url is not None:
            if key in seen:
                summary.duplicates += 1
                continue
            seen.add(key)
        yield item


def generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                      settings: JobSettings) -> GenerationConfig:
    """The manager's base generation config: greedy, `settings.max_new_tokens`, the model's EOS."""
    eos = model.generation_config.eos_token_id
    return GenerationConfig(max_new_tokens=settings.max_new_tokens, do_sample=False,
                            eos_token_id=eos if eos is not None else tokenizer.eos_token_id)


def run_job(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, job_input: JobInput, output: OutputLog,
            settings: JobSettings, engine_config: ContinuousBatchingConfig | None = None,
            limit: int | None = None, progress: bool = True) -> JobSummary:
    """Run `settings` on `job_input`'s first `limit` records (all when None), appending one line per id to
    `output`, which must not be open yet. Ids already in the output are skipped (see `OutputLog`); the log is
    closed, and converted to Parquet when asked for and complete, at the end.

    Raises:
        ValueError: the output was made with other settings (see `OutputLog.open`).
        RuntimeError: the engine thread died (every line written so far stays).
    """
    run = JobProgress(output, job_input, limit, progress)
    manager = ContinuousBatchingManager(model, generation_config(model, tokenizer, settings), engine_config,
                                        tokenizer=tokenizer)
    try:
        with manager:
            items = pending_items(job_input, run.resume, run.summary, limit)
            for finished in RecordStream(manager, tokenizer, settings).run(items):
                run.write(finished.record, finished.failed, finished.generated_tokens)
    finally:
        run.close()
    return run.finish()


class JobProgress:
    """The bookkeeping of one run over an `OutputLog`: opens it (`resume`: what it holds), counts each line written
    into `summary` and the progress bar (done/total, ETA, tok/s, failures), and closes it."""

    def __init__(self, output: OutputLog, job_input: JobInput, limit: int | None, progress: bool) -> None:
        self.output = output
        self.resume: ResumeState = output.open()
        self.summary = JobSummary(succeeded=self.resume.succeeded, failed=self.resume.failed)
        total = job_input.count()
        self.total = limit if total is None else (total if limit is None else min(total, limit))
        self.bar = tqdm(total=self.total, initial=len(self.resume.done), disable=not progress, unit="line",
                        dynamic_ncols=True)
        self.start = time.perf_counter()

    def write(self, record: dict[str, Any], failed: bool, generated_tokens: int) -> None:
        """Appends one output line and counts it."""
        self.output.write(record)
        summary = self.summary
        summary.failed += failed
        summary.succeeded += not failed
        summary.generated_tokens += generated_tokens
        self.bar.update(1)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix({"tok/s": f"{summary.generated_tokens / elapsed:.0f}", "failed": summary.failed},
                             refresh=False)

    def close(self) -> None:
        """Records the wall time and closes the bar and the output (every line written so far stays)."""
        self.summary.wall_s = time.perf_counter() - self.start
        self.bar.close()
        self.output.close()

    def finish(self) -> JobSummary:
        """After `close`: converts the output to Parquet when asked for and every line is done; the summary."""
        if self.total is None or self.summary.succeeded + self.summary.failed >= self.total:
            self.output.finish_parquet()
        return self.summary
