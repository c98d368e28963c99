"""Configuring telemetry: off by default, the standard `OTEL_*` variables, and misconfigured exporters that only
warn."""

from __future__ import annotations

import logging
import os
import socket
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, Telemetry, generate_batch
from contbatch.engine.step_timer import NO_STEP_TIMER
from tests.helpers import random_prompts, tiny_model

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=8)
CONFIG = ContinuousBatchingConfig(block_size=4, num_blocks=128)


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_telemetry_is_off_by_default_and_records_nothing(clean_environment: pytest.MonkeyPatch) -> None:
    telemetry = Telemetry.default()
    assert not telemetry.enabled and telemetry == Telemetry()
    manager = ContinuousBatchingManager(tiny_model("llama"), GREEDY, CONFIG)
    assert manager.telemetry_config == Telemetry() and not manager.telemetry.active
    with manager:
        manager.add_request([5, 6, 7], "a")
        assert manager.get_result("a", timeout=60) is not None
        assert manager.engine.step_timer is NO_STEP_TIMER


def test_the_standard_variables_configure_the_sdk(clean_environment: pytest.MonkeyPatch) -> None:
    clean_environment.setenv("OTEL_TRACES_EXPORTER", "console")
    clean_environment.setenv("OTEL_SERVICE_NAME", "my-eval")
    clean_environment.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    telemetry = Telemetry.default()
    assert telemetry is Telemetry.default(), "built once per environment, then shared"
    assert isinstance(telemetry.tracer_provider, TracerProvider) and telemetry.meter_provider is None
    resource = telemetry.tracer_provider.resource.attributes
    assert (resource["service.name"], resource["deployment.environment"]) == ("my-eval", "test")
    clean_environment.delenv("OTEL_SERVICE_NAME")
    clean_environment.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    clean_environment.setenv("OTEL_TRACES_EXPORTER", "otlp")
    both = Telemetry.from_environment()
    assert both.tracer_provider.resource.attributes["service.name"] == "contbatch"
    assert both.meter_provider is not None, "an OTLP endpoint alone turns metrics on too"
    clean_environment.setenv("OTEL_SDK_DISABLED", "true")
    assert not Telemetry.from_environment().enabled
    for made in (telemetry, both):
        made.shutdown()


@pytest.mark.parametrize("endpoint", ["not a url", "ftp://collector:4318", "http://:4318", "http://host:99999"])
def test_a_bad_traces_url_warns_and_leaves_requests_alone(endpoint: str, clean_environment: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "contbatch.telemetry"):
        telemetry = Telemetry.default(otlp_traces_endpoint=endpoint)
    assert telemetry.tracer_provider is None
    assert any("traces are off" in record.getMessage() and repr(endpoint) in record.getMessage()
               for record in caplog.records)


def test_an_unknown_exporter_or_a_bad_endpoint_variable_warns(clean_environment: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    clean_environment.setenv("OTEL_TRACES_EXPORTER", "no_such_exporter")
    clean_environment.setenv("OTEL_METRICS_EXPORTER", "otlp")
    clean_environment.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "localhost:4318")
    with caplog.at_level(logging.WARNING, "contbatch.telemetry"):
        assert not Telemetry.from_environment().enabled
    messages = " | ".join(record.getMessage() for record in caplog.records)
    assert "no traces exporter 'no_such_exporter'" in messages
    assert "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT" in messages


def test_an_unreachable_collector_warns_and_never_fails_or_slows_a_request(
        clean_environment: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Export runs on the SDK's background threads: with nothing listening, the requests give the same outputs
    in about the same time (a blocking export would add its 1 s retry back-off), and the exporter warns. With a
    1 s export timeout, shutting down gives up on the collector within seconds."""
    port = _closed_port()
    clean_environment.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    clean_environment.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    clean_environment.setenv("OTEL_METRIC_EXPORT_INTERVAL", "50")
    clean_environment.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{port}/v1/metrics")
    telemetry = Telemetry.default(otlp_traces_endpoint=f"http://127.0.0.1:{port}")
    assert telemetry.tracer_provider is not None and telemetry.meter_provider is not None
    model, prompts = tiny_model("llama"), random_prompts([5, 8, 11, 6], seed=9)
    timings: dict[str, float] = {}
    generated: dict[str, list[list[int]]] = {}
    with caplog.at_level(logging.WARNING):
        for name, used in (("off", Telemetry()), ("on", telemetry), ("off again", Telemetry())):
            start = time.perf_counter()
            outputs = generate_batch(model, prompts, GREEDY, CONFIG, progress_bar=False, telemetry=used)
            timings[name] = time.perf_counter() - start
            generated[name] = [output.generated_tokens for output in outputs.values()]
        assert generated["on"] == generated["off"] == generated["off again"]
        deadline = time.monotonic() + 20
        while not any(record.name.startswith("opentelemetry.exporter") for record in caplog.records):
            assert time.monotonic() < deadline, "the exporter never warned about the unreachable collector"
            time.sleep(0.05)
        started = time.perf_counter()
        telemetry.shutdown()
    assert timings["on"] < max(timings["off"], timings["off again"]) + 0.9
    assert time.perf_counter() - started < 5
