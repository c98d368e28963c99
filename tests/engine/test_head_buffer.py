"""The reused per-thread buffer of the output head's products: reuse within a thread, a buffer per thread, logits in
it only inside `reusing_logits`, and engine steps whose logits go there giving exactly the outputs of steps whose
logits are fresh tensors."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from contbatch.engine import head_buffer, packed_weights
from contbatch.outputs import GenerationOutput
from tests.conftest import VOCAB, make_engine, random_prompts, reference_generate, run_engine, tiny_model


def test_a_thread_reuses_its_buffer_and_another_thread_has_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_buffer, "REUSED_OUTPUT_BYTES", 4 * 100)
    assert head_buffer.buffer(10, 10) is None  # 400 bytes: not above the threshold
    first = head_buffer.buffer(8, 50)
    smaller = head_buffer.buffer(3, 40)
    assert first is not None and smaller is not None
    assert first.shape == (8, 50) and smaller.shape == (3, 40) and smaller.is_contiguous()
    assert smaller.data_ptr() == first.data_ptr()
    larger = head_buffer.buffer(20, 50)
    assert larger is not None and larger.numel() == 1000
    other: list[torch.Tensor | None] = []
    thread = threading.Thread(target=lambda: other.append(head_buffer.buffer(8, 50)))
    thread.start()
    thread.join()
    assert other[0] is not None and other[0].data_ptr() != larger.data_ptr()


def test_logits_go_into_the_buffer_only_inside_reusing_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_buffer, "REUSED_OUTPUT_BYTES", 0)
    assert head_buffer.logits_buffer(4, 8, torch.float32) is None
    with head_buffer.reusing_logits():
        assert head_buffer.logits_buffer(4, 8, torch.float32) is not None
        with head_buffer.reusing_logits(False):
            assert head_buffer.logits_buffer(4, 8, torch.float32) is None
        assert head_buffer.logits_buffer(4, 8, torch.float32) is not None
    assert head_buffer.logits_buffer(4, 8, torch.float32) is None


def test_a_buffer_of_another_dtype_shares_the_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_buffer, "REUSED_OUTPUT_BYTES", 0)
    wide = head_buffer.buffer(6, 10)
    narrow = head_buffer.buffer(6, 10, torch.bfloat16)
    assert wide is not None and narrow is not None
    assert narrow.dtype == torch.bfloat16 and narrow.shape == (6, 10) and narrow.data_ptr() == wide.data_ptr()


@pytest.fixture
def buffered_logits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the head products whose logits went into the buffer."""
    calls = [0]
    original = head_buffer.logits_buffer

    def counted(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        out = original(rows, cols, dtype)
        calls[0] += out is not None
        return out

    monkeypatch.setattr(head_buffer, "logits_buffer", counted)
    yield calls


@pytest.mark.parametrize("use_async_batching", [False, True])
def test_steps_with_logits_in_the_buffer_give_the_outputs_of_fresh_logits(
        monkeypatch: pytest.MonkeyPatch, buffered_logits: list[int], use_async_batching: bool) -> None:
    """Every head product of more than 3 rows goes into the buffer in chunks of 3 rows, and prompt logprobs are
    taken 3 rows at a time: seeded sampling with a repetition penalty, logprobs, top logprobs and prompt logprobs,
    and greedy requests, come out exactly as with fresh logits, synchronous and with async batching's forward
    thread."""
    model = tiny_model("llama", "cpu")
    prompts = random_prompts([5, 17, 3, 30, 9], seed=3)
    sampling = dict(do_sample=True, temperature=0.9, repetition_penalty=1.3, logprobs=True, top_logprobs=3,
                    prompt_logprobs=2)

    monkeypatch.setattr(packed_weights, "HEAD_CHUNK_MIN_ROWS", 1)

    def run(threshold: int) -> dict[str, GenerationOutput]:
        monkeypatch.setattr(head_buffer, "REUSED_OUTPUT_BYTES", threshold)
        with make_engine(model, use_async_batching=use_async_batching, block_size=4, num_blocks=200,
                         max_batch_tokens=16) as engine:
            for index, prompt in enumerate(prompts):
                engine.add_request(prompt, f"s{index}", max_new_tokens=9, seed=50 + index, **sampling)
                engine.add_request(prompt, f"g{index}", max_new_tokens=9)
            return run_engine(engine)

    fresh = run(1 << 62)
    assert buffered_logits[0] == 0
    reused = run(3 * VOCAB * 4)
    assert buffered_logits[0] > 10
    assert reused.keys() == fresh.keys()
    for request_id, output in fresh.items():
        other = reused[request_id]
        assert other.generated_tokens == output.generated_tokens, request_id
        assert other.logprobs == output.logprobs and other.top_logprobs == output.top_logprobs, request_id
        assert other.prompt_logprobs == output.prompt_logprobs, request_id
    for index, prompt in enumerate(prompts):
        assert reused[f"g{index}"].generated_tokens == reference_generate(model, prompt, 9)
