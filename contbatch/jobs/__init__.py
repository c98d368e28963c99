"""Dataset jobs: streaming, exactly-once resumable generation over a file or dataset of prompts.

`run_job` is the single-process job (`contbatch generate`); `RecordStream` is its core (items in, output records
out, a bounded number in flight on one manager), shared with the Ray integration; `OutputLog` owns the output
file, its settings record and resume; `JobInput` reads JSONL, CSV, Parquet and dataset directories lazily."""

from contbatch.jobs.items import JobItem, id_key, item_from_line, item_from_record
from contbatch.jobs.job import JobProgress, JobSummary, generation_config, pending_items, run_job
from contbatch.jobs.output import OutputLog, ResumeState, record_failed, record_id
from contbatch.jobs.records import error_record, result_record
from contbatch.jobs.sources import JobInput
from contbatch.jobs.stream import Finished, JobSettings, RecordStream

__all__ = [
    "Finished",
    "JobInput",
    "JobItem",
    "JobProgress",
    "JobSettings",
    "JobSummary",
    "OutputLog",
    "RecordStream",
    "ResumeState",
    "error_record",
    "generation_config",
    "id_key",
    "item_from_line",
    "item_from_record",
    "pending_items",
    "record_failed",
    "record_id",
    "result_record",
    "run_job",
]
