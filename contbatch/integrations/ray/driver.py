"""The driver of `contbatch generate --ray`: the input read lazily into batches, batches spread over engine
replicas (Ray actors), each result line written by the driver as its batch returns."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer

from contbatch import ContinuousBatchingConfig, UnsupportedModelError
from contbatch.data.embedded import resolve_model_dir
from contbatch.integrations.ray.replica import ContbatchPredictor
from contbatch.jobs import JobInput, JobItem, JobProgress, JobSettings, JobSummary, OutputLog, pending_items


@dataclass(frozen=True)
class RayJobOptions:
    """How the job uses Ray: `replicas` actors, each asking `num_cpus` / `num_gpus` and setting torch to
    `threads` threads; `batch_size` items per call, at most `batches_per_replica` calls queued per replica
    (they overlap on its manager); `address` of the cluster (None: connect to one the process already
    initialised, or start a local one)."""

    replicas: int = 1
    address: str | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int | None = None
    batch_size: int = 16
    batches_per_replica: int = 2


def start_replicas(model: str | None, settings: JobSettings, engine_config: ContinuousBatchingConfig | None,
                   options: RayJobOptions) -> tuple[list[Any], str]:
    """Start `options.replicas` named actors (`<prefix>-<i>`); Ray restarts a killed one and retries its
    calls. Returns the actor handles and the name prefix."""
    import ray

    if not ray.is_initialized():
        ray.init(address=options.address)
    prefix = f"contbatch-replica-{uuid.uuid4().hex[:8]}"
    actor = ray.remote(ContbatchPredictor)
    resources = {"num_cpus": options.num_cpus, "num_gpus": options.num_gpus, "max_restarts": -1,
                 "max_task_retries": -1, "max_concurrency": options.batches_per_replica}
    replicas = [actor.options(name=f"{prefix}-{i}", **resources).remote(model, settings, engine_config,
                                                                          options.threads)
                for i in range(options.replicas)]
    return replicas, prefix


def run_ray_job(model: str | None, job_input: JobInput, output_path: str, settings: JobSettings,
                engine_config: ContinuousBatchingConfig | None, options: RayJobOptions, limit: int | None = None,
                overwrite: bool = False, retry_failed: bool = False, progress: bool = True) -> JobSummary:
    """`run_job` on Ray replicas: the same output, settings record, resume and per-line errors. A line is
    written only when its batch returned, so a replica killed mid-batch (whose batch Ray retries on the
    restarted replica) loses and duplicates nothing."""
    import ray

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model), local_files_only=True)
    run = JobProgress(OutputLog(output_path, settings.record(tokenizer), overwrite, retry_failed), job_input, limit,
                      progress)
    replicas: list[Any] = []
    try:
        replicas, _ = start_replicas(model, settings, engine_config, options)
        batches = _batches(pending_items(job_input, run.resume, run.summary, limit), options.batch_size)
        for results in _dispatch(replicas, batches, options.batches_per_replica):
            for record, failed, tokens in results:
                run.write(record, failed, tokens)
    finally:
        run.close()
        for replica in replicas:
            ray.kill(replica, no_restart=True)
    return run.finish()


def _batches(items: Iterator[JobItem], size: int) -> Iterator[list[JobItem]]:
    while batch := list(itertools.islice(items, size)):
        yield batch


def _dispatch(replicas: list[Any], batches: Iterator[list[JobItem]],
              per_replica: int) -> Iterator[list[tuple[dict[str, Any], bool, int]]]:
    """Keep `per_replica` batches queued on each replica; yield each batch's results as it returns. A replica's
    `UnsupportedModelError` (every item would fail alike) is raised as it is, and the job ends."""
    import ray

    running: dict[Any, int] = {}
    load = [0] * len(replicas)
    exhausted = False
    while True:
        while not exhausted and min(load) < per_replica:
            batch = next(batches, None)
            if batch is None:
                exhausted = True
                break
            index = load.index(min(load))
            running[replicas[index].run_items.remote(batch)] = index
            load[index] += 1
        if not running:
            return
        ready, _ = ray.wait(list(running), num_returns=1)
        load[running.pop(ready[0])] -= 1
        try:
            results = ray.get(ready[0])
        except ray.exceptions.RayTaskError as error:  # the model's own failure, as the single process raises it
            if isinstance(error.cause, UnsupportedModelError):
                raise error.cause from None
            raise
        yield results
