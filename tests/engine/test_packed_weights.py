"""The prepacked linear layers (panel kernel, or oneDNN): same function as the model's own modules, never stale,
never visible outside contbatch's forwards, traceable by torch.compile, and within their memory bound."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig
from contbatch.api import generate_batch
from contbatch.engine import cpu_features, cpu_kernels, mkl_products, packed_weights
from contbatch.engine.attention import METADATA_KWARG
from contbatch.engine.attention_types import KVShapeProbe
from contbatch.engine.packed_weights import (
    PLAN_ATTRIBUTE,
    PackedLinear,
    packed_forward,
    packing_applies,
    pending_packed_bytes,
    weights_changed,
)
from tests.helpers import fresh_tiny_model, random_prompts, reference_generate

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
KINDS = ["panels", "onednn"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test with this fixture runs with the panel kernel (skipped where it is not built) and with oneDNN."""
    if request.param == "onednn":
        monkeypatch.setenv("CONTBATCH_PANEL_GEMM", "0")
    cpu_kernels.panel_gemm.cache_clear()
    if request.param == "panels" and cpu_kernels.panel_gemm() is None:
        pytest.skip("the panel kernel is not built here")
    yield request.param
    monkeypatch.undo()
    cpu_kernels.panel_gemm.cache_clear()


