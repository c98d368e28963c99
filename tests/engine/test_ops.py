"""contbatch's operators: defined once in the `contbatch` namespace, computed by their kernel eagerly and inside a
compiled graph (through their fake kernel while tracing), without tracing into the kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from contbatch.engine.ops import define_op
from contbatch.engine.packed_weights import PackedLinear, packed_linear

calls: list[tuple[int, ...]] = []


def _scaled(x: torch.Tensor, factor: int) -> torch.Tensor:
    calls.append(tuple(x.shape))
    return x * factor


scaled = define_op("test_scaled", "(Tensor x, int factor) -> Tensor", _scaled, lambda x, factor: torch.empty_like(x))


def test_an_op_runs_its_kernel_eagerly_and_compiled() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(scaled(x, 3), x * 3)
    assert torch.ops.contbatch.test_scaled is scaled
    compiled = torch.compile(lambda t: scaled(t + 1, 2) - 1, fullgraph=True, backend="aot_eager")
    calls.clear()
    assert torch.equal(compiled(x), (x + 1) * 2 - 1)
    assert calls == [(2, 3)]


def test_the_ops_pass_torchs_op_checks() -> None:
    torch.library.opcheck(scaled, (torch.randn(4, 3), 2), test_utils=("test_schema", "test_faketensor"))
    linear = nn.Linear(24, 40)
    packed = PackedLinear.for_linear(linear, 0)
    packed.refresh()
    x = torch.randn(5, 24)
    with torch.no_grad():
        out = packed_linear(x, linear.weight, linear.bias, packed.handle, 0, False)
        torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias))
        torch.library.opcheck(packed_linear, (x, linear.weight.detach(), linear.bias.detach(), packed.handle, 0, False),
                              test_utils=("test_schema", "test_faketensor"))
