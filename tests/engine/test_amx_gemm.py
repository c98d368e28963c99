"""The bfloat16 product on AMX tiles (`csrc/amx_gemm.cpp`) behind `panel_linear` for weights in AMX blocks: each
output is the float32 sum of its products rounded to bfloat16 once, a row's result depends on neither the other
rows nor the thread count, and bfloat16 layers take it up to `AMX_MAX_ROWS` rows and `F.linear` above."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from contbatch.engine import cpu_kernels, fused_modules, packed_weights
from contbatch.engine.cpu_kernels import AMX_BLOCK, amx_panels, pack_amx_blocks, panel_gemm
from contbatch.engine.packed_weights import AMX_MAX_ROWS, PackedLinear

pytestmark = pytest.mark.skipif(not amx_panels(), reason="needs a CPU with AMX and the kernels built")


def _operands(rows: int, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16)
    return x, weight, bias


def test_blocks_hold_the_weight_in_k_pairs() -> None:
    weight = torch.arange(100 * 6, dtype=torch.float32).view(100, 6).to(torch.bfloat16)
    blocks = pack_amx_blocks(weight)
    assert blocks.shape == (2, 3, 2 * AMX_BLOCK) and blocks.is_contiguous()
    pairs = blocks.view(2, 3, AMX_BLOCK, 2)
    assert torch.equal(pairs[1, 2, 5], weight[AMX_BLOCK + 5, 4:6])
    assert torch.equal(pairs[1, :, 100 - AMX_BLOCK :], torch.zeros(3, 2 * AMX_BLOCK - 100, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 64, 2), (7, 100, 64), (33, 192, 576), (300, 576, 576), (40, 49, 1538),
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_is_the_float32_sum_rounded_once(rows: int, out_features: int, in_features: int,
                                                 with_bias: bool) -> None:
    x, weight, bias = _operands(rows, out_features, in_features, seed=rows + out_features)
    bias_or_none = bias if with_bias else None
    out = panel_gemm()(x, pack_amx_blocks(weight), out_features, bias_or_none)  # type: ignore[misc]
    exact = F.linear(x.double(), weight.double(), None if bias_or_none is None else bias_or_none.double())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # the float32 sum's error (k products of bfloat16 operands) plus the final rounding to bfloat16
    tolerance = exact.abs() * 2**-8 + in_features * 2**-20 * (x.double().abs() @ weight.double().abs().T)
    assert ((out.double() - exact).abs() <= tolerance).all()


def test_rows_do_not_depend_on_the_batch_or_the_threads() -> None:
    x, weight, bias = _operands(600, 576, 576, seed=5)
    blocks = pack_amx_blocks(weight)
    gemm = panel_gemm()
    assert gemm is not None
    whole = gemm(x, blocks, 576, bias)
    for start, count in ((0, 1), (5, 1), (17, 3), (100, 40), (255, 2), (513, 33)):
        assert torch.equal(gemm(x[start : start + count].contiguous(), blocks, 576, bias), whole[start : start + count])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = gemm(x, blocks, 576, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, whole)


def test_bad_operands_name_the_problem() -> None:
    with pytest.raises(ValueError, match="even number of input features, got 5"):
        pack_amx_blocks(torch.zeros(8, 5, dtype=torch.bfloat16))
    x, weight, _ = _operands(4, 70, 8, seed=1)
    gemm = panel_gemm()
    assert gemm is not None
    with pytest.raises(RuntimeError, match="N does not match the blocks"):
        gemm(x, pack_amx_blocks(weight), 200, None)
    with pytest.raises(RuntimeError, match="with the \\(even\\) K of x"):
        gemm(x[:, :6].contiguous(), pack_amx_blocks(weight), 70, None)


def test_layers_take_the_blocks_up_to_their_row_limit() -> None:
    """A bfloat16 layer's product: AMX blocks up to `AMX_MAX_ROWS` rows, `F.linear` over the plain weight above."""
    linear = nn.Linear(576, 192).to(torch.bfloat16)
    packed = PackedLinear.for_linear(linear, *packed_weights._layer_kind(linear))
    packed.refresh()
    assert packed.max_rows == AMX_MAX_ROWS
    assert packed_weights._packed[packed.handle].shape == (3, 288, 2 * AMX_BLOCK)
    x = torch.randn(AMX_MAX_ROWS + 1, 576).to(torch.bfloat16)
    gemm = panel_gemm()
    assert gemm is not None
    with torch.no_grad():
        blocks = gemm(x[:AMX_MAX_ROWS].contiguous(), packed_weights._packed[packed.handle], 192, linear.bias)
        assert torch.equal(packed(x[:AMX_MAX_ROWS]), blocks)
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))


