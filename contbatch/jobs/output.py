"""The output of a dataset job: a JSONL log appended one flushed line per finished id, the settings it was made
with (a sidecar file), and what a re-run must skip. Parquet output is the log converted once it is complete."""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from contbatch.jobs.items import id_key

PARQUET_SUFFIXES = (".parquet", ".pq")


def record_id(record: dict[str, Any]) -> Any:
    """The id of an output record: `custom_id` for OpenAI batch response lines, else `id`."""
    return record["custom_id"] if "custom_id" in record else record.get("id")


def record_failed(record: dict[str, Any]) -> bool:
    """Whether an output record is an error record."""
    return record.get("error") is not None


@dataclass
class ResumeState:
    """What an existing output already holds: the keys (`id_key`) of its ids, and how many of its lines are
    successes and failures."""

    done: set[str] = field(default_factory=set)
    succeeded: int = 0
    failed: int = 0


class OutputLog:
    """An append-only JSONL output with exactly one line per id.

    `open()` checks the settings recorded beside an existing output (`<output>.settings.json`) against this
    run's, refusing a mismatch unless `overwrite`; drops a truncated last line (a crash mid-write); with
    `retry_failed` removes error lines so their ids run again; takes an exclusive lock so that two jobs never
    write one output; and returns the ids to skip. `write` appends one record and flushes it, so a reader can
    `tail -f` the file and a crash loses no finished line. For a `.parquet` path, the JSONL log is
    `<output>.jsonl` and `finish_parquet()` writes the Parquet file from it."""

    def __init__(self, path: str | Path, settings: dict[str, Any], overwrite: bool = False,
                 retry_failed: bool = False) -> None:
        self.path = Path(path)
        self.parquet = self.path.suffix.lower() in PARQUET_SUFFIXES
        self.log_path = self.path.with_name(self.path.name + ".jsonl") if self.parquet else self.path
        self.settings_path = self.path.with_name(self.path.name + ".settings.json")
        self.settings = json.loads(json.dumps(settings))
        self.overwrite, self.retry_failed = overwrite, retry_failed
        self._file: IO[bytes] | None = None

    def open(self) -> ResumeState:
        """Open the log for appending and return what it already holds (see the class doc).

        Raises:
            ValueError: the existing output was made with other settings, or has no settings record, and
                `overwrite` is False; or another job holds the output's lock.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.log_path.open("ab")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise ValueError(f"{self.log_path} is being written by another job") from None
        has_lines = self.log_path.stat().st_size > 0
        if self.overwrite or not has_lines:
            self._file.truncate(0)
            self._write_settings()
            return ResumeState()
        self._check_settings()
        return self._scan()

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` as one JSON line and flush it to the operating system."""
        assert self._file is not None, "open() the log first"
        self._file.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        self._file.flush()

    def close(self) -> None:
        """Close the log (releasing its lock); safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish_parquet(self) -> None:
        """Write the Parquet output from the complete JSONL log (a no-op for a JSONL output)."""
        if not self.parquet:
            return
        import pyarrow.json as pa_json
        import pyarrow.parquet as pq

        pq.write_table(pa_json.read_json(self.log_path), self.path)

    def _write_settings(self) -> None:
        tmp = self.settings_path.with_name(self.settings_path.name + ".tmp")
        tmp.write_text(json.dumps(self.settings, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.settings_path)

    def _check_settings(self) -> None:
        """Raise ValueError unless the recorded settings equal this run's."""
        hint = "pass --overwrite to start over, or write to another --output"
        if not self.settings_path.is_file():
            raise ValueError(f"{self.log_path} exists but has no settings record ({self.settings_path}): {hint}")
        recorded = json.loads(self.settings_path.read_text())
        differ = sorted(k for k in recorded.keys() | self.settings.keys() if recorded.get(k) != self.settings.get(k))
        if differ:
            changes = "; ".join(f"{k}: {recorded.get(k)!r} -> {self.settings.get(k)!r}" for k in differ)
            raise ValueError(f"{self.log_path} was made with other settings ({changes}): {hint}")

    def _scan(self) -> ResumeState:
        """Read the existing lines in one streaming pass. A truncated last line is cut off; unreadable or
        duplicate lines (and error lines when retrying failures) are removed by streaming the kept lines into a
        new file that replaces the log."""
        state, end, drop = ResumeState(), 0, False
        with self.log_path.open("rb") as lines:
            for line in lines:
                keep = self._keep(_parse(line), state)
                drop = drop or (not keep and line.endswith(b"\n"))
                end += len(line) if keep else 0
        if drop:
            self._rewrite()
        else:
            assert self._file is not None
            self._file.truncate(end)
        return state

    def _keep(self, record: dict[str, Any] | None, state: ResumeState) -> bool:
        """Whether an existing line stays, counting it into `state` when it does."""
        if record is None or (self.retry_failed and record_failed(record)):
            return False
        key = id_key(record_id(record))
        if key in state.done:
            return False
        state.done.add(key)
        state.failed += record_failed(record)
        state.succeeded += not record_failed(record)
        return True

    def _rewrite(self) -> None:
        """Replace the log by its kept lines (streamed through a temporary file), then re-open and re-lock it."""
        tmp = self.log_path.with_name(self.log_path.name + ".tmp")
        seen = ResumeState()
        with self.log_path.open("rb") as lines, tmp.open("wb") as out:
            for line in lines:
                if self._keep(_parse(line), seen):
                    out.write(line)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.log_path)
        self.close()
        self._file = self.log_path.open("ab")
        fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _parse(line: bytes) -> dict[str, Any] | None:
    """The record on a complete log line, or None for a truncated or unreadable one."""
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
