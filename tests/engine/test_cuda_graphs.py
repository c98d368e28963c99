"""Decode steps from captured graphs over padded buckets: the bucketing and buffers on any device (`EagerReplay`
re-runs the forward over the static buffers), real CUDA graphs where a GPU is present."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

from contbatch.engine import attention, attention_math
from contbatch.engine.config import ContinuousBatchingConfig
from contbatch.engine.cuda_graphs import (
    PRESET_BATCH_INTERVAL,
    PRESET_KV_INTERVAL,
    PRESET_MAX_GRAPHS,
    EagerReplay,
    GraphSettings,
    StepGraphs,
    resolve_graph_settings,
    round_up,
)
from contbatch.engine.engine import LLMEngine
from tests.helpers import (
    add_samples,
    fresh_tiny_model,
    make_engine,
    random_prompts,
    reference_generate,
    run_engine,
    tiny_model,
)

LENGTHS = [1, 3, 7, 12, 20, 33, 5, 9, 15, 2, 26]
MAX_NEW = [14, 9, 12, 3, 10, 6, 13, 8, 11, 5, 7]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class PoolRecordingReplay(EagerReplay):
    """`EagerReplay` that numbers its pools and records the pool of every capture."""

    def __init__(self) -> None:
        self.pool = 0
        self.captured_in: list[int] = []

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.captured_in.append(self.pool)
        return run

    def new_pool(self) -> None:
        self.pool += 1


def with_eager_graphs(engine: LLMEngine, settings: GraphSettings, backend: EagerReplay | None = None) -> StepGraphs:
    graphs = StepGraphs(engine.cache, settings, backend or EagerReplay())
    engine.model_runner.graphs = graphs
    return graphs


def add_all(engine: LLMEngine, prompts: list[list[int]], **sampling: object) -> None:
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=max_new, **sampling)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "sdpa"])
def test_padded_buckets_match_generate(model_name: str, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches padded to multiples of 2 requests and keys to multiples of 4 (several buckets, graphs evicted past
    3): greedy outputs equal generate's, and padding leaves the pool whole."""
    if not kernel:
        monkeypatch.setattr(attention, "paged_decode_kernel", lambda: None)
    model = tiny_model(model_name)
    prompts = random_prompts(LENGTHS, seed=3)
    with make_engine(model, block_size=4, num_blocks=200, max_batch_tokens=64) as engine:
        graphs = with_eager_graphs(engine, GraphSettings(batch_interval=2, kv_interval=4, max_graphs=3))
        add_all(engine, prompts)
        finished = run_engine(engine)
    assert graphs.num_captures > 3 and len(graphs.graphs) == 3
    assert all(key.batch % 2 == 0 and all(length % 4 == 0 for length, _ in key.layouts) for key in graphs.graphs)
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, max_new), f"r{index}"


def test_sampled_tokens_and_logprobs_match_the_unpadded_run() -> None:
    """Seeded sampling with processed logprobs: the same tokens and logprobs (to rounding) with and without
    padding, since a padded row changes no real row's logits."""
    model = tiny_model("llama")
    prompts = random_prompts(LENGTHS, seed=4)
    results = []
    for padded in (False, True):
        with make_engine(model, block_size=8, num_blocks=100, return_logprobs=True) as engine:
            if padded:
                with_eager_graphs(engine, GraphSettings(batch_interval=16, kv_interval=32, max_graphs=8))
            add_all(engine, prompts, do_sample=True, temperature=0.8, top_k=20, seed=7,
                    logprobs_mode="processed")
            results.append(run_engine(engine))
    plain, padded_run = results
    for request_id, output in plain.items():
        assert padded_run[request_id].generated_tokens == output.generated_tokens
        assert padded_run[request_id].logprobs == pytest.approx(output.logprobs, abs=1e-4)


def _mixed_run(padded: bool) -> tuple[dict[str, list], int]:
    """Beam search beside seeded n samples, penalties, biases, top logprobs and prompt logprobs; returns each
    finished output's tokens, logprobs, top logprobs, prompt logprobs and score, and the graphs captured."""
    model = tiny_model("llama")
    prompts = random_prompts([6, 11, 17, 4, 9], seed=9)
    with make_engine(model, block_size=4, num_blocks=40, max_batch_tokens=24) as engine:
        graphs = with_eager_graphs(engine, GraphSettings(batch_interval=4, kv_interval=8, max_graphs=4))
        if not padded:
            engine.model_runner.graphs = None
        engine.add(engine.make_request(prompts[0], "beam", 6, num_beams=3, num_return_sequences=2))
        add_samples(engine, prompts[1], "n", 3, max_new_tokens=7, do_sample=True, temperature=0.9, top_p=0.9,
                    seed=5, logprobs=True, top_logprobs=2, logprobs_mode="processed")
        engine.add_request(prompts[2], "pen", 8, repetition_penalty=1.4, frequency_penalty=0.5,
                           logit_bias={7: 2.0}, logprobs=True)
        engine.add_request(prompts[3], "plp", 5, prompt_logprobs=2)
        engine.add_request(prompts[4], "plain", 9)
        finished = run_engine(engine)
    return {rid: [out.generated_tokens, out.logprobs, out.top_logprobs, out.prompt_logprobs, out.sequence_score]
            for rid, out in finished.items()}, graphs.num_captures


