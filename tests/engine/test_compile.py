"""The compiled forward: greedy parity with `generate` with compile on, attention as one op, no graph break, each
graph compiled once (no restarted analysis), one graph for every step size (padded past dynamo's 0/1
specialisation)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import CompileConfig, GenerationConfig

from contbatch.engine import engine as engine_module
from contbatch.engine.compile import (
    compile_kwargs,
    compile_paths,
    default_compile_config,
    generation_compile_config,
    served_compile_config,
)
from contbatch.engine.config import ContinuousBatchingConfig
from contbatch.engine.engine import LLMEngine
from tests.engine.test_prompt_logprobs import check_entries, reference_logprobs
from tests.helpers import fresh_tiny_model, make_engine, random_prompts, reference_generate, run_engine

LENGTHS = [1, 5, 17, 40]
MAX_NEW = [6, 9, 3, 7]


FROZEN = CompileConfig(dynamic=True, mode="default", options={"freezing": True})


@pytest.mark.parametrize(("name", "frozen", "async_batching"),
                         [("llama", False, False), ("gemma2-softcap", False, False), ("llama", True, True)])
def test_compiled_greedy_matches_generate(name: str, frozen: bool, async_batching: bool) -> None:
    """Both paths compiled with the defaults (dynamic shapes), or frozen (weights prepacked for oneDNN) and with
    async batching (compiled and run on its forward thread)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = fresh_tiny_model(name)
    prompts = random_prompts(LENGTHS, seed=11)
    configs = {"varlen_compile_config": FROZEN, "decode_compile_config": FROZEN} if frozen else {
        "use_default_compile_configs": True}
    with make_engine(model, block_size=4, num_blocks=200, max_batch_tokens=24, use_async_batching=async_batching,
                     **configs) as engine:
        for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=max_new)
        finished = run_engine(engine)
        compiled = engine.model_runner.compiled
        assert compiled is not None and set(compiled.compile_seconds) == {"decode", "varlen"}
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, max_new), f"r{index}"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    counters = torch._dynamo.utils.counters
    assert counters["aot_autograd"]["total"] == counters["stats"]["unique_graphs"], "a graph was compiled twice"
    packed = torch._dynamo.utils.counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
    assert (packed > 0) == frozen


def test_only_configured_paths_compile() -> None:
    decode = CompileConfig(dynamic=True, mode="default")
    assert compile_paths(None, decode, False) == {"decode": decode}
    assert compile_paths(None, None, False) == {}
    paths = compile_paths(None, decode, True)
    assert paths["decode"] is decode and paths["varlen"].dynamic and not paths["varlen"].options
    assert compile_kwargs(default_compile_config()) == {"fullgraph": False, "dynamic": True,
                                                          "backend": "inductor", "mode": "default"}
    assert compile_kwargs(FROZEN) == compile_kwargs(default_compile_config())  # freezing: set around calls
    assert compile_kwargs(decode)["mode"] == "default"


def test_paths_without_a_config_fall_back_to_the_generation_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' order for each path: its own config, the default config, the generation config's
    `compile_config` (unless `disable_compile`), else eager; the engine's compiled paths follow it, and the
    decode path's resolved config is the one that decides on CUDA graphs."""
    decides: list[CompileConfig | None] = []
    resolve = engine_module.resolve_graph_settings
    monkeypatch.setattr(engine_module, "resolve_graph_settings",
                        lambda *args: decides.append(args[-1]) or resolve(*args))
    own, fallback = CompileConfig(dynamic=True, mode="default"), CompileConfig(dynamic=True, mode="max-autotune")
    assert compile_paths(None, own, False, fallback) == {"varlen": fallback, "decode": own}
    assert compile_paths(None, own, True, fallback)["varlen"] == default_compile_config()
    assert compile_paths(None, None, False, None) == {}
    model = fresh_tiny_model("llama")
    for disable, expected in ((None, {"varlen": fallback, "decode": own}), (True, {"decode": own})):
        generation = GenerationConfig(do_sample=False, compile_config=fallback, disable_compile=disable)
        assert generation_compile_config(generation) == (None if disable else fallback)
        with LLMEngine(model, generation, ContinuousBatchingConfig(num_blocks=8, decode_compile_config=own)) as engine:
            assert engine.model_runner.compiled is not None and engine.model_runner.compiled.paths == expected
    model.generation_config.compile_config = fallback
    with LLMEngine(model, GenerationConfig(do_sample=False), ContinuousBatchingConfig(num_blocks=8)) as engine:
        assert engine.model_runner.compiled is not None and engine.model_runner.compiled.paths == {
            "varlen": fallback, "decode": fallback}
    assert decides == [own, own, fallback]
    with LLMEngine(model, GenerationConfig(disable_compile=True), ContinuousBatchingConfig(num_blocks=8)) as engine:
        assert engine.model_runner.compiled is None


