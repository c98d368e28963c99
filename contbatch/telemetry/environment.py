"""OpenTelemetry SDK providers built from the standard `OTEL_*` variables, for `Telemetry.from_environment`.

The SDK reads most variables itself (endpoints, headers, timeouts, compression, the sampler, the resource, the
batch processor and the metric interval). What it leaves to its global auto-configuration, which a library must
not run, is done here: choosing exporters by name through the SDK's entry points. Unlike that
auto-configuration, a bare `otlp` means OTLP/HTTP (`http/protobuf`, the specification's default protocol, and
the exporter contbatch's `otel` extra installs) unless `OTEL_EXPORTER_OTLP_PROTOCOL` says `grpc`.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger("contbatch.telemetry")

SIGNAL_PATHS = {"traces": "v1/traces", "metrics": "v1/metrics"}
_OTLP_BY_PROTOCOL = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
_TRUE = {"true", "1", "yes", "on"}


def providers_from_environment(otlp_traces_endpoint: str | None) -> tuple[Any, Any]:
    """(tracer provider or None, meter provider or None) as the environment configures them (see
    `Telemetry.from_environment`); a problem logs a warning and leaves its signal off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return None, None
    span_exporters = (_flag_exporter(otlp_traces_endpoint) if otlp_traces_endpoint is not None
                      else _exporters("traces"))
    metric_exporters = _exporters("metrics")
    if not span_exporters and not metric_exporters:
        return None, None
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning("contbatch telemetry is off: the OpenTelemetry SDK is not installed (pip install "
                       "'contbatch[otel]')")
        return None, None
    resource = _resource()
    tracer_provider = None
    if span_exporters:
        tracer_provider = TracerProvider(resource=resource)
        for exporter in span_exporters:
            tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    meter_provider = None
    if metric_exporters:
        readers = [exporter if isinstance(exporter, MetricReader) else PeriodicExportingMetricReader(exporter)
                   for exporter in metric_exporters]
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    return tracer_provider, meter_provider


def _resource() -> Any:
    """The SDK's resource from `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`, named "contbatch" when the
    environment names no service."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "contbatch"}))
    return resource


def exporter_names(signal: str) -> list[str]:
    """The exporters `OTEL_<SIGNAL>_EXPORTER` names (`none` names none); unset: `otlp` when an OTLP endpoint is
    configured for the signal (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT`), else
    none."""
    value = os.environ.get(f"OTEL_{signal.upper()}_EXPORTER")
    if value is None:
        endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
        return ["otlp"] if any(os.environ.get(name) for name in endpoints) else []
    return [name.strip() for name in value.split(",") if name.strip() and name.strip().lower() != "none"]


def _exporters(signal: str) -> list[Any]:
    """Instances of the exporters the environment names for `signal`; each that cannot be made is skipped with
    a warning."""
    made = []
    for name in exporter_names(signal):
        entry_name = _entry_name(name, signal)
        if entry_name == "otlp_proto_http":
            problem = _env_endpoint_problem(signal)
            if problem is not None:
                logger.warning("contbatch telemetry: %s are off: %s", signal, problem)
                continue
        exporter = _make_exporter(entry_name, signal)
        if exporter is not None:
            made.append(exporter)
    return made


def _entry_name(name: str, signal: str) -> str:
    if name != "otlp":
        return name
    protocol = (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    return _OTLP_BY_PROTOCOL.get(protocol, f"otlp ({protocol})")


def _make_exporter(entry_name: str, signal: str, **options: Any) -> Any:
    """An instance of the exporter registered as `entry_name` for `signal` (the SDK's entry points), or None
    with a warning."""
    group = f"opentelemetry_{signal}_exporter"
    found = list(importlib.metadata.entry_points(group=group, name=entry_name))
    if not found:
        logger.warning("contbatch telemetry: no %s exporter %r is installed; %s from it are off", signal,
                       entry_name, signal)
        return None
    try:
        return found[0].load()(**options)
    except Exception as error:
        logger.warning("contbatch telemetry: the %s exporter %r cannot be made (%s: %s); %s from it are off",
                       signal, entry_name, type(error).__name__, error, signal)
        return None


def _flag_exporter(endpoint: str) -> list[Any]:
    """The OTLP/HTTP span exporter of `--otlp-traces-endpoint endpoint`, or none with a warning."""
    problem = url_problem(endpoint)
    if problem is not None:
        logger.warning("contbatch telemetry: traces are off: the OTLP traces endpoint %s", problem)
        return []
    exporter = _make_exporter("otlp_proto_http", "traces", endpoint=signal_url(endpoint, "traces"))
    return [exporter] if exporter is not None else []


def signal_url(endpoint: str, signal: str) -> str:
    """`endpoint` with the signal's OTLP/HTTP path (`/v1/traces`, `/v1/metrics`) when it has no path."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return f"{endpoint.rstrip('/')}/{SIGNAL_PATHS[signal]}"
    return endpoint


def url_problem(url: str) -> str | None:
    """What keeps `url` from being an OTLP/HTTP endpoint (it must be http(s)://host[:port][/path]), or None."""
    try:
        parts = urlsplit(url.strip())
        port_ok = parts.port is None or parts.port > 0
    except ValueError as error:
        return f"{url!r} is not a URL ({error})"
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        return f"{url!r} is not an http(s)://host[:port] URL"
    return None


def _env_endpoint_problem(signal: str) -> str | None:
    """What is wrong with the OTLP/HTTP endpoint the environment sets for `signal`, or None."""
    for name in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        value = os.environ.get(name)
        if value:
            problem = url_problem(value)
            return None if problem is None else f"{name}: {problem}"
    return None
