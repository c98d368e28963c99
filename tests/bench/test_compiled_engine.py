"""The throughput bench's compiled contbatch engine: named apart, same tokens as eager, compile time reported."""

from __future__ import annotations

from dataclasses import replace

import torch

from contbatch import ContinuousBatchingConfig
from contbatch.bench import throughput
from tests.helpers import fresh_tiny_model, random_prompts


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


def test_warm_pass_times_a_warm_engine_with_an_empty_prefix_cache() -> None:
    model = fresh_tiny_model("llama")
    shared = random_prompts([9], seed=3)[0]
    inputs = [shared + tail for tail in random_prompts([4, 7, 2], seed=22)]
    config = ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=16)
    cold = throughput.run_contbatch(model, inputs, 6, None, config)
    warm = throughput.run_contbatch(model, inputs, 6, None, config, warm_pass=True)
    assert warm.outputs == cold.outputs and warm.generated_tokens == cold.generated_tokens
    assert cold.cached_prompt_tokens is not None and warm.cached_prompt_tokens == cold.cached_prompt_tokens
    assert 0 < warm.cached_prompt_tokens < len(shared) * len(inputs)
    assert "_contbatch_manager" not in model.__dict__
