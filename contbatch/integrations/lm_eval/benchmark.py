"""`contbatch bench --workload eval`: the shipped lm-eval tasks (a loglikelihood task and a generation task) through
the `contbatch` backend and through lm-eval's own `hf` backend at several batch sizes, same model, same run.

Both backends get the same loaded model object, and only `lm_eval.simple_evaluate` is timed (model loading is not).
`format_table` takes further peers' runs too (lm-eval's `vllm` backend, run elsewhere): contbatch's speed-up is over
the fastest peer of the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import lm_eval
import torch
from lm_eval.api.model import LM
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, PreTrainedModel

from contbatch.data.lm_eval_tasks import GEN_TASK, MC_TASK, TASKS_DIR
from contbatch.integrations.lm_eval.model import ContbatchLM

METRICS = {MC_TASK: "acc,none", GEN_TASK: "exact_match,flexible-extract"}


@dataclass(frozen=True)
class EvalBenchSettings:
    """What to run: the first `limit` documents of each task (the generation task with its default 3-shot
    prompts and `max_gen_toks`), `hf` at each of `hf_batch_sizes`."""

    model_dir: str
    limit: int = 64
    hf_batch_sizes: tuple[int, ...] = (8, 32)
    tasks: tuple[str, ...] = (MC_TASK, GEN_TASK)
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class EvalRun:
    """One backend on one task: wall seconds of `simple_evaluate`, documents, requests and the task's metric."""

    task: str
    backend: str
    batch_size: str
    wall_s: float
    num_docs: int
    num_requests: int
    metric: float


def evaluate(lm: LM, task: str, limit: int) -> tuple[float, dict[str, Any]]:
    """Wall seconds and results of `simple_evaluate` on one shipped task (indexed alone, no bootstrap)."""
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=limit, task_manager=manager,
                                      bootstrap_iters=0, log_samples=True)
    wall = time.perf_counter() - start
    assert results is not None
    return wall, results


def _run(lm: LM, backend: str, batch_size: str, task: str, limit: int) -> EvalRun:
    wall, results = evaluate(lm, task, limit)
    samples = {sample["doc_id"]: sample for sample in results["samples"][task]}  # one per filter: keep one
    requests = sum(len(sample["arguments"]) for sample in samples.values())
    metric = float(results["results"][task][METRICS[task]])
    return EvalRun(task, backend, batch_size, wall, len(samples), requests, metric)


def compare(settings: EvalBenchSettings) -> list[EvalRun]:
    """Every task through `contbatch` then `hf` at each batch size, on one model loaded once."""
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=settings.dtype).eval()
    ours = ContbatchLM(pretrained=model, tokenizer=settings.model_dir)
    references = {size: HFLM(pretrained=model, tokenizer=settings.model_dir, batch_size=size, device="cpu")
                  for size in settings.hf_batch_sizes}
    runs = []
    for task in settings.tasks:
        runs.append(_run(ours, "contbatch", "all at once", task, settings.limit))
        print(_line(runs[-1]), flush=True)
        for size, reference in references.items():
            runs.append(_run(reference, "hf", str(size), task, settings.limit))
            print(_line(runs[-1]), flush=True)
    return runs


def _line(run: EvalRun) -> str:
    return f"  {run.task} {run.backend} (batch {run.batch_size}): {run.wall_s:.1f} s, metric {run.metric:.4f}"


def format_table(runs: list[EvalRun], settings: EvalBenchSettings) -> str:
    """A markdown table per task: each backend's wall time and metric, and contbatch's speed-up over the fastest
    peer run of the task (every backend but contbatch, at every batch size)."""
    lines = [f"lm-eval {lm_eval.__version__}, {settings.limit} documents per task, {settings.dtype}, "
             f"{torch.get_num_threads()} torch threads", "",
             "| task | backend | batch size | docs | requests | wall s | metric | contbatch speed-up |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for task in settings.tasks:
        task_runs = [run for run in runs if run.task == task]
        ours = next(run for run in task_runs if run.backend == "contbatch")
        best = min(run.wall_s for run in task_runs if run.backend != "contbatch")
        for run in task_runs:
            ratio = (best if run is ours else run.wall_s) / ours.wall_s
            lines.append(f"| {task} ({METRICS[task]}) | {run.backend} | {run.batch_size} | {run.num_docs} | "
                         f"{run.num_requests} | {run.wall_s:.1f} | {run.metric:.4f} | "
                         f"{'**' if run is ours else ''}{ratio:.2f}x{'**' if run is ours else ''} |")
    lines += ["", "contbatch speed-up: on contbatch's row, the fastest peer row's wall time over contbatch's; on a "
              "peer's row, that row's wall time over contbatch's."]
    return "\n".join(lines)
