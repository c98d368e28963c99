"""A float32 layer's product past the rows its packed copy serves (prompt steps): over MKL's own packed copy of the
weight for the rows of a full step, where MKL is fast.

Past `packed_weights.LAYER_MAX_ROWS` rows a layer's product is over its plain weight (`plain_product`): on Intel
(`mkl_is_fast`) MKL's `F.linear`, which packs the weight into MKL's layout on every call (`sgemm_scopy_right*`,
about 9% of the samples of a pass over 3-shot prompts). MKL can pack a weight once for products of one row count
(`torch.ops.mkl._mkl_reorder_linear_weight`, `cblas_sgemm_pack`) and compute such products over the copy
(`torch.ops.mkl._mkl_linear`, which takes the plain product for any other row count). The engine's prompt steps
are mostly full ones, of exactly its token budget of rows, so each layer aimed at a row count (`aim`) packs a copy
for it at its first product of that many rows after its weight last changed, and its products of that many rows go
through it. On the Xeon with AMX of docs/performance.md ("a sixty-fourth session") the seven products of 30 layers at
512 rows ran 320-330 GFLOP/s through the copies against 290-300 through `F.linear`, with the same bits.

The copy's resident pages are about the weight's bytes (MKL's allocation is larger, but its pages past the packed
data are never touched). `CONTBATCH_MKL_PACKED=0` keeps `F.linear`.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from contbatch.engine.cpu_features import mkl_is_fast

ENV = "CONTBATCH_MKL_PACKED"
_targets: dict[int, int] = {}
_packs: dict[int, tuple[int, torch.Tensor]] = {}


def applies(weight: torch.Tensor) -> bool:
    """Whether products of `weight` past its layer's packed rows may run over an MKL copy: a contiguous float32 CPU
    weight where MKL is built and fast (`mkl_is_fast`), unless `CONTBATCH_MKL_PACKED=0`."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and os.environ.get(ENV, "1") != "0" and torch.backends.mkl.is_available() and mkl_is_fast())


def aim(handle: int, rows: int) -> None:
    """Makes `rows` (0: none) the row count whose products the layer under `handle` runs over an MKL copy; a copy
    packed for another count is dropped."""
    if _targets.get(handle, 0) == rows:
        return
    _targets[handle] = rows
    packed = _packs.get(handle)
    if packed is not None and packed[0] != rows:
        del _packs[handle]


def packed(handle: int) -> bool:
    """Whether `handle` holds an MKL copy."""
    return handle in _packs


def weight_changed(handle: int) -> None:
    """Drops `handle`'s copy (its weight changed); the next product of its target rows packs it again."""
    _packs.pop(handle, None)


def forget(handle: int) -> None:
    """Drops everything `handle` holds."""
    _packs.pop(handle, None)
    _targets.pop(handle, None)


def large_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` past the layer's packed rows: over the MKL copy when `x` has the rows `handle` is
    aimed at (packed now if it is not yet), else `plain_product`."""
    rows = math.prod(x.shape[:-1])
    if rows == 0 or rows != _targets.get(handle, 0) or weight.dtype != torch.float32:
        return plain_product(x, weight, bias)
    copy = _packs.get(handle)
    if copy is None or copy[0] != rows:
        copy = _packs[handle] = (rows, torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows))
    return torch.ops.mkl._mkl_linear(x, copy[1], weight, bias, rows)


def plain_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A layer's product over its plain weight: `F.linear` where MKL is fast (`mkl_is_fast`), else oneDNN's over the
    plain float32 weight (reordered at each call; on a Zen 3 at 512 rows 1.1-1.2x MKL's, whose AMD path is slower,
    docs/performance.md, "a thirty-sixth session"), and `F.linear` for other dtypes."""
    if (x.dtype == torch.float32 and weight.is_contiguous() and torch.backends.mkldnn.is_available()
            and not mkl_is_fast()):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
