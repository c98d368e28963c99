"""bfloat16 models on CPU. Where the CPU has no bfloat16 arithmetic, every linear (the head too) runs through the
panel kernel in bfloat16 panels at every row count; where it has AVX512-BF16 without AMX, the layers through the
panel kernel's pair tiles and the head through oneDNN's bfloat16 product over a prepacked weight; with AMX, every
linear through oneDNN. Decode attention runs through the kernel on the bfloat16 cache either way. Greedy
tokens agree with `model.generate` in bfloat16 within a stated tolerance, since two float32-accumulating bfloat16
products that sum in different orders round differently."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from contbatch.engine import attention, cpu_kernels, packed_weights, triton_attention
from contbatch.engine.packed_weights import PLAN_ATTRIBUTE, packed_forward, packing_applies
from tests.helpers import fresh_tiny_model, make_engine, random_prompts, reference_generate, run_engine

pytestmark = pytest.mark.skipif(not (packed_weights.bf16_panels() or packed_weights.cpu_has_bf16()),
                                reason="needs the panel kernel, or a CPU with bfloat16 arithmetic")

LENGTHS = [1, 5, 17, 40, 64, 9]
MAX_NEW = [12, 9, 14, 6, 10, 16]
# The tolerance of a greedy choice: the chosen token's logit in a plain bfloat16 forward is within this many
# bfloat16 roundings (2^-8 relative) of the row's largest logit magnitude from that row's maximum.
ROUNDINGS = 4


def _bf16_model() -> nn.Module:
    """A CPU model: this file tests the CPU's bfloat16 products and kernels, whatever `CONTBATCH_TEST_DEVICE`."""
    return fresh_tiny_model("llama", "cpu").to(torch.bfloat16)


def test_bf16_linears_are_packed_by_the_cpu() -> None:
    """The layers in AMX blocks up to `AMX_MAX_ROWS` rows where `amx_panels()`, else in panels at every row count
    where `bf16_panels()` (in k pairs where `pair_panels()`), the head only where the CPU lacks bfloat16
    arithmetic; the rest in oneDNN's layout."""
    model = _bf16_model()
    assert packing_applies(model.get_output_embeddings())
    panels, amx = packed_weights.bf16_panels(), cpu_kernels.amx_panels()
    with packed_forward(model):
        plan = model.__dict__[PLAN_ATTRIBUTE]
        head_panels = panels and not packed_weights.cpu_has_bf16()
        assert plan.packed_head.panels == head_panels and plan.packed_head.max_rows == 0
        assert len(plan.swaps) == 7 * len(model.model.layers)
        max_rows = packed_weights.AMX_MAX_ROWS if amx else 0
        assert all(swap.panels == panels and swap.max_rows == max_rows for *_, swap in plan.swaps)
        copy = packed_weights._packed[plan.swaps[0][3].handle]
    if panels:
        width = (2 * cpu_kernels.AMX_BLOCK if amx else 2 * cpu_kernels.PANEL if cpu_kernels.pair_panels()
                 else cpu_kernels.PANEL)
        assert copy.shape[-1] == width


