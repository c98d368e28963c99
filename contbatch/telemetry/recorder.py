"""`TelemetryRecorder`: turns a client's requests and the engine's steps into spans and metrics.

One recorder per client. Requests get a `RequestTelemetry` when they are submitted (on the submitting thread);
the engine thread feeds it the request's deltas and closes it with the final output. Nothing here imports
OpenTelemetry: the SDK-facing parts (`otel_traces`, `otel_metrics`) are imported only when a provider is given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from contbatch.engine.outputs import EngineStats, EventType, RequestDelta, RequestEvent
from contbatch.engine.request import RequestStatus
from contbatch.engine.sampling_params import SamplingParams
from contbatch.engine.step_timer import NO_STEP_TIMER, RecordingStepTimer, StepRecord, StepTimer
from contbatch.outputs import GenerationOutput
from contbatch.telemetry import names
from contbatch.telemetry.config import Telemetry
from contbatch.telemetry.sinks import MetricsSink, RequestSummary

if TYPE_CHECKING:
    from contbatch.telemetry.otel_metrics import OtelMetrics
    from contbatch.telemetry.otel_traces import SpanWriter

logger = logging.getLogger("contbatch.telemetry")


class StatsSource(Protocol):
    """What the load gauges read: an engine loop's latest `EngineStats`."""

    @property
    def stats(self) -> EngineStats: ...


@dataclass(frozen=True)
class RequestOrigin:
    """Who sent a request, for its telemetry.

    Attributes:
        operation: its `gen_ai.operation.name`: "text_completion" or "chat".
        model: its `gen_ai.request.model`; None: the client's model name.
        parent: the OpenTelemetry `Context` its span is parented on (e.g. extracted from a `traceparent` header);
            None: the submitting thread's current context.
    """

    operation: str = "text_completion"
    model: str | None = None
    parent: Any = None


class RequestTelemetry:
    """One request's record: its request attributes, then the moments of its life as its deltas come.

    Made on the submitting thread; from then on only the engine thread touches it. Times are `time.time()`."""

    __slots__ = ("arrival", "attributes", "first_scheduled", "first_token", "last_token", "model",
                 "num_prompt_tokens", "operation", "parent", "preemptions", "recorder", "request_id")

    def __init__(self, recorder: TelemetryRecorder, request_id: str, num_prompt_tokens: int, operation: str,
                 model: str, attributes: dict[str, Any], parent: Any, arrival: float) -> None:
        self.recorder, self.request_id, self.num_prompt_tokens = recorder, request_id, num_prompt_tokens
        self.operation, self.model, self.attributes, self.parent = operation, model, attributes, parent
        self.arrival = arrival
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.preemptions: list[float] = []

    def observe(self, delta: RequestDelta) -> None:
        """Takes in one delta of the request."""
        if delta.events:
            self._events(delta.events)
        if delta.new_token_ids:
            if self.first_token is None:
                self.first_token = delta.timestamp
                self.recorder.first_token(self)
            self.last_token = delta.timestamp

    def _events(self, events: tuple[RequestEvent, ...]) -> None:
        for event in events:
            if event.type is EventType.SCHEDULED and self.first_scheduled is None:
                self.first_scheduled = event.timestamp
            elif event.type is EventType.PREEMPTED:
                self.preemptions.append(event.timestamp)
                self.recorder.preempted()

    def finish(self, output: GenerationOutput) -> None:
        """Ends the record with the request's final output: its span and its metrics are emitted."""
        self.recorder.finish(self, output, time.time())

    def timings(self, end: float) -> dict[str, float]:
        """The `contbatch.request.*` timings known (seconds), for a request that ended at `end`."""
        found: dict[str, float] = {}
        if self.first_scheduled is not None:
            found[names.TIME_IN_QUEUE] = self.first_scheduled - self.arrival
        if self.first_token is not None:
            found[names.TIME_TO_FIRST_TOKEN] = self.first_token - self.arrival
            if self.first_scheduled is not None:
                found[names.PREFILL_TIME] = self.first_token - self.first_scheduled
            found[names.DECODE_TIME] = (self.last_token or self.first_token) - self.first_token
        return found

    def summary(self, output: GenerationOutput, end: float) -> RequestSummary:
        num_output = len(output.generated_tokens)
        per_token = None
        if output.status == RequestStatus.FINISHED and num_output > 1 and self.first_token is not None:
            per_token = ((self.last_token or self.first_token) - self.first_token) / (num_output - 1)
        error_type = names.FAILED_ERROR_TYPE if output.status == RequestStatus.FAILED else None
        return RequestSummary(self.operation, self.model, end - self.arrival, per_token, self.num_prompt_tokens,
                              num_output, output.num_cached_tokens, error_type)


