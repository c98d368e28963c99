"""`contbatch bench --serve`: its pure helpers, process handling, and one tiny run against a live server."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from contbatch.bench import serve as bench_serve
from contbatch.bench.decoding import decoding_of
from contbatch.bench.serve import (
    PeerUnavailable,
    RequestResult,
    RunSummary,
    SSEParser,
    StreamRecorder,
    format_table,
    percentile,
    poisson_schedule,
)
from contbatch.bench.serve_peers import PeerSpec
from contbatch.cli import build_parser
from contbatch.cli.common import engine_config, model_dtype
from contbatch.cli.serve import serve_config


def _chunk(payload: dict[str, object]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _delta(content: str | None, finish_reason: str | None = None) -> dict[str, object]:
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                             "finish_reason": finish_reason}]}


# A stream as `contbatch serve` sends it: role chunk, content chunks (one non-ASCII), the finish chunk, a
# usage chunk with no choices, [DONE].
RECORDED = b"".join([
    _chunk(_delta("")), _chunk(_delta("Natalia")), _chunk(_delta(" sold café")), _chunk(_delta(" 48")),
    _chunk(_delta(None, "length")),
    _chunk({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44}}),
    b"data: [DONE]\n\n",
])


def test_percentile_matches_numpy_linear() -> None:
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 25) == pytest.approx(1.75)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    values = [random.Random(3).uniform(0, 10) for _ in range(101)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    for bad_values, bad_q in (([], 50), ([1.0], -1), ([1.0], 101)):
        with pytest.raises(ValueError):
            percentile(bad_values, bad_q)


def test_poisson_schedule_is_seeded_with_mean_gap_one_over_rate() -> None:
    schedule = poisson_schedule(20_000, 4.0, seed=11)
    assert schedule == poisson_schedule(20_000, 4.0, seed=11)
    assert schedule != poisson_schedule(20_000, 4.0, seed=12)
    assert schedule[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(schedule))
    mean_gap = schedule[-1] / (len(schedule) - 1)
    assert mean_gap == pytest.approx(0.25, rel=0.03)
    assert poisson_schedule(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    assert poisson_schedule(0, 1.0, seed=0) == []
    for n, rate in ((-1, 1.0), (3, 0.0), (3, -2.0), (3, float("nan"))):
        with pytest.raises(ValueError):
            poisson_schedule(n, rate, seed=0)


@pytest.mark.parametrize("size", [1, 3, 7, 64, len(RECORDED)])
def test_sse_parser_reassembles_events_split_anywhere(size: int) -> None:
    parser = SSEParser()
    events = [e for i in range(0, len(RECORDED), size) for e in parser.feed(RECORDED[i:i + size])]
    assert len(events) == 7 and events[-1] == "[DONE]"
    assert json.loads(events[2])["choices"][0]["delta"]["content"] == " sold café"


def test_sse_parser_crlf_comments_and_multiline_data() -> None:
    parser = SSEParser()
    events = parser.feed(b": keep-alive\r\n\r\nevent: x\r\ndata: a\r\ndata:b\r") + parser.feed(b"\n\r\ndata: c")
    assert events == ["a\nb"]
    assert parser.feed(b"\n\n") == ["c"]


def test_recorder_times_content_chunks_and_reads_usage() -> None:
    recorder = StreamRecorder(start=10.0)
    for time_s, data in zip((10.1, 10.3, 10.4, 10.6, 10.6, 10.6, 10.6), SSEParser().feed(RECORDED), strict=True):
        recorder.on_event(data, time_s)
    result = recorder.finish()
    assert result.ok and result.completion_tokens == 4
    assert result.ttft_s == pytest.approx(0.3)  # the empty role chunk is not a token
    assert result.itl_s == pytest.approx([0.1, 0.2])


def test_recorder_accepts_finish_without_done_and_flags_broken_streams() -> None:
    finished = StreamRecorder(0.0)
    for data in SSEParser().feed(_chunk(_delta("x")) + _chunk({**_delta(None, "stop"), "usage": {
            "completion_tokens": 1}})):
        finished.on_event(data, 1.0)
    assert finished.finish().ok  # `transformers serve` ends its streams this way
    truncated = StreamRecorder(0.0)
    truncated.on_event(json.dumps(_delta("x")), 1.0)
    assert "without [DONE]" in (truncated.finish().error or "")
    failed = StreamRecorder(0.0)
    failed.on_event(json.dumps({"error": {"message": "boom"}}), 1.0)
    failed.on_event("[DONE]", 1.0)
    assert failed.finish().error == "boom"


def test_format_table_counts_only_ok_requests() -> None:
    results = [RequestResult(ttft_s=0.1, itl_s=[0.02, 0.04], completion_tokens=3),
               RequestResult(ttft_s=0.3, itl_s=[0.03], completion_tokens=5),
               RequestResult(error="HTTP 503: busy")]
    table = format_table([RunSummary("contbatch", results, 2.0)], 2.0, 3, 8, [("transformers", "no deps\nmore")])
    assert "rate 2 req/s" in table and "N=3" in table and "M=8" in table
    assert "| contbatch | 2 / 3 | 2.00 | 4.0 | 1.00 | 200.0 / 298.0 | 30.0 / 39.8 |" in table
    assert "contbatch: 1 failed request(s); first error: HTTP 503: busy" in table
    assert "transformers: skipped: no deps" in table and "more" not in table


def test_format_table_compares_the_engines_means_over_their_runs() -> None:
    def run(engine: str, tokens: int, seconds: float, gaps: list[float]) -> RunSummary:
        return RunSummary(engine, [RequestResult(ttft_s=0.1, itl_s=gaps, completion_tokens=tokens)], seconds)

    runs = [run("contbatch", 300, 1.0, [0.01] * 99 + [0.2]), run("vllm", 200, 1.0, [0.02] * 100),
            run("contbatch", 500, 1.0, [0.01] * 100), run("vllm", 300, 1.5, [0.02] * 99 + [0.5])]
    table = format_table(runs, float("inf"), 1, 8)
    line = next(line for line in table.splitlines() if line.startswith("Over runs:"))
    assert "contbatch 400.0 output tok/s (mean of 2)" in line and "vllm 200.0 output tok/s (mean of 2)" in line
    assert "contbatch / vllm: 2.00x." in line
    assert "ITL p99 10.0 ms (pooled)" in line and "ITL p99 20.0 ms (pooled)" in line
    assert "Over runs" not in format_table(runs[:1] + runs[2:3], 1.0, 1, 8)


def _bench_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "--serve", *extra])


def test_peer_specs_forward_engine_flags(tmp_path: Path) -> None:
    args = _bench_args("--block-size", "16", "--max-batch-tokens", "128", "--model", str(tmp_path))
    contbatch = bench_serve.peer_spec("contbatch", args, 9001)
    assert contbatch.command[:4] == [sys.executable, "-m", "contbatch.cli", "serve"]
    joined = " ".join(contbatch.command)
    assert "--port 9001" in joined and "--block-size 16" in joined and "--max-batch-tokens 128" in joined
    assert "--num-blocks" not in joined and "--compile" not in joined and "--async-batching auto" in joined
    assert "--max-prefill-tokens-while-decoding" not in joined
    bounded = bench_serve.peer_spec("contbatch", _bench_args("--max-prefill-tokens-while-decoding", "96"), 9001)
    served = build_parser().parse_args(["serve", *bounded.command[4:]])
    assert serve_config(served, torch.device("cpu")).max_prefill_tokens_while_decoding == 96
    compiled = bench_serve.peer_spec("contbatch", _bench_args("--compile", "--async-batching", "on", "--cuda-graphs",
                                                              "off", "--dtype", "bfloat16"), 9001)
    assert compiled.command[-7:] == ["--compile", "--async-batching", "on", "--cuda-graphs", "off", "--dtype",
                                     "bfloat16"]
    served = build_parser().parse_args(["serve", *compiled.command[4:]])
    assert engine_config(served).use_async_batching is True and engine_config(served).use_default_compile_configs
    assert engine_config(served).use_cuda_graph is False and engine_config(args).use_cuda_graph is None
    assert model_dtype(served) is torch.bfloat16 and model_dtype(args) is None
    eager = bench_serve.peer_spec("contbatch", _bench_args("--no-compile"), 9001)
    assert eager.command.count("--no-compile") == 1 and "--compile" not in eager.command
    served = build_parser().parse_args(["serve", *eager.command[4:]])
    assert serve_config(served, torch.device("cpu")).use_default_compile_configs is False
    assert engine_config(args).use_async_batching is None
    transformers = bench_serve.peer_spec("transformers", args, 9002)
    joined = " ".join(transformers.command)
    assert f"serve {tmp_path} --continuous-batching" in joined and "--cb-block-size 16" in joined
    assert "prefill" not in " ".join(bench_serve.peer_spec("transformers", _bench_args(
        "--model", str(tmp_path), "--max-prefill-tokens-while-decoding", "96"), 9002).command)
    assert transformers.model == str(tmp_path) and transformers.env["HF_HUB_OFFLINE"] == "1"


def test_vllm_peer_runs_vllms_server_from_the_peers_environment(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    args = _bench_args("--model", str(tmp_path), "--peers-python", str(python), "--max-batch-tokens", "256")
    spec = bench_serve.peer_spec("vllm", args, 9003)
    joined = " ".join(spec.command)
    assert spec.command[:3] == [str(python), "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert f"--model {tmp_path} --host 127.0.0.1 --port 9003" in joined and "--dtype float32" in joined
    assert "--max-num-batched-tokens 256" in joined and spec.model == "bench-model"
    bf16 = bench_serve.peer_spec("vllm", _bench_args("--peers-python", str(python), "--dtype", "bfloat16"), 9003)
    assert "--dtype bfloat16" in " ".join(bf16.command)
    assert spec.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and spec.env["HF_HUB_OFFLINE"] == "1"
    missing = _bench_args("--model", str(tmp_path), "--peers-python", str(tmp_path / "nowhere"))
    with pytest.raises(PeerUnavailable, match="make bench-peers"):
        bench_serve.peer_spec("vllm", missing, 9003)


def test_load_keeps_at_most_max_concurrency_requests_in_flight() -> None:
    """A stand-in server counts the requests it holds at once; ignore_eos and the sampling flags reach the request
    body (a greedy body carries temperature 0 alone)."""
    state = {"now": 0, "peak": 0, "bodies": []}

    async def handler(request: httpx.Request) -> httpx.Response:
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        state["bodies"].append(json.loads(request.content))
        await asyncio.sleep(0.05)
        state["now"] -= 1
        body = 'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, content=body.encode())

    original = httpx.AsyncClient

    def client(**kwargs: Any) -> httpx.AsyncClient:
        return original(transport=httpx.MockTransport(handler), **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(httpx, "AsyncClient", client)
        decoding = decoding_of(_bench_args("--temperature", "0.7", "--top-p", "0.9", "--top-k", "50"))
        results, _ = asyncio.run(bench_serve.run_load("http://127.0.0.1:9", "m", ["q"] * 8, 4, [0.0] * 8,
                                                      max_concurrency=3, ignore_eos=True, decoding=decoding))
    assert all(result.ok for result in results) and state["peak"] == 3
    assert all(body["ignore_eos"] is True for body in state["bodies"])
    assert all((body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.9, 50) for body in state["bodies"])
    greedy = bench_serve.chat_payload("m", "q", 4, decoding=decoding_of(_bench_args()))
    assert greedy["temperature"] == 0 and "top_p" not in greedy and "top_k" not in greedy


def test_stop_process_kills_a_server_that_ignores_sigterm() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
           "time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    bench_serve.stop_process(process, timeout=0.5)
    assert process.returncode == -9
    process.stdout.close()


def test_a_server_makes_its_ipc_sockets_beside_its_log(tmp_path: Path) -> None:
    code = "import os, socket, time; s = socket.socket(socket.AF_UNIX); " \
           "s.bind(os.path.join(os.environ['VLLM_RPC_BASE_PATH'], 'ipc')); print('bound', flush=True); time.sleep(60)"
    spec = PeerSpec("vllm", [sys.executable, "-c", code], {"PATH": "/usr/bin"}, "m")
    logs = tmp_path / "logs"
    logs.mkdir()
    with bench_serve.server_process(spec, logs / "vllm.log") as process:
        while b"bound" not in (logs / "vllm.log").read_bytes():
            assert process.poll() is None, (logs / "vllm.log").read_text()
            time.sleep(0.01)
    assert (logs / "ipc").is_socket() and process.returncode is not None


def test_wait_ready_reports_a_server_that_exits() -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    with pytest.raises(PeerUnavailable, match="exited with status 3"):
        bench_serve.wait_ready(process, "http://127.0.0.1:9", timeout=30)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_end_to_end_against_a_contbatch_server() -> None:
    """The serving benchmark's client against a real `contbatch serve` of the embedded model, eager (the server's
    compiled warm-up has its own test in tests/entrypoints/openai/test_serve_config.py)."""
    from contbatch.data.prompts import load_prompts

    port = _free_port()
    args = _bench_args("--num-prompts", "3", "--max-new-tokens", "4", "--rate", "10", "--threads", "1", "--no-compile")
    summary = bench_serve.bench_peer("contbatch", args, port, load_prompts(limit=3), poisson_schedule(3, 10.0, 0))
    assert [result.error for result in summary.results] == [None, None, None]
    assert all(result.ttft_s is not None and result.ttft_s > 0 for result in summary.results)
    assert all(1 <= result.completion_tokens <= 4 for result in summary.results)
    assert summary.duration_s > 0
    with socket.socket() as probe:  # the server is gone: its port can be bound again
        probe.bind(("127.0.0.1", port))


def test_a_port_whose_last_server_just_stopped_is_free_again() -> None:
    """The server closing its side of a connection first leaves it in TIME_WAIT on the server's port: a plain bind
    fails for a minute, but servers (asyncio's, so uvicorn's) bind with SO_REUSEADDR and can listen there at
    once."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not bench_serve.port_free(port), "a listening socket holds the port"
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()
            assert client.recv(1) == b""
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    assert bench_serve.port_free(port)