@pytest.mark.parametrize(("has_bf16", "pairs", "amx", "blocks", "layers", "head"), [
    (False, False, False, False, True, True),
    (True, True, False, False, True, False),
    (True, True, True, True, True, False),
    (True, True, True, False, False, False),
    (True, False, False, False, False, False),
])
def test_bf16_kinds_follow_the_cpu(has_bf16: bool, pairs: bool, amx: bool, blocks: bool, layers: bool, head: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Without bfloat16 arithmetic everything in (widened) panels; with AVX512-BF16 and the pair tiles built, the
    layers in pairs and the head through oneDNN; with AMX the layers in AMX blocks up to `AMX_MAX_ROWS` rows where
    the kernel has them (`amx_panels`), else through oneDNN like the head; without the pair tiles, everything
    through oneDNN. The plan is checked without packing, which for oneDNN's bfloat16 layout needs a CPU that has
    it."""
    if cpu_kernels.panel_gemm() is None:
        pytest.skip("needs the panel kernel")
    monkeypatch.setattr(packed_weights, "cpu_has_bf16", lambda: has_bf16)
    monkeypatch.setattr(packed_weights, "pair_panels", lambda: pairs)
    monkeypatch.setattr(packed_weights, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(packed_weights, "amx_panels", lambda: blocks)
    plan = packed_weights._Plan.of(_bf16_model(), packed_weights._setting())
    assert plan.packed_head is not None and len(plan.swaps) > 0
    assert {swap.panels for *_, swap in plan.swaps} == {layers}
    assert {swap.max_rows for *_, swap in plan.swaps} == {packed_weights.AMX_MAX_ROWS if blocks else 0}
    assert plan.packed_head.panels == head


def test_bf16_needs_panels_or_bf16_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    head = _bf16_model().get_output_embeddings()
    monkeypatch.setenv("CONTBATCH_PANEL_GEMM", "0")
    monkeypatch.setattr(packed_weights, "cpu_has_bf16", lambda: False)
    cpu_kernels.panel_gemm.cache_clear()
    try:
        assert not packing_applies(head)  # bfloat16 products would take oneDNN's slow generic path
        monkeypatch.setattr(packed_weights, "cpu_has_bf16", lambda: True)
        assert packing_applies(head)
    finally:
        monkeypatch.undo()
        cpu_kernels.panel_gemm.cache_clear()
    assert packing_applies(nn.Linear(4, 4))


def test_packed_forward_is_a_bf16_forward() -> None:
    """The same function as the model's own bfloat16 forward, up to bfloat16 rounding."""
    model = _bf16_model()
    ids = torch.tensor([random_prompts([50], seed=3)[0]])
    with torch.no_grad():
        own = model(ids).logits.double()
        with packed_forward(model):
            packed = model(ids).logits
    assert packed.dtype == torch.bfloat16
    scale = own.abs().max()
    torch.testing.assert_close(packed.double(), own, rtol=0, atol=float(scale) * ROUNDINGS * 2**-8)


def test_greedy_tokens_are_greedy_choices_of_a_bf16_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every token the engine chooses is, in a plain bfloat16 forward over the same sequence, within the tolerance
    of that position's maximum logit; nearly all are its argmax, and generate's tokens are a prefix of the
    engine's up to the first near-tie."""
    calls = []
    kernel = cpu_kernels.paged_decode_kernel()
    assert kernel is not None

    def counted(*args: object) -> torch.Tensor:
        calls.append(args[0].dtype)  # type: ignore[attr-defined]
        return kernel(*args)

    monkeypatch.setattr(attention, "paged_decode_kernel", lambda: counted)
    monkeypatch.delenv(triton_attention.KERNEL_ENV, raising=False)  # the C++ kernel's bfloat16 path, even then
    model = _bf16_model()
    prompts = random_prompts(LENGTHS, seed=7)
    with make_engine(model, block_size=4, num_blocks=200, max_batch_tokens=24) as engine:
        for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=max_new)
        finished = run_engine(engine)
    assert calls and set(calls) == {torch.bfloat16}
    exact = total = 0
    for index, (prompt, max_new) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        tokens = finished[f"r{index}"].generated_tokens
        assert len(tokens) == max_new
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
        best = logits.max(-1).values
        chosen = logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        tolerance = logits.abs().max(-1).values * ROUNDINGS * 2**-8
        assert (chosen >= best - tolerance).all(), f"r{index}: a token far from the greedy choice"
        exact += int((chosen == best).sum())
        total += len(tokens)
        expected = reference_generate(model, prompt, max_new)
        agree = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b), len(tokens))
        if agree < len(tokens):
            gap = (logits[agree, tokens[agree]] - logits[agree, expected[agree]]).abs()
            assert gap <= tolerance[agree], f"r{index}: departs from generate at token {agree} without a near-tie"
    assert exact >= 0.9 * total
