"""In-memory OpenTelemetry SDK providers for the telemetry tests, and readers of what they collected."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from contbatch import Telemetry


class Collected:
    """A `Telemetry` whose spans and metrics stay in memory."""

    def __init__(self, detailed_traces: bool = False) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.telemetry = Telemetry(self.tracer_provider, self.meter_provider, detailed_traces)

    def spans(self, prefix: str = "") -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans() if span.name.startswith(prefix)]

    def request_spans(self) -> dict[str, ReadableSpan]:
        """The request spans by `gen_ai.response.id`."""
        return {span.attributes["gen_ai.response.id"]: span for span in self.spans()
                if span.attributes and "gen_ai.response.id" in span.attributes}

    def points(self, name: str) -> list[Any]:
        """The data points of metric `name` (empty when it was never recorded)."""
        data = self.reader.get_metrics_data()
        return [point for metrics in _metrics(data) if metrics.name == name for point in metrics.data.data_points]

    def value(self, name: str, attributes: dict[str, str] | None = None) -> float:
        """The sum (counter), the sum of observations (histogram) or the value (gauge) of metric `name` over the
        points whose attributes include `attributes`."""
        total = 0.0
        for point in self.points(name):
            if all(point.attributes.get(key) == value for key, value in (attributes or {}).items()):
                total += point.sum if hasattr(point, "bucket_counts") else point.value
        return total

    def count(self, name: str, attributes: dict[str, str] | None = None) -> int:
        """The number of observations of histogram `name` in the points whose attributes include `attributes`."""
        return sum(point.count for point in self.points(name)
                   if all(point.attributes.get(key) == value for key, value in (attributes or {}).items()))


def _metrics(data: Any) -> Iterator[Any]:
    if data is None:
        return
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            yield from scope_metrics.metrics