def test_every_decoding_feature_is_unchanged_by_padded_graphs() -> None:
    (plain, _), (padded, captures) = _mixed_run(False), _mixed_run(True)
    assert captures >= 2
    assert plain.keys() == padded.keys() and {"beam_0", "beam_1", "n_2", "pen", "plp"} <= plain.keys()
    for request_id, (tokens, logprobs, top, prompt, score) in plain.items():
        other = padded[request_id]
        assert other[0] == tokens and other[3] == prompt, request_id
        assert (other[1] is None) == (logprobs is None) and (other[4] is None) == (score is None), request_id
        if logprobs is not None:
            assert other[1] == pytest.approx(logprobs, abs=1e-4), request_id
        if score is not None:
            assert other[4] == pytest.approx(score, abs=1e-4), request_id
        if top is not None:
            assert [[token for token, _ in step] for step in other[2]] == [[t for t, _ in step] for step in top]


def test_graphs_are_dropped_when_the_cache_storage_or_a_parameter_storage_changes() -> None:
    """In-place weight updates keep the graphs (they read the same memory); a replaced parameter or a new cache
    storage drops them, and the graphs captured after that go into a new pool (a CUDA pool whose graphs are all
    gone must not be captured into again)."""
    model = fresh_tiny_model("llama")
    prompts = random_prompts([4, 6], seed=5)
    backend = PoolRecordingReplay()
    with make_engine(model, block_size=4, num_blocks=50) as engine:
        graphs = with_eager_graphs(engine, GraphSettings(4, 8, 8), backend)
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, f"a{index}", max_new_tokens=3)
        run_engine(engine)
        assert graphs.graphs and not engine.check_weights()
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)
        assert engine.check_weights() and graphs.graphs
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        assert engine.check_weights() and not graphs.graphs
        engine.add_request(prompts[0], "b", max_new_tokens=3)
        run_engine(engine)
        assert graphs.graphs
        engine.sleep()
        assert not graphs.graphs
        engine.add_request(prompts[1], "c", max_new_tokens=3)
        run_engine(engine)
    assert backend.captured_in == sorted(backend.captured_in)
    assert set(backend.captured_in) == {0, 1, 2}, "the pools before and after a new parameter, after sleep"


def test_settings_follow_the_config_and_the_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_graph_settings(None, 0, 0, 0, cpu, None) is None
    with pytest.warns(UserWarning, match="use_cuda_graph=True needs a CUDA device; the model is on cpu"):
        assert resolve_graph_settings(True, 0, 0, 0, cpu, None) is None
    assert resolve_graph_settings(False, 16, 64, 4, cuda, None) is None
    assert resolve_graph_settings(None, 0, 0, 0, cuda, None) == GraphSettings(
        PRESET_BATCH_INTERVAL, PRESET_KV_INTERVAL, PRESET_MAX_GRAPHS)
    assert resolve_graph_settings(True, 16, 64, 4, cuda, None) == GraphSettings(16, 64, 4)
    own_graphs = CompileConfig(mode="reduce-overhead")
    assert resolve_graph_settings(None, 0, 0, 0, cuda, own_graphs) is None
    with pytest.warns(UserWarning, match="captures CUDA graphs itself"):
        assert resolve_graph_settings(True, 0, 0, 0, cuda, own_graphs) is None
    assert resolve_graph_settings(None, 0, 0, 0, cuda, CompileConfig(mode="default")) is not None
    assert [round_up(value, 8) for value in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 24]


@CUDA
@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "gemma3-hybrid"])
def test_cuda_graphs_match_generate_on_gpu(name: str) -> None:
    """Real CUDA graphs (the default on a GPU): greedy outputs equal generate's on the same GPU."""
    model = copy.deepcopy(tiny_model(name)).cuda()
    prompts = random_prompts(LENGTHS, seed=6)
    with make_engine(model, block_size=4, num_blocks=200, max_batch_tokens=64, q_padding_interval_size=2,
                     kv_padding_interval_size=16, max_cached_graphs=4) as engine:
        graphs = engine.model_runner.graphs
        assert graphs is not None
        add_all(engine, prompts)
        finished = run_engine(engine)
    assert graphs.num_captures > 1 and len(graphs.graphs) <= 4
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        expected = reference_generate(model, [*prompt], max_new)
        assert finished[f"r{index}"].generated_tokens == expected, f"r{index}"


