"""`contbatch generate --ray`: two replicas on a local Ray, one killed mid-run, give the single-process output;
`ContbatchPredictor` in `ray.data.Dataset.map_batches` gives the same records."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contbatch import ContinuousBatchingConfig
from contbatch.jobs import JobInput, JobSettings
from tests.jobs.conftest import by_id, job, read_jsonl, write_jsonl

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

PROMPTS = [{"question": f"Question {i}: what comes after {i}?"} for i in range(48)]
ENGINE = ContinuousBatchingConfig(block_size=8, num_blocks=256, max_batch_tokens=256)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        yield
    finally:
        ray.shutdown()


def _kill_one_replica_mid_run(output: Path, killed: list[int]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if output.exists() and output.read_bytes().count(b"\n") >= 4:
            break
        time.sleep(0.02)
    names = [name for name in ray.util.list_named_actors() if name.startswith("contbatch-replica")]
    if not names:
        return
    ray.kill(ray.get_actor(sorted(names)[0]), no_restart=False)
    killed.append(output.read_bytes().count(b"\n"))


def test_two_replicas_with_one_killed_equal_the_single_process_run(local_ray: None, tiny, tiny_dir: Path,
                                                                    tmp_path: Path) -> None:
    from contbatch.integrations.ray import RayJobOptions, run_ray_job

    source = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    settings = JobSettings(model=str(tiny_dir), max_new_tokens=24)
    job(tiny, source, tmp_path / "single.jsonl", settings)
    expected = {k: r["completion"] for k, r in by_id(read_jsonl(tmp_path / "single.jsonl")).items()}

    output = tmp_path / "ray.jsonl"
    killed: list[int] = []
    killer = threading.Thread(target=_kill_one_replica_mid_run, args=(output, killed))
    killer.start()
    options = RayJobOptions(replicas=2, num_cpus=0.5, threads=1, batch_size=4)
    summary = run_ray_job(str(tiny_dir), JobInput(source), str(output), settings, ENGINE, options, progress=False)
    killer.join()
    assert killed and killed[0] < len(PROMPTS), "the replica was killed after the job ended"
    assert summary.ok and summary.succeeded == len(PROMPTS)
    records = by_id(read_jsonl(output))
    assert {k: r["completion"] for k, r in records.items()} == expected


@pytest.mark.skipif(not os.environ.get("CONTBATCH_RAY_DATA_TEST"),
                    reason="Ray Data's start-up costs a minute on 2 cores: set CONTBATCH_RAY_DATA_TEST=1")
def test_map_batches_with_an_actor_pool(local_ray: None, tiny, tiny_dir: Path, tmp_path: Path) -> None:
    from contbatch.integrations.ray import ContbatchPredictor

    rows = [{"key": f"k{i}", **row} for i, row in enumerate(PROMPTS[:8])]
    settings = JobSettings(model=str(tiny_dir), max_new_tokens=8, id_field="key")
    job(tiny, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "single.jsonl", settings)
    expected = by_id(read_jsonl(tmp_path / "single.jsonl"))
    dataset = ray.data.from_items(rows).map_batches(
        ContbatchPredictor, fn_constructor_args=(str(tiny_dir), settings, ENGINE, 1), batch_size=4,
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.5)
    records = {json.loads(row["id"]): json.loads(row["record"]) for row in dataset.take_all()}
    assert records == expected


def test_a_model_contbatch_cannot_run_ends_the_ray_job_by_name(local_ray: None, tmp_path: Path) -> None:
    """A replica's `UnsupportedModelError` reaches the driver as itself, and no line is written."""
    from transformers import AutoTokenizer, BloomConfig, BloomForCausalLM

    from contbatch import UnsupportedModelError
    from contbatch.data.embedded import embedded_model_dir
    from contbatch.integrations.ray import RayJobOptions, run_ray_job

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    BloomForCausalLM(BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=2, n_head=2, bos_token_id=0,
                                 eos_token_id=0)).save_pretrained(tmp_path / "bloom")
    tokenizer.save_pretrained(tmp_path / "bloom")
    source = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:6])
    settings = JobSettings(model="bloom", max_new_tokens=4)
    options = RayJobOptions(replicas=1, num_cpus=0.5, threads=1, batch_size=3)
    with pytest.raises(UnsupportedModelError, match=r"^BloomForCausalLM: 0 of its 2 layers ran"):
        run_ray_job(str(tmp_path / "bloom"), JobInput(source), str(tmp_path / "out.jsonl"), settings, ENGINE, options,
                    progress=False)
    assert read_jsonl(tmp_path / "out.jsonl") == []
