"""The public API: generate_batch, its configuration sources, outputs, logprobs, the mixin."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM

import contbatch
from contbatch import ContinuousBatchingConfig, ContinuousMixin, GenerationOutput, RequestStatus, generate_batch
from contbatch.engine import config as engine_config
from contbatch.engine.config import default_max_batch_tokens
from tests.helpers import (
    TINY_CONFIGS,
    fresh_tiny_model,
    make_engine,
    random_prompts,
    reference_generate,
    run_engine,
    tiny_model,
)

GREEDY = GenerationConfig(do_sample=False, max_new_tokens=5, eos_token_id=None)
SMALL = ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=32)


def test_outputs_in_input_order_with_ids_and_reasons() -> None:
    model = tiny_model("llama")
    prompts = random_prompts([3, 12, 7], seed=20)
    outputs = generate_batch(model, prompts, GREEDY, SMALL, progress_bar=False, max_new_tokens=4)
    assert list(outputs) == ["req_0", "req_1", "req_2"]
    for prompt, output in zip(prompts, outputs.values(), strict=True):
        assert isinstance(output, GenerationOutput)
        assert output.prompt_ids == prompt
        assert output.generated_tokens == reference_generate(model, prompt, 4)
        assert output.status == RequestStatus.FINISHED and output.finish_reason == "length"
        assert output.logprobs is None and output.timestamps is None and output.created_time > 0
    assert model.config._attn_implementation == "sdpa"


def test_config_fields_from_kwargs_and_generation_config_and_persistent_engine() -> None:
    model = tiny_model("qwen3")
    prompts = random_prompts([9, 4], seed=21)
    legacy = GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=None, max_batch_tokens=6,
                              use_cuda_graph=False)
    first = generate_batch(model, prompts, legacy, progress_bar=False, persistent_manager=True, block_size=2,
                           num_blocks=40)
    manager = model._contbatch_manager
    engine = manager.engine
    assert not manager.is_running()
    assert engine.config.max_batch_tokens == 6 and engine.config.block_size == 2
    assert engine.config.use_cuda_graph is False
    assert model.config._attn_implementation == "sdpa", "a persistent engine must not keep the model switched"
    assert [o.generated_tokens for o in first.values()] == [reference_generate(model, p, 3) for p in prompts]
    second = generate_batch(model, prompts[::-1], legacy, progress_bar=False, persistent_manager=True,
                            block_size=2, num_blocks=40)
    assert model._contbatch_manager is manager and manager.engine is engine
    assert [o.generated_tokens for o in second.values()] == [reference_generate(model, p, 3) for p in prompts[::-1]]
    generate_batch(model, prompts, legacy, progress_bar=False, block_size=2, num_blocks=40)
    assert not hasattr(model, "_contbatch_manager")
    assert engine.block_pool.is_whole


def test_logprobs_equal_log_softmax_of_the_models_own_logits() -> None:
    model = tiny_model("mistral-sliding")
    prompt = random_prompts([11], seed=22)[0]
    config = ContinuousBatchingConfig(block_size=4, num_blocks=64, return_logprobs=True)
    output = generate_batch(model, [prompt], GREEDY, config, progress_bar=False)["req_0"]
    sequence = torch.tensor([prompt + output.generated_tokens], device=model.device)
    with torch.inference_mode():
        logits = model(sequence).logits[0].cpu()
    expected = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:-1]
    expected = expected.gather(1, torch.tensor(output.generated_tokens).unsqueeze(1)).squeeze(1)
    assert output.logprobs is not None and len(output.logprobs) == 5
    torch.testing.assert_close(torch.tensor(output.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_record_timestamps_gives_one_increasing_time_per_token() -> None:
    output = generate_batch(tiny_model("llama"), random_prompts([6], seed=23), GREEDY, SMALL,
                            record_timestamps=True, progress_bar=False)["req_0"]
    assert output.timestamps is not None and len(output.timestamps) == len(output.generated_tokens) == 5
    assert output.timestamps == sorted(output.timestamps) and output.timestamps[0] >= output.created_time


def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    model = tiny_model("llama")
    prompt, other = random_prompts([8, 13], seed=24)
    sampled = dict(do_sample=True, temperature=1.3, top_p=0.95, seed=7, max_new_tokens=12)
    with make_engine(model, block_size=4, num_blocks=64) as engine:
        engine.add_request(prompt, request_id="alone", **sampled)
        alone = run_engine(engine)["alone"].generated_tokens
        engine.add_request(other, request_id="other", **{**sampled, "seed": 99})
        engine.add_request(prompt, request_id="crowded", **sampled)
        crowded = run_engine(engine)
    assert crowded["crowded"].generated_tokens == alone
    assert crowded["other"].generated_tokens != alone
    assert alone != reference_generate(model, prompt, 12), "temperature 1.3 should not reproduce greedy output"


def test_mixin_class_and_add_continuous_batching_route_to_contbatch() -> None:
    class MixedLlama(ContinuousMixin, LlamaForCausalLM):
        pass

    torch.manual_seed(0)
    mixed = MixedLlama(TINY_CONFIGS["llama"]()).eval()
    mixed.generation_config.eos_token_id = None
    prompt = random_prompts([5], seed=25)[0]
    outputs = mixed.generate_batch([prompt], GREEDY, SMALL, progress_bar=False)
    assert isinstance(outputs["req_0"], GenerationOutput)
    assert outputs["req_0"].generated_tokens == reference_generate(mixed, prompt, 5)

    model = tiny_model("gemma3-hybrid")
    patched = contbatch.add_continuous_batching(model)
    assert patched is model and isinstance(model, ContinuousMixin)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    outputs = model.generate_batch([prompt], GREEDY, SMALL, progress_bar=False)
    assert outputs["req_0"].generated_tokens == reference_generate(model, prompt, 5)


def test_async_batching_through_generate_batch_equals_generate() -> None:
    """`use_async_batching=True` through the manager's engine thread: the forwards run on the worker thread while
    the engine thread prepares the next step and hands the outputs on."""
    model = tiny_model("llama")
    prompts = random_prompts([3, 12, 7, 20, 1], seed=21)
    config = ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=16, use_async_batching=True)
    outputs = generate_batch(model, prompts, GREEDY, config, progress_bar=False, max_new_tokens=6)
    for prompt, output in zip(prompts, outputs.values(), strict=True):
        assert output.generated_tokens == reference_generate(model, prompt, 6)
        assert output.status == RequestStatus.FINISHED


@pytest.mark.parametrize("amx", [True, False])
def test_unset_budget_follows_the_device_and_dtype(monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    """`max_batch_tokens=None`: 512 tokens on CPU, 4,096 for a bfloat16 model where the CPU has AMX, 4,096 on CUDA;
    a budget the config sets always wins."""
    monkeypatch.setattr(engine_config, "cpu_has_amx", lambda: amx)
    assert default_max_batch_tokens("cpu", torch.float32) == 512
    assert default_max_batch_tokens("cpu", torch.bfloat16) == (4096 if amx else 512)
    assert default_max_batch_tokens("cuda", torch.bfloat16) == 4096
    model = fresh_tiny_model("llama", "cpu").to(torch.bfloat16)
    with make_engine(model, block_size=4, num_blocks=64) as engine:
        assert engine.scheduler.max_batch_tokens == (4096 if amx else 512)
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=24) as engine:
        assert engine.scheduler.max_batch_tokens == 24
