"""The reused per-thread buffer of the output head's products: reuse within a thread, a buffer per thread, logits in
it only inside `reusing_logits`, and engine steps whose logits go there giving exactly the outputs of steps whose
logits are fresh tensors."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from contbatch.engine import head_buffer, head_product, packed_weights, prompt_logprobs
from contbatch.outputs import GenerationOutput
from tests.helpers import VOCAB, make_engine, random_prompts, reference_generate, run_engine, tiny_model


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
    elsewhere = head_buffer.buffer(8, 50, slot="log_softmax")
    assert elsewhere is not None and elsewhere.data_ptr() != larger.data_ptr()
    assert head_buffer.buffer(8, 50).data_ptr() == larger.data_ptr()  # type: ignore[union-attr]


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
    """Counts the head products whose logits went into the buffer, and the log_softmax blocks that went into theirs."""
    calls = [0, 0]
    original, original_buffer = head_buffer.logits_buffer, head_buffer.buffer

    def counted(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        out = original(rows, cols, dtype)
        calls[0] += out is not None
        return out

    def counted_blocks(rows: int, cols: int, dtype: torch.dtype = torch.float32,
                       slot: str = "head") -> torch.Tensor | None:
        out = original_buffer(rows, cols, dtype, slot)
        calls[1] += slot == "log_softmax" and out is not None
        return out

    monkeypatch.setattr(head_buffer, "logits_buffer", counted)
    monkeypatch.setattr(head_buffer, "buffer", counted_blocks)
    yield calls


@pytest.mark.parametrize(("use_async_batching", "slice_columns"), [(False, 0), (True, 0), (False, 100), (True, 64)])
def test_steps_with_logits_in_the_buffer_give_the_outputs_of_fresh_logits(
        monkeypatch: pytest.MonkeyPatch, buffered_logits: list[int], use_async_batching: bool,
        slice_columns: int) -> None:
    """Every head product of more than 2 rows goes into the buffer, in chunks of 2 rows over the whole head or (with
    `slice_columns`) in column slices, and prompt logprobs' log_softmax blocks (3 rows) into theirs:
    seeded sampling with a repetition penalty, logprobs, top logprobs and prompt logprobs, and greedy requests,
    come out exactly as with fresh logits, synchronous and with async batching's forward thread."""
    model = tiny_model("llama", "cpu")
    prompts = random_prompts([5, 17, 3, 30, 9], seed=3)
    sampling = dict(do_sample=True, temperature=0.9, repetition_penalty=1.3, logprobs=True, top_logprobs=3,
                    prompt_logprobs=2)
    monkeypatch.setattr(head_product, "HEAD_CHUNK_MIN_ROWS", 128 if slice_columns else 1)
    monkeypatch.setattr(head_product, "SLICE_COLUMNS", slice_columns or 1 << 30)
    monkeypatch.setattr(prompt_logprobs, "LOG_SOFTMAX_BYTES", 3 * VOCAB * 4)

    def run(threshold: int) -> tuple[dict[str, GenerationOutput], object]:
        monkeypatch.setattr(head_buffer, "REUSED_OUTPUT_BYTES", threshold)
        with make_engine(model, use_async_batching=use_async_batching, block_size=4, num_blocks=200,
                         max_batch_tokens=16) as engine:
            for index, prompt in enumerate(prompts):
                engine.add_request(prompt, f"s{index}", max_new_tokens=9, seed=50 + index, **sampling)
                engine.add_request(prompt, f"g{index}", max_new_tokens=9)
            outputs = run_engine(engine)
        head = model.__dict__[packed_weights.PLAN_ATTRIBUTE].packed_head
        return outputs, packed_weights._packed[head.handle]

    fresh, fresh_head = run(1 << 62)
    assert buffered_logits == [0, 0]
    assert isinstance(fresh_head, torch.Tensor)
    reused, head = run(2 * VOCAB * 4 + 1)
    assert buffered_logits[0] > 10 and buffered_logits[1] > 3
    assert isinstance(head, head_product.SlicedHead) == bool(slice_columns)
    if isinstance(head, head_product.SlicedHead):
        assert head.width * (len(head.packed) - 1) < VOCAB <= head.width * len(head.packed) and len(head.packed) > 2
    assert reused.keys() == fresh.keys()
    for request_id, output in fresh.items():
        other = reused[request_id]
        assert other.generated_tokens == output.generated_tokens, request_id
        assert other.logprobs == output.logprobs and other.top_logprobs == output.top_logprobs, request_id
        assert other.prompt_logprobs == output.prompt_logprobs, request_id
    for index, prompt in enumerate(prompts):
        assert reused[f"g{index}"].generated_tokens == reference_generate(model, prompt, 9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_sliced_head_computes_the_whole_heads_product(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                        with_bias: bool) -> None:
    """A head packed in column slices (the last one narrower) gives exactly oneDNN's product over the whole packed
    weight, in row chunks that keep each slice's output below the threshold, into the thread's buffer inside
    `reusing_logits` and into a fresh tensor outside it."""
    if dtype == torch.bfloat16 and not packed_weights.cpu_has_bf16():
        pytest.skip("oneDNN has no bfloat16 product on this CPU")
    monkeypatch.setattr(head_product, "SLICE_COLUMNS", 96)
    monkeypatch.setattr(head_buffer, "REUSED_OUTPUT_BYTES", 5 * 96 * dtype.itemsize)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 72, generator=generator).to(dtype)
    bias = torch.randn(1000, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(23, 72, generator=generator).to(dtype)
    assert head_product.slices_head(1000, dtype)
    sliced = head_product.pack_slices(weight)
    assert sliced.width == 91 and len(sliced.packed) == 11
    whole = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(weight, None), bias,
                                               "none", [], "")
    fresh = head_product.sliced_product(x, sliced, bias, 1000)
    assert torch.equal(fresh, whole)
    with head_buffer.reusing_logits():
        reused = head_product.sliced_product(x, sliced, bias, 1000)
        buffer = head_buffer.buffer(23, 1000, dtype)
    assert buffer is not None and reused.data_ptr() == buffer.data_ptr() != fresh.data_ptr()
    assert torch.equal(reused, whole)
