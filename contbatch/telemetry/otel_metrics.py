"""OpenTelemetry instruments: the GenAI server metrics and the engine's own, one set per meter provider."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from contbatch.engine.outputs import EngineStats
from contbatch.engine.step_timer import StepRecord
from contbatch.telemetry import names
from contbatch.telemetry.sinks import MetricsSink, RequestSummary

if TYPE_CHECKING:
    from contbatch.telemetry.recorder import StatsSource


class _Instruments:
    """The instruments of one meter provider, shared by every client reporting to it; the load gauges sum the
    latest `EngineStats` of the clients' running engine loops (no data point while none runs)."""

    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter(names.INSTRUMENTATION_SCOPE)
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", "s", "Time from a request's arrival to its first generated token",
            explicit_bucket_boundaries_advisory=names.TIME_TO_FIRST_TOKEN_BUCKETS)
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", "s", "Time per generated token after the first, per request",
            explicit_bucket_boundaries_advisory=names.TIME_PER_OUTPUT_TOKEN_BUCKETS)
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", "s", "Time from a request's arrival to its final output",
            explicit_bucket_boundaries_advisory=names.REQUEST_DURATION_BUCKETS)
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", "{token}", "Input (prompt) and output (generated) tokens per request",
            explicit_bucket_boundaries_advisory=names.TOKEN_USAGE_BUCKETS)
        self.hit_tokens = meter.create_counter(
            "contbatch.prefix_cache.hit_tokens", "{token}", "Prompt tokens taken from the prefix cache")
        self.preemptions = meter.create_counter("contbatch.preemptions", "{preemption}", "Requests preempted")
        self.prefill = meter.create_counter("contbatch.prefill.tokens", "{token}", "Prompt tokens computed")
        self.decode = meter.create_counter("contbatch.decode.tokens", "{token}", "Generated tokens computed")
        self.batch_fill = meter.create_histogram(
            "contbatch.batch.fill", "1", "Share of the step's token budget used",
            explicit_bucket_boundaries_advisory=names.BATCH_FILL_BUCKETS)
        self._lock = threading.Lock()
        self._sources: weakref.WeakSet[StatsSource] = weakref.WeakSet()
        gauges: dict[str, tuple[str, str, Callable[[EngineStats], int]]] = {
            "contbatch.requests.running": ("{request}", "Requests being computed", lambda s: s.num_running),
            "contbatch.requests.waiting": ("{request}", "Requests waiting to be admitted", lambda s: s.num_waiting),
            "contbatch.kv_cache.blocks.used": ("{block}", "KV-cache blocks held by requests",
                                               lambda s: s.num_blocks - s.num_free_blocks),
            "contbatch.kv_cache.blocks.free": ("{block}", "KV-cache blocks a request can take (evictable cached "
                                               "ones included)", lambda s: s.num_free_blocks),
            "contbatch.kv_cache.blocks.cached": ("{block}", "KV-cache blocks holding a cached prefix",
                                                 lambda s: s.num_cached_blocks),
            "contbatch.kv_cache.blocks.touched": ("{block}", "KV-cache blocks written at least once since the cache "
                                                  "was allocated", lambda s: s.num_touched_blocks),
        }
        for name, (unit, description, read) in gauges.items():
            meter.create_observable_gauge(name, [self._observer(read)], unit, description)

    def _observer(self, read: Callable[[EngineStats], int]) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                sources = list(self._sources)
            return [Observation(sum(read(source.stats) for source in sources))] if sources else []

        return observe

    def watch(self, source: StatsSource) -> None:
        with self._lock:
            self._sources.add(source)

    def unwatch(self, source: StatsSource) -> None:
        with self._lock:
            self._sources.discard(source)


_SHARED: weakref.WeakKeyDictionary[Any, _Instruments] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def instruments_of(provider: MeterProvider) -> _Instruments:
    """The instruments of `provider`, made on first use."""
    with _SHARED_LOCK:
        if provider not in _SHARED:
            _SHARED[provider] = _Instruments(provider)
        return _SHARED[provider]


class OtelMetrics(MetricsSink):
    """Records contbatch's numbers in `provider`'s instruments."""

    def __init__(self, provider: MeterProvider) -> None:
        self.instruments = instruments_of(provider)
        self._attributes: dict[tuple[str, str], dict[str, str]] = {}

    def watch(self, source: StatsSource) -> None:
        self.instruments.watch(source)

    def unwatch(self, source: StatsSource) -> None:
        self.instruments.unwatch(source)

    def _labels(self, operation: str, model: str) -> dict[str, str]:
        labels = self._attributes.get((operation, model))
        if labels is None:
            labels = self._attributes[(operation, model)] = {names.OPERATION: operation, names.REQUEST_MODEL: model}
        return labels

    def first_token(self, operation: str, model: str, seconds: float) -> None:
        self.instruments.ttft.record(seconds, self._labels(operation, model))

    def request_ended(self, summary: RequestSummary) -> None:
        labels = self._labels(summary.operation, summary.model)
        instruments = self.instruments
        failed = labels if summary.error_type is None else {**labels, names.ERROR_TYPE: summary.error_type}
        instruments.duration.record(summary.duration, failed)
        if summary.time_per_output_token is not None:
            instruments.tpot.record(summary.time_per_output_token, labels)
        instruments.token_usage.record(summary.input_tokens, {**labels, names.TOKEN_TYPE: "input"})
        instruments.token_usage.record(summary.output_tokens, {**labels, names.TOKEN_TYPE: "output"})
        if summary.cached_tokens:
            instruments.hit_tokens.add(summary.cached_tokens)

    def preempted(self) -> None:
        self.instruments.preemptions.add(1)

    def step(self, record: StepRecord) -> None:
        instruments = self.instruments
        if record.num_prefill_tokens:
            instruments.prefill.add(record.num_prefill_tokens)
        if record.num_decode_tokens:
            instruments.decode.add(record.num_decode_tokens)
        instruments.batch_fill.record(record.fill)
