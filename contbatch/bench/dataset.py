"""`contbatch bench --workload dataset`: the main job, `contbatch generate`, run as a user runs it.

Each run is the command in a process of its own, timed from start to exit, its peak resident memory read from the
operating system when it exits (`os.wait4`: the largest process among it and its waited-for descendants), its
generated tokens summed from the output lines. Runs: the GSM8K test questions single-process and on Ray replicas;
then the memory check of streaming, a run over a generated million-line input against one over a thousand lines,
with the same `--limit` of work, so that any growth with the input's size shows in the peak memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DatasetRun:
    """One `contbatch generate` run: its label, wall seconds, output lines (and failed ones), generated tokens,
    peak RSS in MiB and exit status."""

    label: str
    wall_s: float
    lines: int
    failed: int
    generated_tokens: int
    peak_rss_mib: float
    exit_status: int

    @property
    def generated_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


def run_generate(label: str, arguments: list[str], output: Path) -> DatasetRun:
    """Runs `contbatch generate ARGUMENTS --output OUTPUT --overwrite --quiet` in a new process and measures it."""
    command = [sys.executable, "-m", "contbatch.cli", "generate", *arguments, "--output", str(output), "--overwrite",
               "--quiet"]
    start = time.perf_counter()
    _, status, usage = os.wait4(subprocess.Popen(command).pid, 0)
    wall = time.perf_counter() - start
    lines = failed = tokens = 0
    if output.exists():
        with output.open(encoding="utf-8") as records:
            for line in records:
                record = json.loads(line)
                lines += 1
                failed += "error" in record
                tokens += int(record.get("completion_tokens", 0))
    return DatasetRun(label, wall, lines, failed, tokens, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status))


def gsm8k_runs(num_prompts: int, max_new_tokens: int, replicas: int, scratch: Path) -> list[DatasetRun]:
    """The first `num_prompts` shipped GSM8K questions (greedy) single-process with 2 threads, then on `replicas`
    Ray replicas of 1 torch thread each (asking Ray for half a CPU each, so that a 2-CPU local Ray schedules them
    all)."""
    common = ["--limit", str(num_prompts), "--max-new-tokens", str(max_new_tokens)]
    single = run_generate("single process, 2 threads", [*common, "--threads", "2"], scratch / "single.jsonl")
    ray = run_generate(f"--ray --replicas {replicas}, 1 thread each (peak RSS: the driver's)",
                       [*common, "--ray", "--replicas", str(replicas), "--cpus-per-replica", "0.5", "--threads", "1"],
                       scratch / "ray.jsonl")
    return [single, ray]


def streaming_runs(lines: int, limit: int, max_new_tokens: int, scratch: Path) -> list[DatasetRun]:
    """Peak memory of the same `limit` prompts of work over inputs of 1,000 and of `lines` generated lines (each
    file read lazily to its end: the job counts its lines for the progress total)."""
    runs = []
    for size in (1000, lines):
        path = scratch / f"input-{size}.jsonl"
        _write_input(path, size)
        runs.append(run_generate(f"{size:,} input lines, --limit {limit}",
                                 ["--input", str(path), "--field", "text", "--limit", str(limit),
                                  "--max-new-tokens", str(max_new_tokens)], scratch / f"out-{size}.jsonl"))
        path.unlink()
    return runs


def compare(num_prompts: int, max_new_tokens: int, replicas: int, big_lines: int, rss_limit: int,
            rss_max_new_tokens: int) -> tuple[list[DatasetRun], list[DatasetRun]]:
    """Both groups of runs, one after another, in a scratch directory removed after."""
    with tempfile.TemporaryDirectory() as scratch:
        return (gsm8k_runs(num_prompts, max_new_tokens, replicas, Path(scratch)),
                streaming_runs(big_lines, rss_limit, rss_max_new_tokens, Path(scratch)))


def format_tables(gsm8k: list[DatasetRun], streaming: list[DatasetRun], num_prompts: int,
                  max_new_tokens: int) -> str:
    """Markdown: the GSM8K runs with their throughput ratio to the first, then the streaming memory runs."""
    reference = gsm8k[0].generated_tok_s or 1.0
    lines = [f"`contbatch generate` on the first {num_prompts} GSM8K test questions, greedy, "
             f"max_new_tokens={max_new_tokens}; wall time is the whole command (model load, Ray start included)",
             "", "| run | wall s | lines ok / failed | generated tokens | generated tok/s | peak RSS MiB | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.label} | {r.wall_s:.1f} | {r.lines - r.failed} / {r.failed} | {r.generated_tokens} | "
              f"{r.generated_tok_s:.1f} | {r.peak_rss_mib:.0f} | {r.generated_tok_s / reference:.2f}x |"
              for r in gsm8k]
    lines += ["", "Streaming: the same work over a small and a large generated input (peak RSS of the process)", "",
              "| run | wall s | lines ok / failed | peak RSS MiB |", "|---|---:|---:|---:|"]
    lines += [f"| {r.label} | {r.wall_s:.1f} | {r.lines - r.failed} / {r.failed} | {r.peak_rss_mib:.0f} |"
              for r in streaming]
    return "\n".join(lines)


def _write_input(path: Path, lines: int) -> None:
    """`lines` JSONL records `{"text": ...}` of short arithmetic questions, distinct per line."""
    with path.open("w", encoding="utf-8") as out:
        for index in range(lines):
            out.write(json.dumps({"text": f"What is {index} plus {index % 97}?"}) + "\n")
