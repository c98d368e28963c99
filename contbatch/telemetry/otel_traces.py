"""Spans: one per request (GenAI semantic conventions), and with detailed traces one per engine step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from contbatch.engine.request import RequestStatus
from contbatch.engine.step_timer import StepRecord
from contbatch.outputs import GenerationOutput
from contbatch.telemetry import names

if TYPE_CHECKING:
    from contbatch.telemetry.recorder import RequestTelemetry


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class SpanWriter:
    """Writes contbatch's spans through `tracer_provider`'s tracer (instrumentation scope "contbatch").

    A request's span is made when the request ends, with its start set to the request's arrival: nothing is
    held open while it runs."""

    def __init__(self, tracer_provider: trace.TracerProvider) -> None:
        self.tracer = tracer_provider.get_tracer(names.INSTRUMENTATION_SCOPE)

    @staticmethod
    def current_context() -> otel_context.Context:
        return otel_context.get_current()

    @staticmethod
    def extract(headers: Mapping[str, str]) -> otel_context.Context:
        """The trace context of incoming HTTP `headers` (W3C `traceparent` / `tracestate` with the default
        propagators; `OTEL_PROPAGATORS` may name others)."""
        return propagate.extract({key.lower(): value for key, value in headers.items()})

    def request_span(self, record: RequestTelemetry, output: GenerationOutput, end: float) -> None:
        """The span of a request that ended at `end` with `output`: named "{operation} {model}", SERVER when
        its parent came from another process, INTERNAL otherwise."""
        parent = record.parent
        remote = trace.get_current_span(parent).get_span_context().is_remote
        span = self.tracer.start_span(f"{record.operation} {record.model}", context=parent,
                                      kind=SpanKind.SERVER if remote else SpanKind.INTERNAL,
                                      attributes=_request_attributes(record, output, end),
                                      start_time=_ns(record.arrival))
        for moment in record.preemptions:
            span.add_event(names.EVENT_PREEMPTED, timestamp=_ns(moment))
        if output.status == RequestStatus.CANCELLED:
            span.add_event(names.EVENT_CANCELLED, timestamp=_ns(end))
        elif output.status == RequestStatus.FAILED:
            error = output.error or "failed"
            span.add_event(names.EVENT_FAILED, {names.ERROR_TYPE: names.FAILED_ERROR_TYPE,
                                                names.ERROR_MESSAGE: error}, timestamp=_ns(end))
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=_ns(end))

    def step_spans(self, record: StepRecord) -> None:
        """A "contbatch.step" span with the batch's composition, and its schedule / forward / sample children."""
        attributes = {names.BATCH_SIZE: record.num_requests, names.BATCH_PREFILL_TOKENS: record.num_prefill_tokens,
                      names.BATCH_DECODE_TOKENS: record.num_decode_tokens, names.BATCH_FILL: record.fill,
                      names.BATCH_PREEMPTED: record.num_preempted}
        step = self.tracer.start_span(names.STEP_SPAN, context=otel_context.Context(), attributes=attributes,
                                      start_time=record.start_ns)
        inside = trace.set_span_in_context(step, otel_context.Context())
        phases = ((names.SCHEDULE_SPAN, record.start_ns, record.scheduled_ns),
                  (names.FORWARD_SPAN, record.scheduled_ns, record.forwarded_ns),
                  (names.SAMPLE_SPAN, record.forwarded_ns, record.sampled_ns))
        for name, start, end in phases:
            self.tracer.start_span(name, context=inside, start_time=start).end(end_time=end)
        step.end(end_time=record.sampled_ns)


def _request_attributes(record: RequestTelemetry, output: GenerationOutput, end: float) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        names.OPERATION: record.operation,
        names.REQUEST_MODEL: record.model,
        names.RESPONSE_MODEL: record.model,
        names.RESPONSE_ID: record.request_id,
        **record.attributes,
        names.INPUT_TOKENS: record.num_prompt_tokens,
        names.OUTPUT_TOKENS: len(output.generated_tokens),
        names.CACHED_PROMPT_TOKENS: output.num_cached_tokens,
        names.PREEMPTIONS: len(record.preemptions),
        **record.timings(end),
    }
    if output.finish_reason is not None:
        attributes[names.FINISH_REASONS] = (output.finish_reason,)
    if output.status == RequestStatus.FAILED:
        attributes[names.ERROR_TYPE] = names.FAILED_ERROR_TYPE
    return attributes