@CUDA
def test_graphs_captured_again_after_sleep_and_a_new_parameter_match_generate_on_gpu() -> None:
    """Real graphs with async batching (a CUDA model's defaults): after `sleep()`/`wake()` and after a replaced
    parameter, the graphs captured again go into a new pool while the last step's logits may still be alive
    (capturing into the emptied pool tripped the allocator's `use_count > 0` assertion and broke later runs)."""
    model = fresh_tiny_model("llama").cuda()
    prompts = random_prompts([9, 17], seed=8)
    with make_engine(model, block_size=4, num_blocks=100) as engine:
        assert engine.model_runner.graphs is not None and engine.async_batching
        for round_ in range(3):
            if round_ == 1:
                engine.sleep()
                engine.wake()
            if round_ == 2:
                model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
                engine.check_weights()
            for index, prompt in enumerate(prompts):
                engine.add_request(prompt, f"{round_}-{index}", max_new_tokens=6)
            finished = run_engine(engine)
            for index, prompt in enumerate(prompts):
                assert finished[f"{round_}-{index}"].generated_tokens == reference_generate(model, prompt, 6)


@CUDA
def test_a_generation_compile_config_that_makes_graphs_turns_contbatchs_off() -> None:
    """The decode path compiled through the generation config's `compile_config` (transformers' fallback) in a
    mode that captures CUDA graphs itself: contbatch captures none of its own."""
    model = copy.deepcopy(tiny_model("llama")).cuda()
    generation = GenerationConfig(do_sample=False, compile_config=CompileConfig(mode="reduce-overhead"))
    with LLMEngine(model, generation, ContinuousBatchingConfig(num_blocks=16)) as engine:
        assert engine.model_runner.graphs is None
        assert engine.model_runner.compiled is not None and set(engine.model_runner.compiled.paths) == {
            "varlen", "decode"}


@pytest.mark.parametrize("num_queries", [1, 5])
def test_folded_grouped_query_attention_equals_sdpa_with_gqa(num_queries: int) -> None:
    """The GPU attention path folds each KV head's query heads into its query length: same result as SDPA's own
    grouped-query attention (checked here on the CPU's kernels), padding keys masked."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, head_dim = 3, 8, 2, 11, 16
    q = torch.randn(batch, num_queries, heads, head_dim, generator=generator).transpose(1, 2)
    k, v = (torch.randn(batch, length, kv_heads, head_dim, generator=generator).transpose(1, 2) for _ in range(2))
    positions = torch.tensor([[4], [10], [7]]) + torch.arange(num_queries) - num_queries + 1
    mask = (torch.arange(length) <= positions.unsqueeze(-1)).unsqueeze(1)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    folded = attention_math.folded_gqa_attention(q, k, v, mask, 0.3)
    torch.testing.assert_close(folded, expected, rtol=1e-5, atol=1e-5)


@CUDA
def test_manager_streams_from_cuda_graphs_while_another_thread_trains() -> None:
    """The manager's engine thread captures and replays graphs while the caller's thread runs a training forward
    and backward on the same model: streamed tokens equal generate's, and the training forward is the model's own."""
    from contbatch import ContinuousBatchingManager

    model = copy.deepcopy(tiny_model("llama")).cuda()
    prompts = random_prompts(LENGTHS, seed=8)
    reference = copy.deepcopy(model)
    batch = torch.tensor([prompts[5][:16]], device="cuda")
    config = ContinuousBatchingConfig(block_size=8, num_blocks=256, q_padding_interval_size=4)
    generation = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=10)
    with ContinuousBatchingManager(model, generation, config) as manager:
        ids = [manager.add_request(prompt, f"m{index}", streaming=True) for index, prompt in enumerate(prompts)]
        loss = model(batch, labels=batch).loss
        loss.backward()
        streams = {request_id: list(manager.request_id_iter(request_id)) for request_id in ids}
        assert manager.engine.model_runner.graphs is not None and manager.engine.model_runner.graphs.num_captures
    expected_loss = reference(batch, labels=batch).loss
    assert torch.equal(loss.detach(), expected_loss.detach())
    for index, prompt in enumerate(prompts):
        outputs = streams[f"m{index}"]
        streamed = [token for output in outputs for token in output.new_tokens]
        assert outputs[-1].is_finished() and streamed == reference_generate(model, prompt, 10), f"m{index}"
