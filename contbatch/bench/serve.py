"""`contbatch bench --serve`: an online load benchmark of OpenAI-compatible servers on 127.0.0.1.

Each peer (`contbatch serve`, `transformers serve --continuous-batching`, vLLM's server: `serve_peers`) is started
as a subprocess, warmed up with one request, then sent the first N GSM8K questions as streaming chat requests at
Poisson arrival times, at most `--max-concurrency` in flight (further arrivals wait for a free slot, as vLLM's own
`vllm bench serve --max-concurrency` does).
Per request it records the time to first token (TTFT: from sending the request to the first chunk with
non-empty content), the inter-token latencies (ITL: gaps between consecutive content chunks, so a chunk
carrying several tokens counts as one gap) and the completion tokens the server reports in its usage chunk.
Traffic only ever goes to 127.0.0.1, and every server started here is stopped before its peer's run returns.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from contbatch.bench.decoding import GREEDY, Decoding, decoding_of
from contbatch.bench.serve_peers import (
    HOST,
    PEERS,
    PeerUnavailable,
    peer_spec,
    port_free,
    server_process,
    stop_process,
    wait_ready,
)

__all__ = ["PeerUnavailable", "bench_peer", "format_table", "peer_spec", "run", "stop_process", "wait_ready"]

REQUEST_TIMEOUT_S = 600.0
WARMUP_TOKENS = 4
WARMUP_REQUESTS = 2


def percentile(values: Sequence[float], q: float) -> float:
    """Return the `q`-th percentile (0 <= q <= 100) of `values`, interpolating linearly between closest ranks.
    Matches numpy's default ("linear") method. Raises ValueError on an empty sequence or q outside [0, 100]."""
    if not values or not 0 <= q <= 100:
        raise ValueError(f"need a non-empty sequence and 0 <= q <= 100, got {len(values)} values, q={q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def poisson_schedule(n: int, rate: float, seed: int) -> list[float]:
    """Return `n` arrival offsets in seconds: the first at 0, then gaps drawn from Exp(`rate`).

    The draws come from `random.Random(seed)`, so a (n, rate, seed) triple always gives the same schedule;
    `rate=inf` sends everything at 0. Raises ValueError if n < 0 or rate <= 0 (or NaN)."""
    if n < 0 or not rate > 0:
        raise ValueError(f"need n >= 0 and rate > 0 requests/s, got n={n}, rate={rate}")
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) if math.isfinite(rate) else 0.0 for _ in range(n - 1)]
    return list(itertools.accumulate(gaps, initial=0.0)) if n else []


