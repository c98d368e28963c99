"""`contbatch_native::layer_product` (`contbatch.engine.layer_op`): the C++ operator a compiled forward calls for a
layer's product computes what `packed_product` does, bitwise, from the packed copy registered under the layer's
handle, follows weight updates, forgets a collected layer, and is what compiled graphs call."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from contbatch.engine import layer_op
from contbatch.engine.cpu_features import cpu_has_bf16
from contbatch.engine.cpu_kernels import panel_gemm
from contbatch.engine.packed_weights import PackedLinear, packed_product
from tests.helpers import fresh_tiny_model, make_engine, random_prompts, reference_generate, run_engine

pytestmark = pytest.mark.skipif(layer_op.native_layer_op() is None, reason="the CPU kernels are not built")


def _layer(dtype: torch.dtype, bias: bool, max_rows: int, panels: bool) -> tuple[nn.Linear, PackedLinear]:
    torch.manual_seed(0)
    linear = nn.Linear(72, 40, bias=bias).to(dtype)
    packed = PackedLinear.for_linear(linear, max_rows, panels)
    packed.refresh()
    return linear, packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("panels", [True, False], ids=["panels", "onednn"])
def test_the_operator_computes_the_python_product(dtype: torch.dtype, bias: bool, panels: bool) -> None:
    """Up to `max_rows` rows from the registered copy (panels or oneDNN's layout), above it from the plain weight:
    bitwise `packed_product`'s result, with leading dimensions kept. oneDNN reorders a bfloat16 weight only where
    the CPU has bfloat16 arithmetic; elsewhere contbatch packs bfloat16 layers in panels or not at all."""
    if dtype == torch.bfloat16 and not (panels and panel_gemm() is not None) and not cpu_has_bf16():
        pytest.skip("oneDNN's bfloat16 layout needs bfloat16 arithmetic, which this CPU lacks")
    linear, packed = _layer(dtype, bias, 16, panels)
    op = layer_op.native_layer_op()
    for shape in [(1, 72), (5, 72), (1, 16, 72), (2, 9, 72)]:
        x = torch.randn(shape, dtype=dtype)
        with torch.no_grad():
            expected = packed_product(x, linear.weight, linear.bias, packed.handle, 16, packed.panels)
            assert torch.equal(op(x, linear.weight, linear.bias, packed.handle, 16), expected), shape


def test_a_weight_update_reaches_the_operator_and_a_collected_layer_is_forgotten(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Also with the operator turned off after a graph was compiled with it: that graph still gets the new weight,
    while the layer's later compiles take the Python op."""
    linear, packed = _layer(torch.float32, False, 0, True)
    op, x = layer_op.native_layer_op(), torch.randn(3, 72)
    assert packed._native is op
    monkeypatch.setenv(layer_op.ENV, "0")
    with torch.no_grad():
        linear.weight.mul_(2)
    packed.refresh()
    assert packed._native is None
    with torch.no_grad():
        torch.testing.assert_close(op(x, linear.weight, None, packed.handle, 0), x @ linear.weight.T)
    handle, weight = packed.handle, linear.weight.detach().clone()
    del packed, linear
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no packed weight registered under handle {handle}"):
        op(x, weight, None, handle, 0)


def test_the_fake_kernel_and_schema_pass_torchs_op_checks() -> None:
    linear, packed = _layer(torch.float32, True, 0, True)
    with torch.no_grad():
        torch.library.opcheck(layer_op.native_layer_op(), (torch.randn(5, 72), linear.weight.detach(),
                                                           linear.bias.detach(), packed.handle, 0),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("native", ["1", "0"])
def test_compiled_steps_call_the_operator_and_match_generate(native: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled, the layers' products are the C++ operator (the head's the Python op); with
    `CONTBATCH_NATIVE_LAYER_OP=0` the Python op; greedy outputs equal `generate`'s either way."""
    monkeypatch.setenv(layer_op.ENV, native)
    torch._dynamo.reset()
    model = fresh_tiny_model("llama")
    prompts = random_prompts([3, 17, 9], seed=4)
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=16, use_default_compile_configs=True) \
            as engine:
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=6)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            finished = run_engine(engine)
    called = {event.key for event in profile.key_averages()}
    assert ("contbatch_native::layer_product" in called) == (native == "1")
    assert "contbatch::packed_linear" in called
    for index, prompt in enumerate(prompts):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, 6)
