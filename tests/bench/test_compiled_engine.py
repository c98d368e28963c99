"""The throughput bench's compiled contbatch engine: named apart, same tokens as eager, compile time reported."""

from __future__ import annotations

from dataclasses import replace

import torch

from contbatch import ContinuousBatchingConfig
from contbatch.bench import throughput
from tests.conftest import fresh_tiny_model, random_prompts


def test_compiled_engine_is_named_and_reports_its_compile_time() -> None:
    torch._dynamo.reset()
    model = fresh_tiny_model("llama")
    inputs = random_prompts([5, 12, 3], seed=21)
    config = ContinuousBatchingConfig(block_size=4, num_blocks=64)
    eager = throughput.run_contbatch(model, inputs, 6, None, config)
    assert throughput.compile_seconds(model) == {}
    compiled = throughput.run_contbatch(model, inputs, 6, None, replace(config, use_default_compile_configs=True))
    assert (eager.engine, compiled.engine) == ("contbatch", "contbatch (compiled)")
    assert compiled.outputs == eager.outputs
    seconds = throughput.compile_seconds(model)
    assert set(seconds) == {"decode", "varlen"} and all(value > 0 for value in seconds.values())
