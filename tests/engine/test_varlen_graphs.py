"""Varlen steps (steps with prompt tokens) replayed from captured graphs, through the Triton kernel's ragged groups:
the buckets, capture on a bucket's second step, one `max_cached_graphs` for decode and varlen graphs, and greedy
and sampled parity with the eager engine and `generate`. On a CPU the graphs are `EagerReplay` and the kernel runs
under Triton's interpreter (`tests/conftest.py`); on a GPU (`CONTBATCH_TEST_DEVICE=cuda`) they are CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from contbatch.engine import triton_attention
from contbatch.engine.cuda_graphs import CudaGraphBackend, EagerReplay, GraphKey, GraphSettings, StepGraphs
from contbatch.engine.engine import LLMEngine
from contbatch.engine.varlen_graphs import VarlenKey, bucket
from tests.helpers import (
    TEST_DEVICE,
    fresh_tiny_model,
    make_engine,
    random_prompts,
    reference_generate,
    run_engine,
    tiny_model,
)

LENGTHS = [5, 9, 12, 7, 20, 6, 11, 9, 15, 8]
MAX_NEW = [6, 3, 8, 5, 4, 7, 3, 6, 5, 4]

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="Triton is not installed")


@pytest.fixture(autouse=True)
def triton_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(triton_attention.KERNEL_ENV, "triton")


class CountingReplay(EagerReplay):
    """`EagerReplay` that counts replays."""

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def replay() -> torch.Tensor:
            self.replays += 1
            return run()

        return replay


def with_graphs(engine: LLMEngine, settings: GraphSettings) -> tuple[StepGraphs, CountingReplay]:
    backend = CountingReplay()
    graphs = StepGraphs(engine.cache, settings, CudaGraphBackend() if TEST_DEVICE.type == "cuda" else backend)
    engine.model_runner.graphs = graphs
    return graphs, backend


def add_all(engine: LLMEngine, prompts: list[list[int]], **sampling: object) -> None:
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=max_new, **sampling)


def test_buckets_are_multiples_of_the_interval_at_most_a_quarter_over() -> None:
    assert [bucket(v, 8) for v in (0, 1, 8, 9, 33, 100, 130, 4096, 4097)] == [0, 8, 8, 16, 40, 112, 160, 4096, 5120]
    for value in range(1, 6000):
        padded = bucket(value, 8)
        assert padded >= value and padded % 8 == 0
        assert padded <= max(value * 1.25, -(-value // 8) * 8)
    assert len({bucket(value, 8) for value in range(1, 4097)}) <= 40


@pytest.mark.parametrize("model_name", ["gemma3-hybrid", pytest.param("llama", marks=pytest.mark.slow),
                                        pytest.param("gemma2-softcap", marks=pytest.mark.slow),
                                        pytest.param("mistral-sliding", marks=pytest.mark.slow),
                                        pytest.param("deepseek-mla", marks=pytest.mark.slow)])
def test_varlen_steps_replayed_match_generate(model_name: str) -> None:
    """Prompts arriving over several steps, chunked by a small budget: varlen steps fall in recurring buckets,
    are captured on their second step and replayed after; greedy outputs equal generate's and the pool is
    whole."""
    model = tiny_model(model_name)
    prompts = random_prompts(LENGTHS, seed=21)
    with make_engine(model, block_size=4, num_blocks=200, max_batch_tokens=16) as engine:
        graphs, backend = with_graphs(engine, GraphSettings(batch_interval=4, kv_interval=8, max_graphs=64))
        add_all(engine, prompts)
        finished = run_engine(engine)
    varlen = [key for key in graphs.graphs if isinstance(key, VarlenKey)]
    assert varlen and any(isinstance(key, GraphKey) for key in graphs.graphs)
    assert all(key.tokens % 4 == 0 and all(length % 8 == 0 for length, _ in key.layouts) for key in varlen)
    if TEST_DEVICE.type == "cpu":
        assert backend.replays > graphs.num_captures
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, max_new), f"r{index}"


def test_a_varlen_bucket_is_captured_on_its_second_step() -> None:
    """The first step of a bucket runs eagerly, the second captures, the third replays."""
    model = tiny_model("llama")
    prompts = random_prompts([6, 6, 6], seed=2)
    captures = []
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=64) as engine:
        graphs, _ = with_graphs(engine, GraphSettings(batch_interval=8, kv_interval=8, max_graphs=8))
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=1)
            run_engine(engine)
            captures.append(sum(isinstance(key, VarlenKey) for key in graphs.graphs))
    assert captures == [0, 1, 1]


def test_decode_and_varlen_graphs_share_max_cached_graphs() -> None:
    model = tiny_model("llama")
    prompts = random_prompts(LENGTHS, seed=8)
    with make_engine(model, block_size=4, num_blocks=200, max_batch_tokens=16) as engine:
        graphs, _ = with_graphs(engine, GraphSettings(batch_interval=2, kv_interval=4, max_graphs=2))
        add_all(engine, prompts)
        finished = run_engine(engine)
    assert len(graphs.graphs) <= 2 and graphs.num_captures > 2
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, max_new), f"r{index}"


def test_sampled_tokens_and_logprobs_match_the_eager_run() -> None:
    """Seeded sampling with processed logprobs: the same tokens, and logprobs to rounding, with varlen steps
    replayed and without graphs."""
    model = tiny_model("llama")
    prompts = random_prompts(LENGTHS, seed=4)
    results = []
    for graphs in (False, True):
        with make_engine(model, block_size=4, num_blocks=200, max_batch_tokens=16, return_logprobs=True) as engine:
            if graphs:
                with_graphs(engine, GraphSettings(batch_interval=4, kv_interval=8, max_graphs=16))
            add_all(engine, prompts, do_sample=True, temperature=0.8, top_k=20, seed=7, logprobs_mode="processed")
            results.append(run_engine(engine))
    eager, replayed = results
    for request_id, output in eager.items():
        assert replayed[request_id].generated_tokens == output.generated_tokens
        torch.testing.assert_close(replayed[request_id].logprobs, output.logprobs, rtol=1e-4, atol=1e-4)


def test_compiled_forwards_replayed_match_generate() -> None:
    """`use_default_compile_configs`: the compiled varlen and decode forwards captured as graphs, attention an
    opaque op calling the kernel with the step's ragged group; greedy outputs equal generate's."""
    torch._dynamo.reset()
    model = fresh_tiny_model("llama")
    prompts = random_prompts(LENGTHS, seed=13)
    with make_engine(model, block_size=4, num_blocks=200, max_batch_tokens=16,
                     use_default_compile_configs=True) as engine:
        graphs, _ = with_graphs(engine, GraphSettings(batch_interval=4, kv_interval=8, max_graphs=64))
        add_all(engine, prompts)
        finished = run_engine(engine)
        assert engine.model_runner.compiled is not None and "varlen" in engine.model_runner.compiled.paths
    assert any(isinstance(key, VarlenKey) for key in graphs.graphs)
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, max_new), f"r{index}"
