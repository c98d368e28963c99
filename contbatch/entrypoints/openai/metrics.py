"""Prometheus metrics of the server (one registry per app, no global state)."""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from contbatch.frontend.client import EngineClient
from contbatch.outputs import GenerationOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Requests running and waiting, prompt and generated tokens, time to first token, inter-token latency and
    KV-cache usage, in the Prometheus text format."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.registry = CollectorRegistry()
        self.running = Gauge("contbatch_requests_running", "Requests being computed", registry=self.registry)
        self.waiting = Gauge("contbatch_requests_waiting", "Requests waiting to be admitted", registry=self.registry)
        self.kv_usage = Gauge("contbatch_kv_cache_usage_ratio", "Share of KV-cache blocks in use",
                              registry=self.registry)
        self.prompt_tokens = Counter("contbatch_prompt_tokens", "Prompt tokens received", registry=self.registry)
        self.generated_tokens = Counter("contbatch_generation_tokens", "Tokens generated", registry=self.registry)
        self.requests = Counter("contbatch_requests_finished", "Requests finished", ["status"], registry=self.registry)
        self.ttft = Histogram("contbatch_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("contbatch_inter_token_latency_seconds", "Time between consecutive tokens",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def observe_finished(self, output: GenerationOutput) -> None:
        """Records a request's final output (its timestamps give TTFT and inter-token latencies)."""
        self.requests.labels(status=output.status.name.lower()).inc()
        self.generated_tokens.inc(len(output.generated_tokens))
        stamps = output.timestamps or []
        if stamps:
            self.ttft.observe(max(0.0, stamps[0] - output.created_time))
        for before, after in itertools.pairwise(stamps):
            self.itl.observe(after - before)

    def render(self) -> bytes:
        stats = self.client.stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        return generate_latest(self.registry)
