"""Lazy readers of a job's input: JSONL lines, or CSV / Parquet / a local Hugging Face dataset through `datasets`
(streaming). Each yields `JobItem`s one at a time; none holds the input in memory."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contbatch.jobs.items import JobItem, item_from_line, item_from_record

_TABULAR = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow"}
_CHUNK = 1 << 20


@dataclass(frozen=True)
class JobInput:
    """Where the prompts are and how to read them: `text_field` holds the prompt (a string, or a list of chat
    messages; a record without it may carry `messages`), `id_field` the id (None: the record's 0-based
    position), `split` the split of a dataset directory."""

    path: Path
    text_field: str = "question"
    id_field: str | None = None
    split: str = "train"

    def items(self) -> Iterator[JobItem]:
        """The input's items in order, read lazily. JSONL lines are parsed one by one (a bad line becomes an
        error item, blank lines are skipped but keep their position); other formats go through `datasets`.

        Raises:
            FileNotFoundError: the path does not exist.
        """
        if not self.path.exists():
            raise FileNotFoundError(f"input not found: {self.path}")
        if self.path.is_dir() or self.path.suffix.lower() in _TABULAR:
            for index, record in enumerate(self._dataset()):
                yield item_from_record(record, index, self.text_field, self.id_field)
            return
        with self.path.open(encoding="utf-8", errors="replace") as lines:
            for index, line in enumerate(lines):
                if line.strip():
                    yield item_from_line(line, index, self.text_field, self.id_field)

    def count(self) -> int | None:
        """The number of records, when it is cheap to know: the lines of a JSONL file (counted in chunks, in
        constant memory), the rows of a Parquet file or of a saved dataset; None otherwise."""
        if not self.path.exists():
            return None
        suffix = self.path.suffix.lower()
        if self.path.is_dir():
            return _dataset_dir_rows(self.path, self.split)
        if suffix in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.path).metadata.num_rows
        if suffix in _TABULAR:
            return None
        return _count_lines(self.path)

    def _dataset(self) -> Iterator[dict[str, Any]]:
        """The records of a CSV / Parquet / Arrow file or a dataset directory, streamed by `datasets`."""
        import datasets

        if self.path.is_dir() and _is_saved_dataset(self.path):
            loaded = datasets.load_from_disk(str(self.path))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded[self.split]
            return iter(loaded.to_iterable_dataset())
        if self.path.is_dir():
            return iter(datasets.load_dataset(str(self.path), split=self.split, streaming=True))
        builder = _TABULAR[self.path.suffix.lower()]
        return iter(datasets.load_dataset(builder, data_files=str(self.path), split="train", streaming=True))


def _is_saved_dataset(path: Path) -> bool:
    """Whether `path` was written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _dataset_dir_rows(path: Path, split: str) -> int | None:
    """Rows of a saved dataset (memory-mapped, nothing read); None for other directories."""
    if not _is_saved_dataset(path):
        return None
    import datasets

    loaded = datasets.load_from_disk(str(path))
    return len(loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded)


def _count_lines(path: Path) -> int:
    """Lines of a text file, read in 1 MiB chunks (a final line without newline counts; blank lines count too,
    so this is the progress bar's total, not a promise)."""
    count, last = 0, b"\n"
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")
