"""Exactly-once resume: a `kill -9` mid-run then a re-run equals an uninterrupted run; truncated last lines,
retried failures, refused setting changes; constant memory and a bounded window on large inputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from contbatch.cli import main
from contbatch.jobs import JobSettings
from tests.jobs.conftest import by_id, job, read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [{"question": f"Question {i}: what comes after {i}?"} for i in range(40)]


def _cli(tiny_dir: Path, source: Path, output: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(tiny_dir), "--input", str(source), "--output", str(output),
            "--max-new-tokens", "24", "--block-size", "8", "--num-blocks", "256", "--threads", "1", "--quiet",
            *extra]


def test_kill_9_then_resume_equals_an_uninterrupted_run(tiny, tiny_dir: Path, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    job(tiny, source, tmp_path / "reference.jsonl", JobSettings(model=str(tiny_dir), max_new_tokens=24))
    expected = {k: r["completion"] for k, r in by_id(read_jsonl(tmp_path / "reference.jsonl")).items()}
    output = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "contbatch.cli", *_cli(tiny_dir, source, output, "--max-in-flight", "2")]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if output.exists() and output.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, process.stderr.read() if process.stderr else ""
    written = output.read_bytes().count(b"\n")
    assert 3 <= written < len(PROMPTS), f"killed after {written} lines: not mid-run"

    finished = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert f"{written} already done" in finished.stderr
    records = by_id(read_jsonl(output))
    assert {k: r["completion"] for k, r in records.items()} == expected


def test_truncated_line_and_retry_failed_and_repeat_runs(tiny, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:6])
    job(tiny, source, tmp_path / "reference.jsonl")
    reference = read_jsonl(tmp_path / "reference.jsonl")
    output = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.settings.json").write_text((tmp_path / "reference.jsonl.settings.json").read_text())
    failed_id = reference[1]["id"]
    kept = [reference[0], {"id": failed_id, "error": "RuntimeError: out of memory"}]
    output.write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"id": 5, "prompt": "Quest')

    summary = job(tiny, source, output)
    assert (summary.skipped, summary.failed, summary.ok) == (2, 1, False), "the error line stays without retry"
    assert by_id(read_jsonl(output))[failed_id] == kept[1]
    summary = job(tiny, source, output, retry_failed=True)
    assert (summary.skipped, summary.failed, summary.ok) == (5, 0, True)
    assert by_id(read_jsonl(output)) == by_id(reference)
    assert job(tiny, source, output).skipped == 6, "a complete output runs nothing"
    assert output.read_bytes().count(b"\n") == 6


def test_changed_settings_are_refused_unless_overwrite(tiny, tiny_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    output = tmp_path / "out.jsonl"
    assert job(tiny, source, output, JobSettings(model="tiny", max_new_tokens=3)).ok
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens: 3 -> 4\).*--overwrite"):
        job(tiny, source, output, JobSettings(model="tiny", max_new_tokens=4))
    assert main(_cli(tiny_dir, source, output, "--temperature", "0.5")) == 2
    assert "--overwrite" in capsys.readouterr().err
    summary = job(tiny, source, output, JobSettings(model="tiny", max_new_tokens=4), overwrite=True)
    assert summary.skipped == 0 and summary.succeeded == 2
    assert all(r["completion_tokens"] <= 4 for r in read_jsonl(output))


def _traced_peak(tiny, source: Path, output: Path, count: int) -> int:
    """Write `count` lines (4 real prompts spread over them, the others without a prompt) and run them under
    tracemalloc; returns the peak of traced memory."""
    every = count // 4
    lines = (json.dumps({"question": f"Say {i}." if i % every == 0 else "", "pad": "x" * 40}) for i in range(count))
    with source.open("w") as file:
        file.writelines(line + "\n" for line in lines)
    tracemalloc.start()
    try:
        summary = job(tiny, source, output, JobSettings(model="tiny", max_new_tokens=2, max_in_flight=4))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (summary.succeeded, summary.failed) == (4, count - 4)
    assert output.read_bytes().count(b"\n") == count
    return peak


def test_a_large_input_streams_in_bounded_memory(tiny, tmp_path: Path) -> None:
    job(tiny, write_jsonl(tmp_path / "warm.jsonl", PROMPTS[:2]), tmp_path / "warm_out.jsonl")
    small = _traced_peak(tiny, tmp_path / "small.jsonl", tmp_path / "small_out.jsonl", 20_000)
    large = _traced_peak(tiny, tmp_path / "large.jsonl", tmp_path / "large_out.jsonl", 60_000)
    assert (tmp_path / "large.jsonl").stat().st_size > 3_500_000
    assert large < small + 200_000, f"peak {large} bytes for 60000 lines, {small} for 20000"
