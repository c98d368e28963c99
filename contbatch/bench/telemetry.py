"""`contbatch bench --workload otel`: contbatch's throughput with OpenTelemetry off and on, in one process.

"On" is what a user gets from `OTEL_EXPORTER_OTLP_ENDPOINT`: the SDK's providers with a batch span processor and
a periodic metric reader (every 5 s here unless `OTEL_METRIC_EXPORT_INTERVAL` says otherwise), exporting spans
and metrics over OTLP/HTTP to a collector, played by a receiver on 127.0.0.1 that counts what it gets. The modes
run in turn, round after round, their order rotating, so host drift spreads over all of them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from statistics import mean

from transformers import PreTrainedModel

from contbatch import ContinuousBatchingConfig, Telemetry
from contbatch.bench.throughput import BenchResult, EosTokenId, run_contbatch

MODES = ("otel off", "otel on", "otel on, detailed traces")


class OtlpSink:
    """A collector stand-in on 127.0.0.1: answers 200 to every OTLP/HTTP export and keeps its body by path."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[bytes]] = {}
        self.lock = threading.Lock()
        received, lock = self.bodies, self.lock

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with lock:
                    received.setdefault(self.path, []).append(body)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def received(self, path: str) -> list[bytes]:
        """The bodies exported to `path` so far, in arrival order."""
        with self.lock:
            return list(self.bodies.get(path, []))

    @property
    def exports(self) -> dict[str, int]:
        with self.lock:
            return {path: len(bodies) for path, bodies in self.bodies.items()}

    @property
    def bytes_received(self) -> int:
        with self.lock:
            return sum(len(body) for bodies in self.bodies.values() for body in bodies)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def otlp_telemetry(endpoint: str, detailed_traces: bool) -> Telemetry:
    """`Telemetry.from_environment` as `OTEL_EXPORTER_OTLP_ENDPOINT=endpoint` configures it (metrics every 5 s
    unless the environment sets an interval)."""
    values = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "contbatch-bench",
              "OTEL_METRIC_EXPORT_INTERVAL": os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "5000")}
    with _environment(values):
        return Telemetry.from_environment(detailed_traces=detailed_traces)


def run_otel(model: PreTrainedModel, inputs: list[list[int]], max_new_tokens: int, eos: EosTokenId,
             config: ContinuousBatchingConfig, rounds: int) -> tuple[list[BenchResult], list[str]]:
    """Runs the workload `rounds` times in each of `MODES`; returns the results in run order and the summary
    lines (mean generated tok/s per mode, the overhead of each "on" mode, whether outputs agree, what the
    collector received). Raises RuntimeError if a mode's outputs differ from "otel off"'s."""
    sink = OtlpSink()
    telemetries = {MODES[0]: Telemetry(), MODES[1]: otlp_telemetry(sink.url, False),
                   MODES[2]: otlp_telemetry(sink.url, True)}
    results: list[BenchResult] = []
    try:
        for index in range(rounds):
            for mode in MODES[index % len(MODES):] + MODES[:index % len(MODES)]:
                result = run_contbatch(model, inputs, max_new_tokens, eos, config, telemetry=telemetries[mode])
                results.append(replace(result, engine=f"contbatch, {mode} (round {index + 1})"))
                print(f"  {results[-1].engine}: {result.wall_s:.1f} s, {result.generated_tok_s:.1f} generated "
                      "tok/s", flush=True)
    finally:
        for telemetry in telemetries.values():
            telemetry.shutdown()
        sink.close()
    return results, _summary(results, sink)


def _summary(results: list[BenchResult], sink: OtlpSink) -> list[str]:
    by_mode = {mode: [r for r in results if f", {mode} (" in r.engine] for mode in MODES}
    reference = by_mode[MODES[0]][0].outputs
    if any(result.outputs != reference for result in results):
        raise RuntimeError("the outputs differ between telemetry modes")
    means = {mode: mean(r.generated_tok_s for r in runs) for mode, runs in by_mode.items()}
    fastest = {mode: max(r.generated_tok_s for r in runs) for mode, runs in by_mode.items()}
    lines = []
    for mode in MODES:
        line = f"{mode}: mean {means[mode]:.1f} generated tok/s, fastest run {fastest[mode]:.1f}"
        if mode != MODES[0]:
            line += (f"; cost against otel off: {100 * (1 - means[mode] / means[MODES[0]]):+.1f}% (means), "
                     f"{100 * (1 - fastest[mode] / fastest[MODES[0]]):+.1f}% (fastest runs)")
        lines.append(line)
    lines.append("outputs identical in every mode: yes")
    exports = ", ".join(f"{count} to {path}" for path, count in sorted(sink.exports.items()))
    lines.append(f"collector received {exports or 'nothing'} ({sink.bytes_received} bytes)")
    return lines
