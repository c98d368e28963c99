"""What one step hands the next: the drawn tokens stay on the device and are carried into the next step's input
ids there, and async batching launches that step before the tokens are read on the host."""

from __future__ import annotations

import pytest
import torch

from contbatch.engine.attention import AttentionGroup
from contbatch.engine.handoff import DrawnStep, PreparedBatch, int_tensor
from contbatch.engine.sampler import Sampler, SamplerOutput
from contbatch.engine.sampling_params import SamplingParams
from contbatch.engine.step_pipeline import ForwardWorker
from tests.helpers import TEST_DEVICE, make_engine, random_prompts, reference_generate, run_engine, tiny_model


def _prepared(input_ids: list[int], carried_rows: list[int], carried_ids: list[str]) -> PreparedBatch:
    groups: list[AttentionGroup] = []
    return PreparedBatch(int_tensor(input_ids), int_tensor(range(len(input_ids))), int_tensor([len(input_ids) - 1]),
                         torch.zeros(1, len(input_ids), dtype=torch.long), groups, carried_rows, carried_ids)


def _drawn(request_ids: list[str], tokens: list[int], device: torch.device = TEST_DEVICE) -> DrawnStep:
    token_ids = torch.tensor(tokens, device=device)
    logprobs = -torch.arange(len(tokens), dtype=torch.float32, device=device) / 4
    return DrawnStep(request_ids, SamplerOutput(token_ids, logprobs))


def test_carried_placeholders_take_their_requests_tokens_on_the_device() -> None:
    """By request id, whatever the order of the drawn step's rows; a request the step did not draw for (it ended
    or failed) keeps its placeholder, and rows that carry nothing keep their tokens."""
    prepared = _prepared([5, 0, 7, 8, 0, 0], carried_rows=[1, 4, 5], carried_ids=["b", "gone", "a"])
    prepared.carry(_drawn(["a", "c", "b"], [40, 41, 42]))
    input_ids = prepared.device_input_ids(TEST_DEVICE)
    assert input_ids.device.type == TEST_DEVICE.type
    assert input_ids.tolist() == [5, 42, 7, 8, 0, 40]


def test_a_batch_without_carried_tokens_or_without_a_match_is_left_as_built() -> None:
    prepared = _prepared([3, 0], carried_rows=[1], carried_ids=["x"])
    prepared.carry(_drawn(["y"], [9]))
    assert prepared.device_input_ids(TEST_DEVICE).tolist() == [3, 0]
    assert _prepared([1, 2], [], []).device_input_ids(TEST_DEVICE).tolist() == [1, 2]


def test_a_drawn_step_resolves_to_its_host_output() -> None:
    output = _drawn(["a", "b", "c"], [4, 5, 6]).resolve()
    assert output.request_ids == ["a", "b", "c"]
    assert output.sampled_token_ids == [4, 5, 6]
    assert output.logprobs == [0.0, -0.25, -0.5]


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "worker-thread"])
def test_async_batching_launches_the_next_step_before_reading_the_drawn_tokens(
        inline: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decode step's forward is launched (inline: computed, on a CPU) with the tokens of the step before
    taken from the device, before that step's tokens are read on the host; outputs equal `generate`'s."""
    model = tiny_model("llama")
    prompts = random_prompts([3, 11, 6], seed=31)
    ahead: list[bool] = []
    resolve = DrawnStep.resolve

    def resolving(drawn: DrawnStep):  # type: ignore[no-untyped-def]
        in_flight = engine.pipeline._in_flight
        carried = {entry.request_id for entry in in_flight.output.requests if entry.carried} if in_flight else set()
        ahead.append(bool(carried & set(drawn.request_ids)))
        return resolve(drawn)

    monkeypatch.setattr(DrawnStep, "resolve", resolving)
    with make_engine(model, use_async_batching=True, block_size=4, num_blocks=100) as engine:
        engine.pipeline._worker = ForwardWorker(inline=inline)
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, f"r{index}", max_new_tokens=8)
        outputs = run_engine(engine)
        assert engine.block_pool.is_whole
    assert sum(ahead) >= 6, f"decode steps launched ahead of their tokens: {ahead}"
    for index, prompt in enumerate(prompts):
        assert outputs[f"r{index}"].generated_tokens == reference_generate(model, prompt, 8), f"r{index}"


GPU_DRAWS = {
    "greedy": SamplingParams(),
    "top-p": SamplingParams(do_sample=True, top_p=0.9),
    "top-k-temperature-min-p": SamplingParams(do_sample=True, top_k=20, temperature=0.7, min_p=0.05),
    "logprobs": SamplingParams(do_sample=True, top_p=0.8, logprobs=True, top_logprobs=3),
}


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="checks that the host never waits for a CUDA device")
@pytest.mark.parametrize("params", GPU_DRAWS.values(), ids=GPU_DRAWS)
def test_drawing_and_carrying_never_wait_for_the_gpu(params: SamplingParams) -> None:
    """A step is drawn, its tokens carried into the next step's input ids and their copies to the host started
    without one synchronisation (`torch.cuda.set_sync_debug_mode` raises at any): the host may launch the next
    forward while the device still computes. Mixed rows (half greedy) index their rows on the device too."""
    logits = torch.randn(8, 300, device=TEST_DEVICE)
    rows = [params if row % 2 else SamplingParams() for row in range(8)]
    prepared = _prepared([1, 0, 2, 0], carried_rows=[1, 3], carried_ids=["r3", "r0"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drawn = DrawnStep([f"r{row}" for row in range(8)], Sampler().draw(logits, rows, [None] * 8))
        prepared.carry(drawn)
        input_ids = prepared.device_input_ids(TEST_DEVICE)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens = drawn.resolve().sampled_token_ids
    assert input_ids.tolist() == [1, tokens[3], 2, tokens[0]]
