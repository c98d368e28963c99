"""lm-eval's own `vllm` backend (vLLM-CPU) as a peer of the eval workload, run in the peers environment.

`run_vllm_eval` writes the tasks to a JSON request, runs `lm_eval_vllm_runner.py` (a standalone script shipped next
to this module) with the peers environment's Python and vLLM's settings (`vllm_peer.run_in_peers`), and reads
each task's wall time and metric back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from contbatch.bench import vllm_peer

RUNNER_PATH = Path(__file__).resolve().with_name("lm_eval_vllm_runner.py")


@dataclass(frozen=True)
class PeerEvalRun:
    """One task through lm-eval's `vllm` backend: wall seconds of its `simple_evaluate`, documents, requests and
    the task's metric."""

    task: str
    wall_s: float
    num_docs: int
    num_requests: int
    metric: float


@dataclass(frozen=True)
class PeerEval:
    """Every task's run, and a line naming vLLM's version, its load time and settings (for the table's notes)."""

    runs: list[PeerEvalRun]
    settings: str


def parse_result(text: str, tasks: Sequence[str]) -> tuple[list[PeerEvalRun], float, str]:
    """The runner's result JSON `text` as (runs, load seconds, vLLM's version).

    Raises:
        RuntimeError: the result is malformed or its tasks are not `tasks`, in order.
    """
    try:
        data = json.loads(text)
        runs = [PeerEvalRun(str(run["task"]), float(run["wall_s"]), int(run["num_docs"]), int(run["num_requests"]),
                            float(run["metric"])) for run in data["runs"]]
        load_s, version = float(data["load_s"]), str(data["vllm_version"])
    except (ValueError, KeyError, TypeError) as error:
        raise RuntimeError(f"lm-eval vLLM peer: malformed runner result ({error!r}): {text[:200]!r}") from error
    if [run.task for run in runs] != list(tasks):
        raise RuntimeError(f"lm-eval vLLM peer: the runner ran {[run.task for run in runs]}, not {list(tasks)}")
    return runs, load_s, version


def run_vllm_eval(model_dir: str | Path, tasks_dir: str | Path, metrics: Mapping[str, str], limit: int,
                  dtype: torch.dtype = torch.float32, *, python: str | Path | None = None,
                  runner: str | Path = RUNNER_PATH, block_size: int = vllm_peer.BLOCK_SIZE,
                  timeout_s: float | None = 3600.0) -> PeerEval:
    """The tasks of `metrics` (task -> metric key), in order, each on its first `limit` documents, through
    lm-eval's `vllm` backend on the model in `model_dir`, with vLLM's settings of the throughput bench and its KV
    cache in blocks of `block_size` tokens. Only each task's `simple_evaluate` is timed; constructing the backend
    (model load and compilation) comes first, untimed. `runner` is the script to run (tests substitute a fake one).

    Raises:
        FileNotFoundError: no peers Python (see `vllm_peer.peers_python`).
        RuntimeError: the runner failed or timed out (the message ends with its log's tail), or its result is
            malformed.
    """
    tasks = list(metrics)
    request = {"model": str(model_dir), "dtype": vllm_peer.dtype_name(dtype), "tasks_dir": str(tasks_dir),
               "tasks": tasks, "metrics": dict(metrics), "limit": limit, "block_size": block_size}
    text, settings = vllm_peer.run_in_peers(runner, request, python, vllm_peer.KV_CACHE_GIB, timeout_s)
    runs, load_s, version = parse_result(text, tasks)
    line = (f"vllm (lm-eval's backend): vllm {version}, load + compile {load_s:.1f} s untimed; KV blocks of "
            f"{block_size} tokens; {vllm_peer.describe_settings(settings)}")
    return PeerEval(runs, line)
