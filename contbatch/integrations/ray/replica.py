"""One engine replica of a dataset job: the model loaded once, one manager kept running, many requests in flight.

`ContbatchPredictor` is the callable class for `ray.data.Dataset.map_batches`; the `contbatch generate --ray`
driver calls `run_items` on the same class made a Ray actor."""

from __future__ import annotations

from typing import Any

import torch

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.data.embedded import load_model_and_tokenizer
from contbatch.jobs import JobItem, JobSettings, RecordStream, generation_config, item_from_record


class ContbatchPredictor:
    """A replica: `__init__` loads `model` (a local directory or .gguf file; None: the embedded model) and
    starts one manager that lives as long as the replica. Calls may come from several threads at once (a Ray
    actor's `max_concurrency`): each runs its items as its own stream on the shared manager, so one call's
    tail overlaps the next call's start."""

    def __init__(self, model: str | None, settings: JobSettings,
                 engine_config: ContinuousBatchingConfig | None = None, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.model, self.tokenizer = load_model_and_tokenizer(model)
        self.settings = settings
        self.manager = ContinuousBatchingManager(self.model, generation_config(self.model, self.tokenizer, settings),
                                                 engine_config, tokenizer=self.tokenizer)
        self.manager.start()

    def run_items(self, items: list[JobItem]) -> list[tuple[dict[str, Any], bool, int]]:
        """Run `items`; one `(record, failed, generated tokens)` per item, in order of completion."""
        stream = RecordStream(self.manager, self.tokenizer, self.settings, shared=True)
        return [(f.record, f.failed, f.generated_tokens) for f in stream.run(items)]

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        """`map_batches`' function: rows in (a prompt under `settings.text_field` or `messages`, an id under
        `settings.id_field`, or OpenAI batch request lines), one output row per input row out, with columns
        `id`, `record` (the output line as `contbatch generate` writes it), `failed` and
        `generated_tokens`."""
        import json

        columns = list(batch)
        size = len(batch[columns[0]]) if columns else 0
        rows = [{name: _plain(batch[name][i]) for name in columns} for i in range(size)]
        items = [item_from_record(row, i, self.settings.text_field, self.settings.id_field)
                 for i, row in enumerate(rows)]
        results = self.run_items(items)
        return {"id": [json.dumps(r.get("custom_id", r.get("id"))) for r, _, _ in results],
                "record": [json.dumps(r, ensure_ascii=False) for r, _, _ in results],
                "failed": [failed for _, failed, _ in results],
                "generated_tokens": [tokens for _, _, tokens in results]}

    def shutdown(self) -> None:
        """Stop the replica's manager."""
        self.manager.stop()


def _plain(value: Any) -> Any:
    """A numpy scalar or array of a batch column as a plain Python value."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value
