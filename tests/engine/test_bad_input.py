"""Bad input gets a clear error naming the request and the value, and fails only its own request."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, RequestStatus, generate_batch
from tests.helpers import VOCAB, make_engine, random_prompts, reference_generate, run_engine, tiny_model


@pytest.mark.parametrize(
    ("prompt", "options", "message"),
    [
        ([], {}, "'bad': the prompt is empty"),
        ([1, VOCAB], {}, f"token id {VOCAB} is outside the vocabulary"),
        ([1, -1], {}, "token id -1 is outside the vocabulary"),
        ([1, 2.5], {}, "token id 2.5 is not an integer"),
        ([1, True], {}, "token id True is not an integer"),
        ("hello", {}, "input_ids must be a list of token ids"),
        (torch.tensor([1.0, 2.0]), {}, "1-D integer tensor"),
        ([1, 2], {"max_new_tokens": -3}, "max_new_tokens must be an integer >= 0, got -3"),
        ([1, 2], {"prompt_logprobs_start": 1}, "prompt_logprobs_start=1 needs prompt_logprobs"),
        ([1, 2], {"prompt_logprobs": 0, "prompt_logprobs_start": 2}, "prompt_logprobs_start=2 is not a position"),
        ([1] * 1026, {"max_new_tokens": 0}, "needs 1025 positions"),
        ([1] * 30, {"max_new_tokens": 40}, "needs 9 blocks of 8 tokens, more than the cache can ever hold"),
        ([1] * 10, {"max_new_tokens": 1020}, "exceeds the model's 1024 positions"),
        ([1, 2], {"temperature": -1.0}, "temperature must be a finite number > 0"),
        ([1, 2], {"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ([1, 2], {"top_k": -1}, "top_k must be an integer >= 0, got -1"),
        ([1, 2], {"colour": "red"}, "unknown sampling parameter(s) ['colour']"),
    ],
)
def test_add_request_rejects_bad_input_naming_request_and_value(prompt: object, options: dict, message: str) -> None:
    with make_engine(tiny_model("llama"), block_size=8, num_blocks=8) as engine:
        with pytest.raises(ValueError) as error:
            engine.add_request(prompt, request_id="bad", **options)  # type: ignore[arg-type]
        assert message in str(error.value)
        assert "'bad'" in str(error.value)
        assert not engine.has_unfinished_requests() and engine.block_pool.is_whole


def test_duplicate_request_id_is_rejected() -> None:
    with make_engine(tiny_model("llama"), block_size=8, num_blocks=8) as engine:
        engine.add_request([1, 2, 3], request_id="x")
        with pytest.raises(ValueError, match="'x': a request with this id is already running"):
            engine.add_request([4, 5], request_id="x")
        run_engine(engine)


def test_generate_batch_fails_bad_requests_alone() -> None:
    model = tiny_model("llama")
    good = random_prompts([5, 9], seed=11)
    inputs = [good[0], [], [1, VOCAB + 5], [1] * 2000, good[1], [1, "a"]]
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None)
    outputs = generate_batch(model, inputs, config, ContinuousBatchingConfig(block_size=4, num_blocks=64),
                             progress_bar=False)
    assert list(outputs) == [f"req_{i}" for i in range(6)]
    for index in (1, 2, 3, 5):
        output = outputs[f"req_{index}"]
        assert output.status == RequestStatus.FAILED and output.finish_reason == "error"
        assert f"'req_{index}'" in output.error
    assert outputs["req_0"].generated_tokens == reference_generate(model, good[0], 6)
    assert outputs["req_4"].generated_tokens == reference_generate(model, good[1], 6)
    assert outputs["req_4"].status == RequestStatus.FINISHED


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, "block_size must be an integer >= 1, got 0"),
        ("num_blocks", -2, "num_blocks must be an integer >= 1, got -2"),
        ("max_batch_tokens", 1.5, "max_batch_tokens must be an integer >= 1, got 1.5"),
        ("max_memory_percent", 1.5, "max_memory_percent must be in (0, 1], got 1.5"),
        ("scheduler_type", "lifo", "scheduler_type must be one of ('fifo', 'prefill_first'), got 'lifo'"),
        ("max_queue_size", -1, "max_queue_size must be an integer >= 0, got -1"),
        ("max_prefill_tokens_while_decoding", 0, "max_prefill_tokens_while_decoding must be an integer >= 1, got 0"),
        ("use_cuda_graph", "yes", "use_cuda_graph must be a bool or None, got 'yes'"),
        ("return_logprobs", 1, "return_logprobs must be a bool, got 1"),
        ("decode_compile_config", {"fullgraph": True}, "decode_compile_config must be a transformers CompileConfig"),
    ],
)
def test_bad_config_value_is_named(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as error:
        ContinuousBatchingConfig(**{field: value})
    assert message in str(error.value)


def test_generate_batch_rejects_unknown_keyword() -> None:
    with pytest.raises(ValueError, match=r"unknown keyword argument\(s\) \['max_tokenz'\]"):
        generate_batch(tiny_model("llama"), [[1, 2]], max_tokenz=3)


def test_a_failing_forward_fails_its_batch_and_the_engine_keeps_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Synchronous steps, so that the failing step returns its own requests (test_async_batching fails a forward
    with async batching on)."""
    model = tiny_model("llama")
    prompts = random_prompts([4, 6, 8], seed=12)
    with make_engine(model, block_size=4, num_blocks=32, use_async_batching=False) as engine:
        engine.add_request(prompts[0], request_id="a", max_new_tokens=4)
        engine.add_request(prompts[1], request_id="b", max_new_tokens=4)
        real_execute = engine.model_runner.execute

        def broken(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("boom")

        monkeypatch.setattr(engine.model_runner, "execute", broken)
        failed = engine.step()
        assert {r.request_id for r in failed} == {"a", "b"}
        assert all(r.status == RequestStatus.FAILED and r.error == "RuntimeError: boom" for r in failed)
        assert engine.block_pool.is_whole
        monkeypatch.setattr(engine.model_runner, "execute", real_execute)
        engine.add_request(prompts[2], request_id="c", max_new_tokens=4)
        finished = run_engine(engine)
    assert finished["c"].generated_tokens == reference_generate(model, prompts[2], 4)


def test_a_request_that_can_never_start_fails_alone_instead_of_stalling() -> None:
    from contbatch.engine.request import Request
    from contbatch.engine.sampling_params import SamplingParams

    with make_engine(tiny_model("llama"), block_size=4, num_blocks=4, max_batch_tokens=64) as engine:
        engine.add(Request("huge", [1] * 40, SamplingParams(max_new_tokens=2)))  # bypasses validation: 10 blocks
        engine.add_request([1, 2, 3], request_id="small", max_new_tokens=2)
        finished = run_engine(engine)
    assert finished["huge"].status == RequestStatus.FAILED and "cannot fit" in finished["huge"].error
    assert finished["small"].status == RequestStatus.FINISHED