def test_gated_product_is_the_two_products_then_silu_mul() -> None:
    """`amx_silu_mul` is bit for bit `silu_mul` over the two products as each layer computes them alone."""
    x, gate, _ = _operands(300, 192, 576, seed=11)
    _, up, _ = _operands(1, 192, 576, seed=12)
    gemm, module = panel_gemm(), cpu_kernels.kernel_module()
    assert gemm is not None and module is not None
    gates, ups = pack_amx_blocks(gate), pack_amx_blocks(up)
    unfused = module.silu_mul(gemm(x, gates, 192, None), gemm(x, ups, 192, None))
    assert torch.equal(module.amx_silu_mul(x, gates, ups, 192), unfused)
    with pytest.raises(RuntimeError, match="N must be a multiple of 16, got 184"):
        module.amx_silu_mul(x, gates, ups, 184)


def test_mlp_gates_in_one_pass_only_where_both_products_take_the_blocks() -> None:
    gate, up = nn.Linear(576, 192, bias=False), nn.Linear(576, 192, bias=False)
    packed = [PackedLinear.for_linear(linear.to(torch.bfloat16), *packed_weights._layer_kind(linear))
              for linear in (gate, up)]
    for layer in packed:
        layer.refresh()
    x = torch.randn(2, 5, 576).to(torch.bfloat16)
    with torch.no_grad():
        gated = fused_modules._amx_gated(*packed, x)
        assert gated is not None and gated.shape == (2, 5, 192)
        gates, ups = (layer(x).view(10, 192) for layer in packed)
        assert torch.equal(gated.view(10, 192), cpu_kernels.kernel_module().silu_mul(gates, ups))
        assert fused_modules._amx_gated(packed[0], up, x) is None
        assert fused_modules._amx_gated(*packed, torch.randn(AMX_MAX_ROWS + 1, 576).to(torch.bfloat16)) is None
    assert fused_modules._amx_gated(*packed, x) is None  # grad on: the products' own path


def test_blocks_follow_a_weight_updated_in_place() -> None:
    """An optimizer step changes the weight in place: the next forward's refresh packs the blocks again, so the
    product never serves the old weight (what a GRPO trainer's generation between steps relies on)."""
    linear = nn.Linear(64, 128, bias=False).to(torch.bfloat16)
    packed = PackedLinear.for_linear(linear, *packed_weights._layer_kind(linear))
    x = torch.randn(4, 64).to(torch.bfloat16)
    gemm = panel_gemm()
    assert gemm is not None
    with torch.no_grad():
        packed.refresh()
        before = packed(x)
        linear.weight.mul_(-2)
        packed.refresh()
        after = packed(x)
    assert torch.equal(after, gemm(x, pack_amx_blocks(linear.weight.detach()), 128, None))
    assert not torch.equal(after, before)


def test_attention_tiles_leave_the_next_product_its_own_configuration() -> None:
    """The attention kernel's AMX tiles (scores of a bfloat16 cache) configure the threads' tiles their own way;
    a product on AMX blocks afterwards, on the same threads, computes what it computed before."""
    x, weight, bias = _operands(40, 192, 576, seed=9)
    blocks = pack_amx_blocks(weight)
    gemm, attend = panel_gemm(), cpu_kernels.paged_decode_kernel()
    assert gemm is not None and attend is not None
    before = gemm(x, blocks, 192, bias)
    keys, values = torch.randn(2, 256, 64).to(torch.bfloat16), torch.randn(2, 256, 64).to(torch.bfloat16)
    slots = torch.arange(256).view(4, 64)
    lengths, first = torch.full((4,), 64), torch.zeros(4, dtype=torch.long)
    out = attend(torch.randn(4, 6, 64).to(torch.bfloat16), keys, values, slots, lengths, first, 0.125, 0.0, 1)
    assert out.isfinite().all()
    assert torch.equal(gemm(x, blocks, 192, bias), before)
