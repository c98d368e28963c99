"""The tests' shared helpers: tiny randomly initialised models of several families, reference generation, and
engines run to the end. (`conftest.py`, which every pytest process loads first, stays free of torch.)"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from contbatch import ContinuousBatchingConfig, LLMEngine
from contbatch.engine import attention, triton_attention
from contbatch.frontend.output_processor import OutputCollector
from contbatch.outputs import GenerationOutput, RequestStatus
from tests.conftest import TINY_FAMILIES

VOCAB = 256
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1)

TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(num_hidden_layers=2, **_COMMON),
    "qwen2": lambda: Qwen2Config(num_hidden_layers=2, **_COMMON),
    "qwen3": lambda: Qwen3Config(num_hidden_layers=2, head_dim=16, **_COMMON),
    "mistral-sliding": lambda: MistralConfig(num_hidden_layers=2, sliding_window=7, **_COMMON),
    "gemma3-hybrid": lambda: Gemma3TextConfig(
        num_hidden_layers=4, head_dim=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"], **_COMMON
    ),
    "gemma2-softcap": lambda: Gemma2Config(num_hidden_layers=2, head_dim=16, sliding_window=6, **_COMMON),
    "deepseek-mla": lambda: DeepseekV3Config(  # multi-head latent attention: keys of 24 dimensions, values of 16
        num_hidden_layers=2, **dict(_COMMON, num_key_value_heads=4), kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1),
}
assert sorted(TINY_CONFIGS) == sorted(TINY_FAMILIES), "conftest's model_name fixture names every family"

_MODELS: dict[tuple[str, torch.device], PreTrainedModel] = {}
# The device tiny models are built on: `CONTBATCH_TEST_DEVICE=cuda` runs the parity suites on a GPU.
TEST_DEVICE = torch.device(os.environ.get("CONTBATCH_TEST_DEVICE", "cpu"))


def tiny_model(name: str, device: str | None = None) -> PreTrainedModel:
    """A tiny random model of family `name` on `device` (default `TEST_DEVICE`; a test of CPU-only behaviour
    names "cpu"), built once per test session (seeded, float32, eval mode). Shared: a test that changes its
    weights or attaches state to it takes `fresh_tiny_model` instead."""
    key = (name, torch.device(device) if device else TEST_DEVICE)
    if key not in _MODELS:
        _MODELS[key] = fresh_tiny_model(name, device)
    return _MODELS[key]


def fresh_tiny_model(name: str, device: str | None = None) -> PreTrainedModel:
    """A new instance of `tiny_model(name, device)` (same seed, same weights), for the test alone."""
    torch.manual_seed(1234)
    attention = "eager" if name.startswith("gemma2") else "sdpa"  # Gemma 2 has no SDPA path in transformers
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[name](), attn_implementation=attention)
    model.generation_config.eos_token_id = None  # tests choose their EOS explicitly
    return model.to(device or TEST_DEVICE).eval()


def random_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in lengths]


# By model object, not id(): a model freed by one test must not lend its references to a new one at its address.
_REFERENCES: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple, list[int]]] = weakref.WeakKeyDictionary()


def reference_generate(model: PreTrainedModel, prompt: list[int], max_new_tokens: int,
                       eos_token_id: int | None = None) -> list[int]:
    """Greedy `model.generate` on the prompt alone (no padding), the ground truth of every parity test."""
    references = _REFERENCES.setdefault(model, {})
    key = (tuple(prompt), max_new_tokens, eos_token_id)
    if key not in references:
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                                  pad_token_id=0)
        with torch.inference_mode():
            output = model.generate(torch.tensor([prompt], device=model.device),
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
                                    generation_config=config)
        references[key] = output[0, len(prompt):].tolist()
    return references[key]


def run_engine(engine: LLMEngine) -> dict[str, GenerationOutput]:
    """Steps `engine` until idle; returns the output of every finished request by id. Asserts the cache is whole
    afterwards."""
    collector = OutputCollector()
    while engine.has_unfinished_requests():
        collector.add(engine.step())
    engine.check_integrity()
    assert engine.block_pool.is_whole
    return collector.finished


def make_engine(model: PreTrainedModel, **config: object) -> LLMEngine:
    generation_config = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=8)
    return LLMEngine(model, generation_config, ContinuousBatchingConfig(**config))  # type: ignore[arg-type]


SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, initializer_range=0.1, num_hidden_layers=2)
"""A small config of most families' field names (`model_of_type`)."""
PROMPT_LENGTHS = [5, 17, 33, 3]


def model_of_type(model_type: str, **config: object) -> PreTrainedModel:
    """A randomly initialised `model_type` model of `config` (seeded), its generation config without EOS."""
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    model.generation_config.eos_token_id = None
    return model.eval()


def run_prompts(model: PreTrainedModel, **engine_config: object) -> dict[str, list[int] | str]:
    """Runs `PROMPT_LENGTHS`' random prompts (8 new tokens each) on an engine of `model` (blocks of 4 tokens, steps of
    24, unless `engine_config` says otherwise): each prompt's generated tokens, or its error when it failed;
    asserts the pool is whole afterwards (`run_engine`)."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    with make_engine(model, **{"block_size": 4, "max_batch_tokens": 24, **engine_config}) as engine:
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, str(index), max_new_tokens=8)
        outputs = run_engine(engine)
    return {key: output.error or "" if output.status == RequestStatus.FAILED else output.generated_tokens
            for key, output in outputs.items()}



def assert_matches_generate(model: PreTrainedModel, *engine_configs: dict[str, object],
                            min_distinct: int = 9) -> None:
    """Asserts that `run_prompts` on an engine of each of `engine_configs` (default: the plain one) gives every
    prompt `generate`'s greedy tokens, and that those hold at least `min_distinct` distinct tokens (a degenerate
    model proves nothing)."""
    references = [reference_generate(model, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)]
    assert len({token for tokens in references for token in tokens}) >= min_distinct, "a degenerate model"
    for engine_config in engine_configs or ({},):
        results = run_prompts(model, **engine_config)
        for index, reference in enumerate(references):
            assert results[str(index)] == reference, (engine_config, index, results[str(index)])

def add_samples(engine: LLMEngine, prompt: list[int], request_id: str, n: int, **sampling: object) -> list[str]:
    """What the manager does for `n=`: sample j is `<id>_j`, forked from sample 0."""
    requests = [engine.make_request(prompt, f"{request_id}_{j}", **sampling) for j in range(n)]
    engine.add(requests[0])
    for request in requests[1:]:
        engine.fork(requests[0].request_id, request)
    return [request.request_id for request in requests]


def run_threads(target: Callable[[int], None], count: int, timeout: float = 120) -> None:
    """Runs `target(0)` ... `target(count - 1)` on `count` threads at once and waits for them all."""
    threads = [threading.Thread(target=target, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)


def needs_model_type(model_type: str) -> None:
    """Skips the test on a transformers release without `model_type`."""
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {model_type}")


def use_attention_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the engines of the test attend through `path`: "gathered keys" (no CPU kernel: gathered K/V and
    SDPA), "triton" (the Triton kernel, under its interpreter on a CPU; skips without Triton); any other path
    (the CPU kernel, compiled, a dtype) needs nothing here."""
    if path == "gathered keys":
        monkeypatch.setattr(attention, "paged_decode_kernel", lambda: None)
    if path == "triton":
        if not triton_attention.available():
            pytest.skip("Triton is not installed")
        monkeypatch.setenv(triton_attention.KERNEL_ENV, "triton")
