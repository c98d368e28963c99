"""Prometheus metrics of the server (one registry per app, no global state): the server's own, and every
contbatch metric of docs/monitoring.md under its Prometheus name, fed by the same engine-thread recorder as the
OpenTelemetry instruments."""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from contbatch.engine.step_timer import StepRecord
from contbatch.frontend.client import EngineClient
from contbatch.outputs import GenerationOutput
from contbatch.telemetry import MetricsSink, RequestSummary, names

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_GEN_AI_LABELS = ("gen_ai_operation_name", "gen_ai_request_model")


class ServerMetrics(MetricsSink):
    """Requests running and waiting, prompt and generated tokens, time to first token, inter-token latency and
    KV-cache usage, plus contbatch's OpenTelemetry metrics under Prometheus names (`gen_ai.server.request.duration`
    in seconds is `gen_ai_server_request_duration_seconds`, counters end in `_total`), in the Prometheus text
    format. Register it with `client.add_metrics_sink` to receive the engine's numbers."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("contbatch_requests_running", "Requests being computed", registry=registry)
        self.waiting = Gauge("contbatch_requests_waiting", "Requests waiting to be admitted", registry=registry)
        self.kv_usage = Gauge("contbatch_kv_cache_usage_ratio", "Share of KV-cache blocks in use", registry=registry)
        self.prompt_tokens = Counter("contbatch_prompt_tokens", "Prompt tokens received", registry=registry)
        self.generated_tokens = Counter("contbatch_generation_tokens", "Tokens generated", registry=registry)
        self.requests = Counter("contbatch_requests_finished", "Requests finished", ["status"], registry=registry)
        self.ttft = Histogram("contbatch_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("contbatch_inter_token_latency_seconds", "Time between consecutive tokens",
                             buckets=_LATENCY_BUCKETS, registry=registry)
        self._engine_metrics(registry)

    def _engine_metrics(self, registry: CollectorRegistry) -> None:
        self.blocks_used = Gauge("contbatch_kv_cache_blocks_used", "KV-cache blocks held by requests",
                                 registry=registry)
        self.blocks_free = Gauge("contbatch_kv_cache_blocks_free", "KV-cache blocks a request can take",
                                 registry=registry)
        self.blocks_cached = Gauge("contbatch_kv_cache_blocks_cached", "KV-cache blocks holding a cached prefix",
                                   registry=registry)
        self.blocks_touched = Gauge("contbatch_kv_cache_blocks_touched",
                                    "KV-cache blocks written at least once since the cache was allocated",
                                    registry=registry)
        self.hit_tokens = Counter("contbatch_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache",
                                  registry=registry)
        self.preemptions = Counter("contbatch_preemptions", "Requests preempted", registry=registry)
        self.prefill = Counter("contbatch_prefill_tokens", "Prompt tokens computed", registry=registry)
        self.decode = Counter("contbatch_decode_tokens", "Generated tokens computed", registry=registry)
        self.batch_fill = Histogram("contbatch_batch_fill_ratio", "Share of the step's token budget used",
                                    buckets=names.BATCH_FILL_BUCKETS, registry=registry)
        self.gen_ai_ttft = Histogram("gen_ai_server_time_to_first_token_seconds", "Time to first token",
                                     _GEN_AI_LABELS, buckets=names.TIME_TO_FIRST_TOKEN_BUCKETS, registry=registry)
        self.gen_ai_tpot = Histogram("gen_ai_server_time_per_output_token_seconds", "Time per output token",
                                     _GEN_AI_LABELS, buckets=names.TIME_PER_OUTPUT_TOKEN_BUCKETS, registry=registry)
        self.gen_ai_duration = Histogram("gen_ai_server_request_duration_seconds", "Request duration",
                                         (*_GEN_AI_LABELS, "error_type"), buckets=names.REQUEST_DURATION_BUCKETS,
                                         registry=registry)
        self.gen_ai_tokens = Histogram("gen_ai_client_token_usage", "Tokens per request",
                                       (*_GEN_AI_LABELS, "gen_ai_token_type"), buckets=names.TOKEN_USAGE_BUCKETS,
                                       registry=registry)

    def observe_finished(self, output: GenerationOutput) -> None:
        """Records a request's final output (its timestamps give TTFT and inter-token latencies)."""
        self.requests.labels(status=output.status.name.lower()).inc()
        self.generated_tokens.inc(len(output.generated_tokens))
        stamps = output.timestamps or []
        if stamps:
            self.ttft.observe(max(0.0, stamps[0] - output.created_time))
        for before, after in itertools.pairwise(stamps):
            self.itl.observe(after - before)

    def first_token(self, operation: str, model: str, seconds: float) -> None:
        self.gen_ai_ttft.labels(operation, model).observe(seconds)

    def request_ended(self, summary: RequestSummary) -> None:
        operation, model = summary.operation, summary.model
        self.gen_ai_duration.labels(operation, model, summary.error_type or "").observe(summary.duration)
        if summary.time_per_output_token is not None:
            self.gen_ai_tpot.labels(operation, model).observe(summary.time_per_output_token)
        self.gen_ai_tokens.labels(operation, model, "input").observe(summary.input_tokens)
        self.gen_ai_tokens.labels(operation, model, "output").observe(summary.output_tokens)
        self.hit_tokens.inc(summary.cached_tokens)

    def preempted(self) -> None:
        self.preemptions.inc()

    def step(self, record: StepRecord) -> None:
        self.prefill.inc(record.num_prefill_tokens)
        self.decode.inc(record.num_decode_tokens)
        self.batch_fill.observe(record.fill)

    def render(self) -> bytes:
        stats = self.client.stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.blocks_used.set(stats.num_blocks - stats.num_free_blocks)
        self.blocks_free.set(stats.num_free_blocks)
        self.blocks_cached.set(stats.num_cached_blocks)
        self.blocks_touched.set(stats.num_touched_blocks)
        return generate_latest(self.registry)