def _linear(bias: bool = False, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(32, 300, bias=bias, dtype=dtype)


def test_which_linears_are_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert packing_applies(_linear())
    # bfloat16 through the panel kernel where the CPU lacks bfloat16 arithmetic, else oneDNN's where it has it
    # (tests/engine/test_bfloat16.py)
    assert packing_applies(_linear(dtype=torch.bfloat16)) == (packed_weights.bf16_panels()
                                                              or packed_weights.cpu_has_bf16())
    assert not packing_applies(_linear(dtype=torch.float16))
    assert not packing_applies(type("MyLinear", (nn.Linear,), {})(4, 4))
    assert not packing_applies(None)
    with torch.inference_mode():
        assert not packing_applies(nn.Linear(4, 4))  # an inference tensor has no version counter
    monkeypatch.setenv("CONTBATCH_PACK_WEIGHTS", "0")
    assert not packing_applies(_linear())


@pytest.mark.parametrize("mkl_fast", [False, True])
def test_rows_above_the_limit_take_the_plain_weight(mkl_fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over `max_rows` a float32 product is over the weight as it is (no packed copy read), bit for bit: MKL's
    `F.linear` where it is fast (`mkl_is_fast`), else oneDNN's; a weight that is not contiguous, or a bfloat16 one,
    takes `F.linear`."""
    monkeypatch.setattr(mkl_products, "mkl_is_fast", lambda: mkl_fast)
    linear = _linear(True)
    packed = PackedLinear.for_linear(linear, max_rows=4, panels=True)
    packed.refresh()
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        expected = (torch.nn.functional.linear(x, linear.weight, linear.bias) if mkl_fast else
                    torch.ops.mkldnn._linear_pointwise(x, linear.weight, linear.bias, "none", [], ""))
        assert torch.equal(packed(x), expected)
        strided = nn.Parameter(torch.randn(32, 16).t())
        assert torch.equal(mkl_products.plain_product(x, strided, None), torch.nn.functional.linear(x, strided))
        halves = x.bfloat16(), linear.weight.bfloat16()
        assert torch.equal(mkl_products.plain_product(*halves, None), torch.nn.functional.linear(*halves))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(5, 32), (1, 7, 32), (1, 0, 32), (1, 9, 32)])
def test_same_function_as_the_linear(kind: str, bias: bool, shape: tuple[int, ...]) -> None:
    linear = _linear(bias)
    head = PackedLinear.for_linear(linear, max_rows=8, panels=True)  # (1, 9, 32): over 8 rows, the plain weight
    head.refresh()
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(head(x), linear(x), rtol=1e-5, atol=1e-5)
    assert PackedLinear.for_linear(linear, max_rows=8, panels=True) is head
    assert PackedLinear.for_linear(linear, max_rows=8) is not head
    # another dtype (autocast, say) takes F.linear's own rules, here its error
    with torch.no_grad(), pytest.raises(RuntimeError, match="dtype"):
            head(x.to(torch.float64))


def test_repacks_after_every_kind_of_weight_change(kind: str) -> None:
    linear = _linear()
    head = PackedLinear.for_linear(linear, panels=True)
    x = torch.randn(3, 32)

    def check() -> None:
        head.refresh()
        with torch.no_grad():
            torch.testing.assert_close(head(x), x @ linear.weight.T, rtol=1e-5, atol=1e-5)

    check()
    with torch.no_grad():
        linear.weight.mul_(2.0)  # in place: the version counter moves
    check()
    linear.weight.data += 1.0  # through .data: only `weights_changed` tells
    model = nn.Sequential(linear)
    weights_changed(model)
    check()
    linear.weight = nn.Parameter(torch.randn(300, 32))  # a new parameter: a new PackedLinear stands for it
    assert not head.stands_for(linear)
    head = PackedLinear.for_linear(linear, panels=True)
    check()
    other = "0" if kind == "panels" else "1"  # the other kind of packing: packed again in its layout
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTBATCH_PANEL_GEMM", other)
        cpu_kernels.panel_gemm.cache_clear()
        check()
    cpu_kernels.panel_gemm.cache_clear()
    check()


def test_grad_forward_is_f_linear() -> None:
    linear = _linear(bias=True)
    head = PackedLinear.for_linear(linear)
    x = torch.randn(4, 32, requires_grad=True)
    head(x).square().sum().backward()
    expected = torch.autograd.grad(linear(x).square().sum(), [x, linear.weight])
    x_grad, weight_grad = x.grad, linear.weight.grad
    assert x_grad is not None and weight_grad is not None
    torch.testing.assert_close(x_grad, expected[0])
    torch.testing.assert_close(weight_grad, expected[1])


def test_compiles_without_graph_break(kind: str) -> None:
    linear = _linear(bias=True)
    head = PackedLinear.for_linear(linear, max_rows=4, panels=True)
    head.refresh()
    x = torch.randn(6, 32)
    compiled = torch.compile(head, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), linear(x), rtol=1e-5, atol=1e-5)


def test_only_contbatch_forwards_see_them(kind: str) -> None:
    model = fresh_tiny_model("llama")
    own, own_q = model.get_output_embeddings(), model.model.layers[0].self_attn.q_proj
    seen: list[tuple[nn.Module, nn.Module]] = []
    probed: list[tuple[nn.Module, nn.Module]] = []  # the cache's probe: a forward of the model as it is
    probing: list[bool] = []

    def note(_: nn.Module, __: tuple[object, ...], kwargs: dict[str, object]) -> None:
        probing[:] = [isinstance(kwargs.get(METADATA_KWARG), KVShapeProbe)]

    def record(*_: object) -> None:
        (probed if probing[0] else seen).append((model.get_output_embeddings(), model.model.layers[0].self_attn.q_proj))

    model.register_forward_pre_hook(note, with_kwargs=True)
    model.model.norm.register_forward_hook(record)
    prompts = random_prompts([9, 17, 4], seed=3)
    config = GenerationConfig(do_sample=False, max_new_tokens=5, eos_token_id=None)
    outputs = generate_batch(model, prompts, config, ContinuousBatchingConfig(block_size=8), progress_bar=False)
    wide = packed_weights.wide_panels()
    layer_kind = ((packed_weights.LAYER_MAX_ROWS if wide and packed_weights.mkl_is_fast() else 0, wide)
                  if packed_weights.cpu_has_avx512() else (packed_weights.LAYER_MAX_ROWS, True))
    assert seen and all(isinstance(head, PackedLinear) and head.weight is own.weight and head.max_rows == 0
                        and not head.panels and isinstance(q, PackedLinear) and q.weight is own_q.weight
                        and (q.max_rows, q.panels) == layer_kind for head, q in seen)
    assert probed == [(own, own_q)]
    assert model.get_output_embeddings() is own and model.model.layers[0].self_attn.q_proj is own_q
    assert not any(isinstance(module, PackedLinear) for module in model.modules())
    for index, prompt in enumerate(prompts):
        assert outputs[f"req_{index}"].generated_tokens == reference_generate(model, prompt, 5)


@pytest.mark.parametrize("intel", [False, True])
@pytest.mark.parametrize(("avx512", "wide"), [(False, False), (False, True), (True, False), (True, True)])
def test_float32_layer_kinds_follow_the_isa(avx512: bool, wide: bool, intel: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ATen runs AVX-512, the layers take the panel kernel's AVX-512 tiles (`wide_panels`), at every row count
    where MKL trails oneDNN (AMD), up to `LAYER_MAX_ROWS` rows where MKL is fast (Intel: `mkl_is_fast`), or
    oneDNN's product where the kernel lacks them. Without AVX-512, the panel kernel up to `LAYER_MAX_ROWS` rows.
    The head takes oneDNN either way."""
    monkeypatch.setattr(packed_weights, "cpu_has_avx512", lambda: avx512)
    monkeypatch.setattr(packed_weights, "wide_panels", lambda: wide)
    monkeypatch.setattr(packed_weights, "mkl_is_fast", lambda: intel)
    model = fresh_tiny_model("llama")
    with packed_forward(model):
        plan = model.__dict__[PLAN_ATTRIBUTE]
        kinds = {(swap.max_rows, swap.panels) for *_, swap in plan.swaps}
        assert plan.packed_head is not None and (plan.packed_head.max_rows, plan.packed_head.panels) == (0, False)
    max_rows = packed_weights.LAYER_MAX_ROWS if wide and intel else 0
    assert kinds == ({(max_rows, wide)} if avx512 else {(packed_weights.LAYER_MAX_ROWS, True)})
    assert len(plan.swaps) == 7 * len(model.model.layers)


def test_large_float32_weights_take_onednn_where_avx512_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AVX-512 and the panels' AVX-512 tiles, a float32 weight of `PANEL_MAX_WEIGHT` elements or more goes
    through oneDNN (here the MLP's 128 x 64), a smaller one in panels (the attention's), and outputs stay
    `generate`'s."""
    monkeypatch.setattr(packed_weights, "cpu_has_avx512", lambda: True)
    monkeypatch.setattr(packed_weights, "wide_panels", lambda: True)
    monkeypatch.setattr(packed_weights, "PANEL_MAX_WEIGHT", 128 * 64)
    monkeypatch.setattr(packed_weights, "mkl_is_fast", lambda: False)
    model = fresh_tiny_model("llama")
    with packed_forward(model):
        plan = model.__dict__[PLAN_ATTRIBUTE]
        kinds = {name: swap.panels for _, name, _, swap in plan.swaps}
    assert kinds == {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": True, "gate_proj": False,
                     "up_proj": False, "down_proj": False}
    prompts = random_prompts([9, 17, 4], seed=5)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None)
    outputs = generate_batch(model, prompts, config, ContinuousBatchingConfig(block_size=8), progress_bar=False)
    for index, prompt in enumerate(prompts):
        assert outputs[f"req_{index}"].generated_tokens == reference_generate(model, prompt, 6)


def test_modules_given_back_when_the_forward_fails() -> None:
    model = fresh_tiny_model("llama")
    own = dict(model.named_modules())
    with pytest.raises(RuntimeError, match="boom"), packed_forward(model):
        assert isinstance(model.get_output_embeddings(), PackedLinear)
        assert isinstance(model.model.layers[1].mlp.down_proj, PackedLinear)
        raise RuntimeError("boom")
    assert dict(model.named_modules()) == own


def test_layers_packed_only_within_their_memory_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mkl_products.ENV, "0")  # MKL's copies: tests/engine/test_mkl_products.py
    model = fresh_tiny_model("llama")
    head = model.get_output_embeddings().weight.nbytes
    layers = sum(m.weight.nbytes for m in model.modules() if type(m) is nn.Linear) - head
    assert pending_packed_bytes(fresh_tiny_model("llama")) == head + layers
    monkeypatch.setattr(packed_weights, "LAYER_MEMORY_SHARE", 0.0)  # the layers' copies never fit
    assert pending_packed_bytes(model) == head
    with packed_forward(model):
        assert isinstance(model.get_output_embeddings(), PackedLinear)
        assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    assert pending_packed_bytes(model) == 0  # made: no longer pending
    monkeypatch.setenv("CONTBATCH_PACK_WEIGHTS", "head")
    monkeypatch.setattr(packed_weights, "LAYER_MEMORY_SHARE", 1.0)
    assert pending_packed_bytes(model) == 0
    monkeypatch.setenv("CONTBATCH_PACK_WEIGHTS", "0")
    assert pending_packed_bytes(fresh_tiny_model("llama")) == 0