class SSEParser:
    """Incremental parser of a `text/event-stream` body with LF or CRLF line ends.

    `feed(chunk)` takes the body in byte chunks split anywhere (even inside a UTF-8 character or a CRLF) and
    returns the data of each event completed by that chunk, in order, an event's `data:` lines joined with
    "\\n". Comments, other fields and events without data are dropped."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        events: list[str] = []
        for raw in lines:
            line = raw.removesuffix(b"\r").decode("utf-8", errors="replace")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events


@dataclass
class RequestResult:
    """One request's outcome; `ok` is True iff `error` is None. Times are in seconds."""

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class StreamRecorder:
    """Turns one streamed response's SSE event data into a `RequestResult`.

    Call `on_event(data, t)` for each event in arrival order with the `time.perf_counter()` value at which its
    bytes arrived, then `finish()`. A stream is ok iff it carried no error event and ended with `[DONE]` or
    after a chunk with a `finish_reason` (`transformers serve` 5.23 closes its streams without `[DONE]`).
    Completion tokens come from the last usage object; without one, the number of content chunks stands in.
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.content_times: list[float] = []
        self.usage_tokens: int | None = None
        self.done = False  # saw [DONE] or a finish_reason
        self.error: str | None = None

    def on_event(self, data: str, now: float) -> None:
        if data == "[DONE]":
            self.done = True
            return
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            payload = None
        if not isinstance(payload, dict):
            self.error = self.error or f"unparsable event: {data[:80]!r}"
            return
        if "error" in payload:
            detail = payload["error"]
            self.error = self.error or str(detail.get("message", detail) if isinstance(detail, dict) else detail)
        usage = payload.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        choices = [choice for choice in payload.get("choices") or [] if isinstance(choice, dict)]
        if any(_has_content(choice) for choice in choices):
            self.content_times.append(now)
        self.done = self.done or any(choice.get("finish_reason") for choice in choices)

    def finish(self) -> RequestResult:
        error = self.error or (None if self.done else "stream ended without [DONE] or a finish_reason")
        times = self.content_times
        return RequestResult(
            ttft_s=times[0] - self.start if times else None,
            itl_s=[later - earlier for earlier, later in itertools.pairwise(times)],
            completion_tokens=self.usage_tokens if self.usage_tokens is not None else len(times), error=error)


def _has_content(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    # Chat chunks carry `delta.content`; legacy completion chunks carry `text`.
    return bool(delta.get("content") if isinstance(delta, dict) else choice.get("text"))


async def stream_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> RequestResult:
    """POST `payload` to `url` as a streaming request and time its chunks; never raises on HTTP failures."""
    recorder = StreamRecorder(time.perf_counter())
    parser = SSEParser()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                return RequestResult(error=f"HTTP {response.status_code}: {body[:200]}")
            async for chunk in response.aiter_bytes():
                now = time.perf_counter()
                for data in parser.feed(chunk):
                    recorder.on_event(data, now)
    except httpx.HTTPError as error:
        return RequestResult(error=f"{type(error).__name__}: {error}")
    return recorder.finish()


def chat_payload(model: str, question: str, max_tokens: int, ignore_eos: bool = False,
                 decoding: Decoding = GREEDY) -> dict[str, Any]:
    """The benchmark's request body: one user turn, `decoding` (greedy by default; sampled, its top_p and top_k,
    an extra field both servers take), streamed with a usage chunk; with `ignore_eos`, vLLM's extra field that
    makes every request generate `max_tokens` tokens (contbatch takes it too)."""
    payload = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
               "temperature": decoding.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if not decoding.is_greedy:
        payload.update(top_p=decoding.top_p, top_k=decoding.top_k)
    return {**payload, "ignore_eos": True} if ignore_eos else payload


async def run_load(base_url: str, model: str, questions: Sequence[str], max_tokens: int,
                   schedule: Sequence[float], max_concurrency: int | None = None,
                   ignore_eos: bool = False, decoding: Decoding = GREEDY) -> tuple[list[RequestResult], float]:
    """Send one chat request per question at `schedule` offsets, at most `max_concurrency` at once (None: no
    bound); return the results (in question order) and the seconds from the first scheduled arrival to the last
    completion."""
    url = f"{base_url}/v1/chat/completions"
    # trust_env=False: a proxy from the environment must never see loopback benchmark traffic. The pool must
    # hold every in-flight request, or requests would queue client-side and inflate TTFT.
    limits = httpx.Limits(max_connections=len(questions), max_keepalive_connections=len(questions))
    async with httpx.AsyncClient(trust_env=False, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()

        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else nullcontext()

        async def one(question: str, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with slots:
                return await stream_request(client, url, chat_payload(model, question, max_tokens, ignore_eos,
                                                                      decoding))

        results = await asyncio.gather(*(one(q, o) for q, o in zip(questions, schedule, strict=True)))
        return list(results), time.perf_counter() - start


@dataclass
class RunSummary:
    """One peer's measured run: its per-request results and the run's duration in seconds."""

    engine: str
    results: list[RequestResult]
    duration_s: float

    @property
    def ok(self) -> list[RequestResult]:
        return [result for result in self.results if result.ok]


def bench_peer(name: str, args: argparse.Namespace, port: int, questions: Sequence[str],
               schedule: Sequence[float]) -> RunSummary:
    """Start peer `name` on `port`, wait for it, warm it up, run the load, stop it (also on errors).

    Raises PeerUnavailable when the peer cannot run here or fails before the measured run; the reason then
    ends with the tail of the server's log."""
    if not port_free(port):
        raise PeerUnavailable(f"port {port} on {HOST} is already in use")
    spec = peer_spec(name, args, port)
    base_url = f"http://{HOST}:{port}"
    with tempfile.TemporaryDirectory(prefix="contbatch-bench-") as logs:
        log_path = Path(logs) / f"{name}.log"
        with server_process(spec, log_path) as process:
            try:
                wait_ready(process, base_url)
                # Two short concurrent requests, so that lazy initialisation (and a compiled server's graphs for
                # one and for several requests) does not land in the measured run.
                warm = questions[:WARMUP_REQUESTS]
                failed = [result for result in asyncio.run(run_load(base_url, spec.model, warm, WARMUP_TOKENS,
                                                                    [0.0] * len(warm)))[0] if not result.ok]
                if failed:
                    raise PeerUnavailable(f"a warm-up request failed: {failed[0].error}")
            except PeerUnavailable as error:
                tail = "\n".join("    " + line for line in log_path.read_text(errors="replace").splitlines()[-15:])
                raise PeerUnavailable(f"{error}; server log tail:\n{tail}") from error
            load = run_load(base_url, spec.model, questions, args.max_new_tokens, schedule, args.max_concurrency,
                            args.ignore_eos, decoding_of(args))
            results, duration = asyncio.run(load)
    return RunSummary(name, results, duration)


def _pair_ms(values: Sequence[float]) -> str:
    return f"{percentile(values, 50) * 1e3:.1f} / {percentile(values, 99) * 1e3:.1f}" if values else "-"


