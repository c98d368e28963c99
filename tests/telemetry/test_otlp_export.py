"""End to end: `contbatch serve --otlp-traces-endpoint` exports over OTLP/HTTP to a receiver on 127.0.0.1, and the
request span it sends is parented on the `traceparent` the client sent."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from contbatch.bench.serve import stop_process, wait_ready
from contbatch.bench.telemetry import OtlpSink

ROOT = Path(__file__).resolve().parents[2]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


class Receiver(OtlpSink):
    """The bench's OTLP/HTTP receiver, with the exported protobuf decoded."""

    def spans(self) -> list[tuple[dict[str, str], Span]]:
        """Every span received, with its resource's string attributes."""
        found = []
        for body in self.received("/v1/traces"):
            for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
                resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                found += [(resource, span) for scope in resource_spans.scope_spans for span in scope.spans]
        return found

    def metric_names(self) -> set[str]:
        return {metric.name for body in self.received("/v1/metrics")
                for resource in ExportMetricsServiceRequest.FromString(body).resource_metrics
                for scope in resource.scope_metrics for metric in scope.metrics}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiving = Receiver()
    yield receiving
    receiving.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _poll(condition: Callable[[], object], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def test_serve_exports_the_request_span_under_the_callers_traceparent(receiver: Receiver, tmp_path: Path) -> None:
    port = _free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "OTEL_BSP_SCHEDULE_DELAY": "50",
           "OTEL_SERVICE_NAME": "contbatch-e2e", "OTEL_METRICS_EXPORTER": "otlp",
           "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"{receiver.url}/v1/metrics", "OTEL_METRIC_EXPORT_INTERVAL": "200"}
    command = [sys.executable, "-m", "contbatch.cli", "serve", "--port", str(port), "--served-model-name", "smol",
               "--otlp-traces-endpoint", receiver.url, "--num-blocks", "64", "--max-batch-tokens", "128",
               "--no-compile"]
    with open(tmp_path / "serve.log", "wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        wait_ready(process, f"http://127.0.0.1:{port}", timeout=120)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                              json={"model": "smol", "prompt": "The capital of France is", "max_tokens": 3},
                              headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        assert response.status_code == 200, response.text

        def ours() -> list[tuple[dict[str, str], Span]]:
            return [(resource, span) for resource, span in receiver.spans()
                    if span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID]

        _poll(ours, "exported request span")
        _poll(lambda: "gen_ai.server.request.duration" in receiver.metric_names(), "exported metrics")
    finally:
        stop_process(process)
    ((resource, span),) = ours()
    attributes = {kv.key: kv.value for kv in span.attributes}
    assert span.name == "text_completion smol" and span.kind == Span.SPAN_KIND_SERVER
    assert resource["service.name"] == "contbatch-e2e"
    assert attributes["gen_ai.usage.output_tokens"].int_value == 3
    assert attributes["gen_ai.request.model"].string_value == "smol"
    assert "gen_ai.client.token.usage" in receiver.metric_names()