def request_attributes(params: SamplingParams) -> dict[str, Any]:
    """The `gen_ai.request.*` attributes of a request with `params`, as resolved: greedy decoding is temperature 0
    (top-p and top-k, which it ignores, are left out)."""
    attributes: dict[str, Any] = {names.REQUEST_MAX_TOKENS: params.max_new_tokens, names.REQUEST_TEMPERATURE: 0.0}
    if params.do_sample:
        attributes[names.REQUEST_TEMPERATURE] = float(params.temperature)
        attributes[names.REQUEST_TOP_P] = float(params.top_p)
        if params.top_k:
            attributes[names.REQUEST_TOP_K] = params.top_k
    if params.seed is not None:
        attributes[names.REQUEST_SEED] = params.seed
    return attributes


class TelemetryRecorder:
    """A client's telemetry: spans to `telemetry`'s tracer provider, numbers to its meter provider and to any
    `MetricsSink` added (the server's Prometheus collectors). Inactive (and free) when it has neither."""

    def __init__(self, telemetry: Telemetry, model_name: str) -> None:
        self.telemetry, self.model_name = telemetry, model_name
        self.sinks: list[MetricsSink] = []
        self.spans: SpanWriter | None = None
        self._gauges: OtelMetrics | None = None
        self._warned = False
        if telemetry.tracer_provider is not None:
            from contbatch.telemetry.otel_traces import SpanWriter

            self.spans = SpanWriter(telemetry.tracer_provider)
        if telemetry.meter_provider is not None:
            from contbatch.telemetry.otel_metrics import OtelMetrics

            self._gauges = OtelMetrics(telemetry.meter_provider)
            self.sinks.append(self._gauges)

    @property
    def active(self) -> bool:
        """Whether requests are recorded (spans or metrics)."""
        return self.spans is not None or bool(self.sinks)

    def add_sink(self, sink: MetricsSink) -> None:
        """Sends the numbers of requests submitted from now on, and of every step, to `sink` too."""
        self.sinks = [*self.sinks, sink]

    def step_timer(self) -> StepTimer:
        """The timer the engine should call: one that records steps when metrics or detailed traces want them."""
        wanted = bool(self.sinks) or (self.spans is not None and self.telemetry.detailed_traces)
        return RecordingStepTimer(self.step) if wanted else NO_STEP_TIMER

    def watch(self, source: StatsSource) -> None:
        """Reports `source`'s load (requests running and waiting, KV blocks) in the OpenTelemetry gauges."""
        if self._gauges is not None:
            self._gauges.watch(source)

    def unwatch(self, source: StatsSource) -> None:
        if self._gauges is not None:
            self._gauges.unwatch(source)

    def origin(self, operation: str, model: str | None, headers: Mapping[str, str] | None) -> RequestOrigin:
        """The origin of a request received with HTTP `headers`: its span is parented on their W3C `traceparent`
        and `tracestate` (through the configured propagators) when tracing is on."""
        parent = None
        if self.spans is not None and headers is not None:
            parent = self.spans.extract(headers)
        return RequestOrigin(operation, model, parent)

    def open(self, request_id: str, num_prompt_tokens: int, params: SamplingParams, origin: RequestOrigin | None,
             arrival: float) -> RequestTelemetry | None:
        """The record of a request being submitted (None when inactive), on the submitting thread: the span's
        parent is `origin.parent`, else that thread's current trace context."""
        if not self.active:
            return None
        origin = origin or RequestOrigin()
        parent = origin.parent
        if parent is None and self.spans is not None:
            parent = self.spans.current_context()
        return RequestTelemetry(self, request_id, num_prompt_tokens, origin.operation,
                                origin.model or self.model_name, request_attributes(params), parent, arrival)

    def first_token(self, record: RequestTelemetry) -> None:
        assert record.first_token is not None
        seconds = record.first_token - record.arrival
        for sink in self.sinks:
            self._guarded(sink.first_token, record.operation, record.model, seconds)

    def preempted(self) -> None:
        for sink in self.sinks:
            self._guarded(sink.preempted)

    def finish(self, record: RequestTelemetry, output: GenerationOutput, end: float) -> None:
        if self.sinks:
            summary = record.summary(output, end)
            for sink in self.sinks:
                self._guarded(sink.request_ended, summary)
        if self.spans is not None:
            self._guarded(self.spans.request_span, record, output, end)

    def step(self, record: StepRecord) -> None:
        for sink in self.sinks:
            self._guarded(sink.step, record)
        if self.spans is not None and self.telemetry.detailed_traces:
            self._guarded(self.spans.step_spans, record)

    def _guarded(self, function: Any, *args: Any) -> None:
        """Calls `function(*args)`; an exception (a broken exporter or processor) is logged once, never raised
        into the engine."""
        try:
            function(*args)
        except Exception as error:
            with _WARN_LOCK:
                if self._warned:
                    return
                self._warned = True
            logger.warning("contbatch telemetry: %s failed (%s: %s); requests are unaffected",
                           getattr(function, "__qualname__", function), type(error).__name__, error)


_WARN_LOCK = threading.Lock()
