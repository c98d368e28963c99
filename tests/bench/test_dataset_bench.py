"""`contbatch bench --workload dataset`: a `contbatch generate` run measured from outside its process."""

from __future__ import annotations

import json
from pathlib import Path

from contbatch.bench.dataset import DatasetRun, format_tables, run_generate


def test_a_generate_run_is_measured_from_its_output_and_its_process(tmp_path: Path) -> None:
    source = tmp_path / "input.jsonl"
    source.write_text("\n".join(json.dumps(record) for record in
                                [{"text": "Say yes."}, {"other": "no text field"}, {"text": "Say no."}]) + "\n")
    run = run_generate("tiny", ["--input", str(source), "--field", "text", "--max-new-tokens", "3"],
                       tmp_path / "out.jsonl")
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert (run.lines, run.failed, run.exit_status) == (3, 1, 1)
    assert run.generated_tokens == sum(r.get("completion_tokens", 0) for r in records) > 0
    assert run.generated_tokens <= 6 and run.wall_s > 0
    assert run.peak_rss_mib > 100  # the model's weights alone are ~500 MiB in float32


def test_the_tables_show_each_run_and_the_ratio_to_the_first() -> None:
    runs = [DatasetRun("single", 10.0, 4, 0, 400, 900.0, 0), DatasetRun("ray", 20.0, 4, 1, 300, 700.0, 0)]
    text = format_tables(runs, runs, num_prompts=4, max_new_tokens=8)
    assert "| single | 10.0 | 4 / 0 | 400 | 40.0 | 900 | 1.00x |" in text
    assert "| ray | 20.0 | 3 / 1 | 300 | 15.0 | 700 | 0.38x |" in text
    assert "| ray | 20.0 | 3 / 1 | 700 |" in text