def _output_rate(run: RunSummary) -> float:
    return sum(result.completion_tokens for result in run.ok) / run.duration_s


def _comparison(summaries: Sequence[RunSummary]) -> list[str]:
    """With two engines or more: each engine's mean output tok/s over its runs and the p99 of its runs' pooled
    inter-token gaps, then the first engine's mean over each other's (the same-run ratio the benchmark is for)."""
    runs: dict[str, list[RunSummary]] = {}
    for run in summaries:
        runs.setdefault(run.engine, []).append(run)
    if len(runs) < 2:
        return []
    means = {engine: sum(map(_output_rate, group)) / len(group) for engine, group in runs.items()}
    parts = []
    for engine, group in runs.items():
        gaps = [gap for run in group for result in run.ok for gap in result.itl_s]
        p99 = f"{percentile(gaps, 99) * 1e3:.1f} ms" if gaps else "-"
        parts.append(f"{engine} {means[engine]:.1f} output tok/s (mean of {len(group)}), ITL p99 {p99} (pooled)")
    first, *others = runs
    ratios = ", ".join(f"{first} / {other}: {means[first] / means[other]:.2f}x" for other in others if means[other])
    return [f"Over runs: {'; '.join(parts)}." + (f" {ratios}." if ratios else "")]


def format_table(summaries: Sequence[RunSummary], rate: float, num_prompts: int, max_tokens: int,
                 skipped: Sequence[tuple[str, str]] = (), load: str = "") -> str:
    """Render the runs as a markdown table under a workload line; then, with two engines or more, a line comparing
    their means (`_comparison`); then a line per skipped peer and per peer with failed requests. Throughputs count
    only ok requests; ITL percentiles pool every ok request's gaps."""
    lines = [f"rate {rate:g} req/s (Poisson arrivals), N={num_prompts} prompts, M={max_tokens} max tokens"
             + (f", {load}" if load else ""), "",
             "| engine | requests ok / total | duration s | output tok/s | requests/s | TTFT p50 / p99 (ms) "
             "| ITL p50 / p99 (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    notes: list[str] = _comparison(summaries)
    for run in summaries:
        ok = run.ok
        ttft = [result.ttft_s for result in ok if result.ttft_s is not None]
        itl = [gap for result in ok for gap in result.itl_s]
        lines.append(f"| {run.engine} | {len(ok)} / {len(run.results)} | {run.duration_s:.2f} "
                     f"| {_output_rate(run):.1f} | {len(ok) / run.duration_s:.2f} | {_pair_ms(ttft)} "
                     f"| {_pair_ms(itl)} |")
        failed = [result.error for result in run.results if not result.ok]
        if failed:
            notes.append(f"{run.engine}: {len(failed)} failed request(s); first error: {failed[0]}")
    notes += [f"{name}: skipped: {reason.splitlines()[0]}" for name, reason in skipped]
    return "\n".join(lines + (["", *notes] if notes else []))


def run(args: argparse.Namespace) -> int:
    """The `contbatch bench --serve` command: benchmark each peer in turn, print (and write) the table.
    Returns 0 when at least one peer ran, else 1. Raises ValueError on invalid flags."""
    from contbatch.data.prompts import load_prompts

    names = [name.strip() for name in args.peers.split(",") if name.strip()]
    if not names or set(names) - set(PEERS):
        raise ValueError(f"--peers: {args.peers!r} is not a comma-separated subset of {','.join(PEERS)}")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-prompts and --max-new-tokens must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    decoding = decoding_of(args)
    questions = load_prompts(limit=args.num_prompts)
    schedule = poisson_schedule(len(questions), args.rate, args.seed)
    print(f"workload: {len(questions)} GSM8K questions, max_tokens={args.max_new_tokens}, {decoding.describe()}, "
          f"Poisson arrivals at {args.rate:g} req/s (seed {args.seed}); {os.cpu_count()} CPUs", flush=True)
    summaries: list[RunSummary] = []
    skipped: list[tuple[str, str]] = []
    for index, name in enumerate(names):
        started = time.perf_counter()
        try:
            summary = bench_peer(name, args, args.port_base + index, questions, schedule)
        except PeerUnavailable as error:
            print(f"  {name}: skipped: {error}", flush=True)
            skipped.append((name, str(error)))
            continue
        summaries.append(summary)
        print(f"  {name}: {len(summary.ok)}/{len(summary.results)} ok in {summary.duration_s:.1f} s "
              f"({time.perf_counter() - started:.1f} s with start-up)", flush=True)
    load = ", ".join(part for part in (f"at most {args.max_concurrency} in flight" if args.max_concurrency else "",
                                       "ignore_eos" if args.ignore_eos else "") if part)
    table = format_table(summaries, args.rate, len(questions), args.max_new_tokens, skipped, load)
    print("\n" + table)
    if args.output:
        Path(args.output).write_text(table + "\n")
    return 0 if summaries else 1
