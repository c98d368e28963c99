"""The output head (LM head) through oneDNN with a prepacked weight, for contbatch's CPU forwards.

On CPU, float32, `F.linear` runs the vocabulary projection (tens of thousands of outputs from a few hundred
inputs) well below the machine's GEMM rate; oneDNN with the weight reordered once into its blocked layout runs the
same product 1.3-2.9x faster (docs/performance.md). The head is a large share of a decode step (a fifth of its
FLOPs for SmolLM2-135M), so this is worth a second copy of its weight.

`PackedHead.during_forward(model)` puts a `PackedHead` in the model's place of its output embedding for the
duration of one of contbatch's forwards and gives the model its own module back afterwards: other code sees it
only while such a forward runs (a forward on another thread meanwhile computes the same function with it).
Before each forward the packed copy is checked against the weight's storage and version counter and packed again
when the weight changed (an optimizer step in place, a reload), so it never serves stale weights
(`weights_changed` covers writes that bypass the version counter). A compiled forward calls the product as the
opaque op `contbatch::packed_linear`.

Set `CONTBATCH_PACK_LM_HEAD=0` to keep `F.linear` (and save the copy's memory).
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

_handles = itertools.count()
_packed: dict[int, torch.Tensor] = {}
_heads: weakref.WeakKeyDictionary[nn.Linear, PackedHead] = weakref.WeakKeyDictionary()


@torch.library.custom_op("contbatch::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the prepacked copy of `weight` registered under `handle` (by
    `PackedHead.refresh`, which the caller ran before the forward)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _packed[handle], bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _output_head(model: nn.Module) -> tuple[object, Callable[[nn.Module], None] | None]:
    """`model`'s output embedding (None without a getter) and its setter (None when it has none)."""
    get_head = getattr(model, "get_output_embeddings", None)
    return (get_head() if get_head is not None else None), getattr(model, "set_output_embeddings", None)


def packing_applies(head: object) -> bool:
    """Whether `head` can be packed: exactly an `nn.Linear` with a float32 CPU weight that tracks its version
    (not an inference tensor), oneDNN available, and not disabled by `CONTBATCH_PACK_LM_HEAD=0`."""
    if os.environ.get("CONTBATCH_PACK_LM_HEAD", "1") == "0" or type(head) is not nn.Linear:
        return False
    weight = head.weight
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and not weight.is_inference()
            and torch.backends.mkldnn.is_available())


class PackedHead(nn.Module):
    """Stands for an `nn.Linear` (the same parameters, the same function) inside contbatch's forwards. Without
    grad its product runs through the prepacked weight; a forward that needs grad, or whose input has another dtype
    than the weight, runs `F.linear`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.handle = next(_handles)
        self._packed_from: tuple[int, int] | None = None
        weakref.finalize(self, _packed.pop, self.handle, None)

    def stands_for(self, linear: nn.Linear) -> bool:
        return self.weight is linear.weight and self.bias is linear.bias

    def refresh(self) -> None:
        """Packs the weight again if its storage or version changed since the last packing."""
        source = (self.weight.data_ptr(), self.weight._version)
        if source != self._packed_from:
            _packed[self.handle] = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            self._packed_from = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if needs_grad or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.weight, self.bias, self.handle)

    @classmethod
    def for_linear(cls, linear: nn.Linear) -> PackedHead:
        """The `PackedHead` of `linear`: one per head while its parameters stay the same objects, so that a
        compiled forward keeps seeing one module. It holds the parameters, not `linear`."""
        head = _heads.get(linear)
        if head is None or not head.stands_for(linear):
            head = _heads[linear] = cls(linear)
        return head

    @staticmethod
    def weights_changed(model: nn.Module) -> None:
        """Packs `model`'s head again at its next forward: its weight may have changed through an alias that
        bypasses the version counter (a write to `.data`)."""
        own, _ = _output_head(model)
        head = _heads.get(own) if isinstance(own, nn.Linear) else None
        if head is not None:
            head._packed_from = None

    @staticmethod
    @contextmanager
    def during_forward(model: nn.Module) -> Iterator[None]:
        """Within the block, `model`'s output embedding is its `PackedHead` (fresh), where packing applies."""
        own, set_head = _output_head(model)
        if set_head is None or not packing_applies(own):
            yield
            return
        packed = PackedHead.for_linear(own)
        packed.refresh()
        set_head(packed)
        try:
            yield
        finally:
            set_head(own)
