"""`Telemetry`: where contbatch sends OpenTelemetry spans and metrics, and how that is decided by default."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

_PLACEHOLDER_PROVIDERS = {"ProxyTracerProvider", "NoOpTracerProvider", "_ProxyMeterProvider", "NoOpMeterProvider"}


@dataclass(frozen=True)
class Telemetry:
    """Where a client (manager, `generate_batch`, server) sends its telemetry: one span per request to
    `tracer_provider`, its metrics to `meter_provider`; either may be None (that signal is off). With
    `detailed_traces`, every engine step also gets a span, with child spans for scheduling, the forward and
    sampling. contbatch never installs global providers; hand it yours (`Telemetry(tracer_provider=...)`), or
    let `Telemetry.default()` find them.

    `Telemetry()` is off: requests cost nothing more than without telemetry and nothing of OpenTelemetry is
    imported. Two `Telemetry` are equal when they name the same providers and the same detail. `owns_providers`
    (set by `from_environment`) lets `shutdown()` shut the providers down.
    """

    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    detailed_traces: bool = False
    owns_providers: bool = field(default=False, compare=False)

    @property
    def enabled(self) -> bool:
        return self.tracer_provider is not None or self.meter_provider is not None

    @classmethod
    def default(cls, otlp_traces_endpoint: str | None = None, detailed_traces: bool = False) -> Telemetry:
        """The telemetry of a client given none, in this order:

        1. `otlp_traces_endpoint` given (`contbatch serve --otlp-traces-endpoint URL`): `from_environment`
           with that traces endpoint;
        2. the application installed global OpenTelemetry providers (`trace.set_tracer_provider`, or
           `opentelemetry-instrument`): those;
        3. `OTEL_*` environment variables ask for an exporter: `from_environment()` (built once per process and
           environment, then shared by every client);
        4. otherwise off (`Telemetry()`)."""
        if otlp_traces_endpoint is not None:
            return cls.from_environment(otlp_traces_endpoint, detailed_traces)
        found = _global_providers()
        if found is not None:
            return cls(*found, detailed_traces=detailed_traces)
        settings = tuple(sorted((key, value) for key, value in os.environ.items() if key.startswith("OTEL_")))
        if not settings:
            return cls(detailed_traces=detailed_traces) if detailed_traces else OFF
        key = (settings, detailed_traces)
        with _CACHE_LOCK:
            if key not in _FROM_ENVIRONMENT:
                _FROM_ENVIRONMENT[key] = cls.from_environment(None, detailed_traces)
            return _FROM_ENVIRONMENT[key]

    @classmethod
    def from_environment(cls, otlp_traces_endpoint: str | None = None, detailed_traces: bool = False) -> Telemetry:
        """Providers of the OpenTelemetry SDK, configured by the standard variables: `OTEL_TRACES_EXPORTER` and
        `OTEL_METRICS_EXPORTER` (comma-separated exporter names: `otlp`, `console`, any installed exporter;
        `none`), `OTEL_EXPORTER_OTLP_ENDPOINT` (alone it turns both signals on, over OTLP), the per-signal
        `OTEL_EXPORTER_OTLP_{TRACES,METRICS}_*`, `OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf`, the default,
        or `grpc` with its exporter installed), `OTEL_SERVICE_NAME` (default "contbatch"),
        `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_METRIC_EXPORT_INTERVAL` and
        `OTEL_SDK_DISABLED`. `otlp_traces_endpoint` sends traces over OTLP/HTTP to that URL (a URL without a
        path gets `/v1/traces`) instead of `OTEL_TRACES_EXPORTER`'s exporters.

        Never raises for a bad configuration: an unknown exporter, an endpoint that is not an http(s) URL or a
        missing SDK logs a warning and leaves that signal off. An unreachable endpoint only makes the
        background exporter log warnings. The providers are flushed and shut down at exit (or by `shutdown()`).
        """
        from contbatch.telemetry.environment import providers_from_environment

        tracer_provider, meter_provider = providers_from_environment(otlp_traces_endpoint)
        return cls(tracer_provider, meter_provider, detailed_traces, owns_providers=True)

    def shutdown(self) -> None:
        """Flushes and shuts down the providers `from_environment` made; providers handed in are left alone."""
        if self.owns_providers:
            for provider in (self.tracer_provider, self.meter_provider):
                if provider is not None:
                    cast(Any, provider).shutdown()


OFF = Telemetry()
_FROM_ENVIRONMENT: dict[tuple[Any, ...], Telemetry] = {}
_CACHE_LOCK = threading.Lock()


def _global_providers() -> tuple[Any, Any] | None:
    """The global tracer and meter providers the application installed (a placeholder counts as none); None
    when it installed neither. Without OpenTelemetry imported nobody installed any, and nothing is imported."""
    tracer_provider = meter_provider = None
    if "opentelemetry.trace" in sys.modules:
        from opentelemetry import trace

        tracer_provider = trace.get_tracer_provider()
    if "opentelemetry.metrics" in sys.modules:
        from opentelemetry import metrics

        meter_provider = metrics.get_meter_provider()
    found = (_installed(tracer_provider), _installed(meter_provider))
    return found if any(provider is not None for provider in found) else None


def _installed(provider: Any) -> Any:
    """`provider`, or None when it is a placeholder (nothing installed)."""
    return None if type(provider).__name__ in _PLACEHOLDER_PROVIDERS else provider
