"""`contbatch_native::layer_product` (csrc/layer_op.cpp): a packed layer's product as an operator implemented in
C++, which a compiled forward calls without entering Python.

A compiled decode step calls a layer product 210 times on the embedded model. Through the Python op
`contbatch::packed_linear` each call runs `packed_product`'s Python (the packed copy's lookup, the row count, the
reshapes) around the kernel, about 10 us; this operator looks the layer's packed copy up by handle in C++ and
computes the same product with the same kernels, so the results are bitwise the same. On a 2-core Zen 4, compiled
decode steps of one row took 24.7 against 26.4 ms, of 32 rows 59.9 against 62.8 ms (the least of five timings in
each of six alternated processes, averaged; docs/performance.md, "a fifty-fifth session"). The output head keeps the
Python op (its head screen is Python).

`CONTBATCH_NATIVE_LAYER_OP=0` keeps the Python op in graphs compiled after (read when a layer's weight is
packed).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from contbatch.engine.cpu_kernels import kernel_module

ENV = "CONTBATCH_NATIVE_LAYER_OP"


@functools.cache
def _operator() -> Any:
    module = kernel_module()
    if module is None or not hasattr(module, "register_packed"):
        return None
    torch.library.register_fake("contbatch_native::layer_product")(_fake)
    return torch.ops.contbatch_native.layer_product.default


def native_layer_op() -> Any:
    """The operator, `(x, weight, bias, handle, max_rows) -> x @ weight.T + bias`, where the kernels are built and
    `CONTBATCH_NATIVE_LAYER_OP` is not "0"; else None."""
    return _operator() if os.environ.get(ENV, "1") != "0" else None


def register(handle: int, packed: torch.Tensor) -> Any:
    """Makes `packed` (panels or oneDNN's layout) the weight the operator uses for `handle`, wherever the operator
    is built (a graph compiled while it was on keeps calling it); returns `native_layer_op()`, the operator the
    layer's next compiled forwards call, or None."""
    if _operator() is not None:
        kernel_module().register_packed(handle, packed)
    return native_layer_op()


def forget(handle: int) -> None:
    """Drops what `handle` registered (nothing where the kernels were never loaded)."""
    if _operator.cache_info().currsize and _operator() is not None:
        kernel_module().forget_packed(handle)


def _fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int,
          max_rows: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