def test_weight_update_recompiles_frozen_graphs() -> None:
    """A frozen graph holds the weights it was compiled with: after the weights signal the next step compiles
    again and uses the new weights (greedy output equals `generate` with them)."""
    torch._dynamo.reset()
    model = fresh_tiny_model("llama")
    prompt = random_prompts([9], seed=12)[0]
    with make_engine(model, block_size=4, num_blocks=64, decode_compile_config=FROZEN) as engine:
        engine.add_request(prompt, request_id="before", max_new_tokens=5)
        before = run_engine(engine)["before"]
        with torch.no_grad():
            for parameter in model.model.layers[0].mlp.parameters():
                parameter.mul_(-1.5)
        engine.mark_weights_updated()
        assert engine.model_runner.compiled is not None and not engine.model_runner.compiled.compile_seconds
        engine.add_request(prompt, request_id="after", max_new_tokens=5)
        after = run_engine(engine)["after"]
    assert after.generated_tokens == reference_generate(model, prompt, 5)
    assert after.generated_tokens != before.generated_tokens  # the stale graph would have repeated these


def test_engines_of_one_model_share_the_compiled_forward() -> None:
    """`generate_batch` builds an engine per call: the second engine reuses the first one's graphs, unless the
    weights changed in between (a frozen graph would hold the old ones)."""
    model = fresh_tiny_model("llama")
    config = {"block_size": 4, "num_blocks": 32, "decode_compile_config": FROZEN}
    with make_engine(model, **config) as first:
        first.add_request([5, 6, 7], request_id="a", max_new_tokens=3)
        run_engine(first)
        compiled = first.model_runner.compiled
    with make_engine(model, **config) as second:
        assert second.model_runner.compiled is compiled and "decode" in compiled.compile_seconds
    with torch.no_grad():
        model.lm_head.weight.add_(0.5)
    with make_engine(model, **config) as third:
        assert third.model_runner.compiled is compiled and not compiled.compile_seconds


@pytest.mark.parametrize("name", ["llama", "mistral-sliding"])
def test_one_graph_serves_steps_of_one_token_and_of_fewer_than_two_logits_rows(name: str) -> None:
    """After the first compile (two requests), no step compiles again: a lone request decoding (one token), a
    prompt of one token, a prompt alone in chunks (no logits row, then one), a lone request asking for prompt
    logprobs. Greedy tokens equal `generate`'s and the pool is whole (the padding touches only the scratch slot)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = fresh_tiny_model(name)
    reference = copy.deepcopy(model)
    first, lone, chunked, logprobs = random_prompts([6, 9, 30, 11], seed=13)
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=8,
                     use_default_compile_configs=True) as engine:
        engine.add_request(first, request_id="first", max_new_tokens=3)
        engine.add_request(first[:4], request_id="second", max_new_tokens=3)
        finished = run_engine(engine)
        assert counters["stats"]["unique_graphs"] == 1
        for request_id, prompt, max_new in [("lone", lone, 9), ("one-token", lone[:1], 5),
                                            ("chunked", chunked, 4)]:
            engine.add_request(prompt, request_id=request_id, max_new_tokens=max_new)
            finished |= run_engine(engine)
            assert finished[request_id].generated_tokens == reference_generate(model, prompt, max_new), request_id
        engine.add_request(logprobs, request_id="logprobs", max_new_tokens=2, prompt_logprobs=1)
        finished |= run_engine(engine)
    assert counters["stats"]["unique_graphs"] == 1, "a step of one token or logits row compiled a graph of its own"
    assert finished["first"].generated_tokens == reference_generate(model, first, 3)
    assert finished["second"].generated_tokens == reference_generate(model, first[:4], 3)
    check_entries(finished["logprobs"].prompt_logprobs, reference_logprobs(reference, logprobs), logprobs, 1)


class _Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (3.0 if self.training else 1.0)


@pytest.mark.skipif(not hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"), reason="torch too old")
def test_the_served_config_skips_module_guards_and_the_default_keeps_them() -> None:
    """The library's default guards the model's module attributes: a train/eval switch after compiling
    recompiles. `served_compile_config()`, for a model nothing changes (`contbatch serve`'s), checks none: the
    graph compiled before the switch runs on."""
    x = torch.randn(2, 4)
    for config, guarded in ((default_compile_config(), True), (served_compile_config(), False)):
        torch._dynamo.reset()
        module = _Flagged().eval()
        forward = torch.compile(module.forward, **{**compile_kwargs(config), "backend": "eager"})
        evaluated = forward(x)
        module.train()
        with torch.no_grad():
            expected = module.linear(x) * (3.0 if guarded else 1.0)
        torch.testing.assert_close(forward(x), expected)
        torch.testing.assert_close(evaluated, module.linear(x))

