"""The server's telemetry: request spans parented on the client's `traceparent`, and /metrics showing the numbers
the OpenTelemetry instruments record."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.data.embedded import embedded_model_dir
from contbatch.entrypoints.openai.app import create_app
from tests.entrypoints.openai.test_server import LiveServer
from tests.telemetry.otel_helpers import Collected

MODEL = "traced-llama"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class TracedServer:
    def __init__(self) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
        torch.manual_seed(7)
        config = LlamaConfig(vocab_size=len(self.tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
        self.collected = Collected()
        self.manager = ContinuousBatchingManager(
            LlamaForCausalLM(config).eval(), GenerationConfig(eos_token_id=None),
            ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=128),
            telemetry=self.collected.telemetry)
        self.manager.start()
        self.live = LiveServer(create_app(self.manager, self.tokenizer, MODEL))

    def post(self, path: str, body: dict[str, object], headers: dict[str, str] | None = None) -> httpx.Response:
        response = httpx.post(f"{self.live.url}{path}", json={"model": MODEL, **body}, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        return response

    def close(self) -> None:
        self.live.stop()
        self.manager.stop()


@pytest.fixture(scope="module")
def traced() -> Iterator[TracedServer]:
    server = TracedServer()
    yield server
    server.close()


def _prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_request_spans_are_parented_on_the_traceparent_header(traced: TracedServer) -> None:
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "vendor=value"}
    traced.post("/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "n": 2}, headers)
    traced.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    spans = list(traced.collected.request_spans().values())
    completions = [span for span in spans if span.name == f"text_completion {MODEL}"]
    assert len(completions) == 2, "one span per choice"
    for span in completions:
        assert span.kind == SpanKind.SERVER and span.parent is not None and span.parent.is_remote
        assert (f"{span.context.trace_id:032x}", f"{span.parent.span_id:016x}") == (TRACE_ID, PARENT_ID)
        assert span.context.trace_state.get("vendor") == "value"
        assert span.attributes["gen_ai.usage.output_tokens"] == 3
    (chat,) = [span for span in spans if span.name == f"chat {MODEL}"]
    assert chat.parent is None and chat.kind == SpanKind.INTERNAL
    assert chat.attributes["gen_ai.operation.name"] == "chat" and chat.attributes["gen_ai.request.max_tokens"] == 2


def test_prometheus_metrics_show_the_numbers_of_the_opentelemetry_instruments(traced: TracedServer) -> None:
    traced.post("/v1/completions", {"prompt": "Count the tokens", "max_tokens": 4})
    collected = traced.collected
    samples = _prometheus(httpx.get(f"{traced.live.url}/metrics").text)
    labels = (("gen_ai_operation_name", "text_completion"), ("gen_ai_request_model", MODEL))
    for kind in ("input", "output"):
        key = ("gen_ai_client_token_usage_sum", tuple(sorted((*labels, ("gen_ai_token_type", kind)))))
        attributes = {"gen_ai.operation.name": "text_completion", "gen_ai.token.type": kind}
        assert samples[key] == collected.value("gen_ai.client.token.usage", attributes) > 0
    assert samples[("contbatch_prefill_tokens_total", ())] == collected.value("contbatch.prefill.tokens") > 0
    assert samples[("contbatch_decode_tokens_total", ())] == collected.value("contbatch.decode.tokens") > 0
    assert samples[("contbatch_batch_fill_ratio_count", ())] == collected.count("contbatch.batch.fill")
    assert samples[("contbatch_preemptions_total", ())] == collected.value("contbatch.preemptions") == 0
    assert samples[("gen_ai_server_time_to_first_token_seconds_count", labels)] == collected.count(
        "gen_ai.server.time_to_first_token", {"gen_ai.operation.name": "text_completion"})
    assert samples[("contbatch_kv_cache_blocks_free", ())] == collected.value("contbatch.kv_cache.blocks.free")
    assert samples[("contbatch_kv_cache_blocks_used", ())] + samples[("contbatch_kv_cache_blocks_free", ())] == 64
    touched = samples[("contbatch_kv_cache_blocks_touched", ())]
    assert touched == collected.value("contbatch.kv_cache.blocks.touched") and 0 < touched <= 64
    assert samples[("contbatch_requests_running", ())] == collected.value("contbatch.requests.running") == 0
