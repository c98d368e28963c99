"""OpenTelemetry traces and metrics of contbatch (the `otel` extra): `Telemetry` says where they go;
`TelemetryRecorder` makes them. Nothing of OpenTelemetry is imported until a provider is in use."""

from contbatch.telemetry.config import Telemetry
from contbatch.telemetry.recorder import RequestOrigin, RequestTelemetry, TelemetryRecorder
from contbatch.telemetry.sinks import MetricsSink, RequestSummary

__all__ = ["MetricsSink", "RequestOrigin", "RequestSummary", "RequestTelemetry", "Telemetry", "TelemetryRecorder"]