def test_a_replaced_new_or_converted_module_is_seen_at_the_next_forward() -> None:
    model = fresh_tiny_model("llama")
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    with packed_forward(model):
        pass
    attention.q_proj = replacement = nn.Linear(attention.q_proj.in_features, attention.q_proj.out_features)
    mlp.up_proj.weight = new_weight = nn.Parameter(torch.randn_like(mlp.up_proj.weight))
    with packed_forward(model):
        q, up = attention.q_proj, mlp.up_proj
        assert isinstance(q, PackedLinear) and isinstance(up, PackedLinear)
        assert q.stands_for(replacement) and up.weight is new_weight
    assert attention.q_proj is replacement and type(mlp.up_proj) is nn.Linear
    model.to(torch.float64)
    with packed_forward(model):
        assert not any(isinstance(module, PackedLinear) for module in model.modules())


def test_the_swap_plan_does_not_keep_the_model_alive() -> None:
    model = nn.Sequential(_linear(), nn.ReLU(), nn.Linear(300, 8))  # the model is the linears' parent
    with packed_forward(model):
        assert isinstance(model[0], PackedLinear)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_cpu_vendor_reads_the_vendor_line(tmp_path: Path) -> None:
    """`cpu_vendor` names x86's `vendor_id` (what `mkl_is_fast` asks), and nothing where the file has no such line
    or is missing."""
    intel, arm = tmp_path / "intel", tmp_path / "arm"
    intel.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2\n")
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert cpu_features.cpu_vendor(str(intel)) == "GenuineIntel"
    assert cpu_features.cpu_vendor(str(arm)) == ""
    assert cpu_features.cpu_vendor(str(tmp_path / "missing")) == ""
