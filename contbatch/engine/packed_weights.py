"""The model's linear layers over prepacked weights, for contbatch's CPU forwards (float32 and bfloat16).

Float32. Where the CPU kernels are built with AVX2 + FMA (`cpu_kernels.panel_gemm`), each layer's weight is packed
once into 16-column panels and its decode-size products run through that kernel (1.3-1.7x oneDNN's prepacked
product at 32 rows, 1.1x at 128); each row's result is one FMA chain over k, independent of the other rows. The
output head, and the layers where the panel kernel is not built, are reordered once into oneDNN's blocked layout
(1.4-2.9x `F.linear` for the head). Past `LAYER_MAX_ROWS` rows (prompt chunks) a layer's product is over its plain
weight (`mkl_products`: oneDNN's, 1.1-1.2x MKL's on a Zen 3; on Intel, `mkl_is_fast`, MKL's, for a full prompt
step over MKL's own copy packed for its rows); the head takes its packed copy always (in row chunks or column
slices where its output is large: `head_product`). Where ATen runs AVX-512 (`cpu_has_avx512`) the layers take the
kernel's AVX-512 tiles (`wide_panels`) or oneDNN's copy at every row count, as MKL runs 2-3x below oneDNN on AMD;
on Intel the tiles only up to `LAYER_MAX_ROWS` rows (docs/performance.md).

bfloat16. Where the CPU lacks bfloat16 arithmetic (`torch.ops.mkldnn._is_mkldnn_bf16_supported()` false:
`F.linear` runs at about a seventh of the float32 rate), every bfloat16 linear, the head included, runs through the
panel kernel: bfloat16 panels widened to float32 as they are read, the result rounded once. Where the CPU has
AVX512-BF16 but no AMX (`pair_panels`), the layers take the kernel's pair tiles (`vdpbf16ps`; on a Zen 5 1.15x
oneDNN at 128 rows, 1.3x at 16-64); with AMX, AMX blocks up to `AMX_MAX_ROWS` rows (`amx_panels`: oneDNN's
micro-kernel without its per-call work) and `F.linear` above. The head, and layers of an odd K, take oneDNN's
product over a prepacked copy (1.1-1.6x `F.linear`, which reorders the weight each call).

`packed_forward(model)` puts a `PackedLinear` in the place of each `nn.Linear` of the model (the output head
through `set_output_embeddings`, the others as attributes of their parent module) for the duration of one of
contbatch's forwards, and gives the model its own modules back afterwards: other code sees them only while such
a forward runs (a forward on another thread meanwhile computes the same function with them). Before each
forward every packed copy is checked against its weight's storage and version counter and packed again when the
weight changed (an optimizer step in place, a reload), so it never serves stale weights (`weights_changed`
covers writes that bypass the version counter). A compiled forward calls a layer's product as the C++ operator
`contbatch_native::layer_product` (`layer_op`) where the kernels are built, else, and for the head, as the opaque
Python op `contbatch::packed_linear`.

The copies cost memory: the head's always, the layers' (about the model's size; twice that with MKL's copies)
only when they fit in `LAYER_MEMORY_SHARE` of the machine's memory (`pending_packed_bytes` says how much, for the
KV cache's sizing). `CONTBATCH_PACK_WEIGHTS=head` packs only the head, `CONTBATCH_PACK_WEIGHTS=0` nothing;
`CONTBATCH_PANEL_GEMM=0` keeps oneDNN where the panel kernel would run.
"""

from __future__ import annotations

import itertools
import math
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from contbatch.engine import cpu_kernels, layer_op, mkl_products
from contbatch.engine.cpu_features import cpu_has_amx, cpu_has_avx512, cpu_has_bf16, mkl_is_fast
from contbatch.engine.cpu_kernels import PanelLinear, amx_panels, pack_layer, pair_panels, panel_gemm, wide_panels
from contbatch.engine.head_product import SlicedHead, chunked_product, pack_slices, sliced_product, slices_head
from contbatch.engine.head_screen import forget as forget_screen
from contbatch.engine.head_screen import note_head_output, screened_product
from contbatch.engine.ops import define_op

LAYER_MAX_ROWS = 256
AMX_MAX_ROWS = 512
"""bfloat16 layers in AMX blocks (`amx_panels`) take them up to this many rows, and `F.linear` above: on an AMX
Xeon at 512 rows the blocks ran 1.0-1.15x `F.linear`, at 2,048 rows 0.77-0.89x (docs/performance.md, "a sixtieth
session")."""
PANEL_MAX_WEIGHT = 3 << 20
"""Float32 weights with this many elements or more go through oneDNN where ATen runs AVX-512: on a Zen 5,
Qwen2-0.5B's MLP (4,864 x 896) ran 1.1x as fast that way, whole runs 309 against 281 tok/s; the embedded model's
weights (at most 1,536 x 576) run faster in panels (docs/performance.md, "a thirty-second session")."""
LAYER_MEMORY_SHARE = 0.1
PLAN_ATTRIBUTE = "_contbatch_packed_plan"
_handles = itertools.count()
_packed: dict[int, torch.Tensor | SlicedHead] = {}
_heads: set[int] = set()
_modules: weakref.WeakKeyDictionary[nn.Linear, PackedLinear] = weakref.WeakKeyDictionary()


def packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int,
                   max_rows: int, panels: bool) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: over the plain weight when `x` has more than `max_rows` rows (0: no limit;
    `mkl_products.large_product`), else through the packed copy of `weight` registered under `handle` (by
    `PackedLinear.refresh`, which the caller ran before the forward): by the panel kernel when `panels` asks for
    it and it is built, else by oneDNN (the layout `refresh` packed in by the same rule). For an output head in a
    step that asked for greedy tokens only, the head screen's placeholder instead (`head_screen.screened_product`).
    """
    if handle in _heads:
        screened = screened_product(x, weight, handle)
        return screened if screened is not None else note_head_output(_product(x, weight, bias, handle, max_rows,
                                                                                 panels, head=True))
    return _product(x, weight, bias, handle, max_rows, panels)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int, max_rows: int,
             panels: bool, head: bool = False) -> torch.Tensor:
    """The product of `packed_product`; a `head`'s through oneDNN in slices or chunks where its output is large
    (`head_product`)."""
    rows = math.prod(x.shape[:-1])
    if max_rows and rows > max_rows:
        return mkl_products.large_product(x, weight, bias, handle)
    packed = _packed[handle]
    if isinstance(packed, SlicedHead):
        return sliced_product(x.reshape(rows, x.shape[-1]), packed, bias, weight.shape[0]).view(
            *x.shape[:-1], weight.shape[0])
    gemm = panel_gemm() if panels else None
    if gemm is not None:
        return _panel_call(gemm, x, packed, weight.shape[0], bias)
    if head and (chunked := chunked_product(x.reshape(rows, x.shape[-1]), packed, bias,
                                            weight.shape[0])) is not None:
        return chunked.view(*x.shape[:-1], weight.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _panel_call(gemm: PanelLinear, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """`gemm` (the panel kernel) over `x`'s rows, any leading dims, the result in `x`'s leading shape."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = gemm(rows, panels, out_features, None if bias is None else bias.contiguous())
    return out.view(*x.shape[:-1], out_features)


def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int,
                        max_rows: int, panels: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


packed_linear = define_op(
    "packed_linear", "(Tensor x, Tensor weight, Tensor? bias, int handle, int max_rows, bool panels) -> Tensor",
    packed_product, _packed_linear_fake,
)
"""`packed_product` as the op `contbatch::packed_linear`, which a compiled graph calls without tracing into it."""


def packing_applies(linear: object) -> TypeGuard[nn.Linear]:
    """Whether `linear` can be packed: exactly an `nn.Linear` with a CPU weight that tracks its version (not an
    inference tensor), oneDNN available, packing not disabled (`CONTBATCH_PACK_WEIGHTS=0`), and the weight float32,
    or bfloat16 where `bf16_panels()` or `cpu_has_bf16()`."""
    if _setting() == "0" or type(linear) is not nn.Linear:
        return False
    weight = linear.weight
    dtype_applies = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                                       and (bf16_panels() or cpu_has_bf16()))
    return (weight.device.type == "cpu" and dtype_applies and not weight.is_inference()
            and torch.backends.mkldnn.is_available())


def bf16_panels() -> bool:
    """Whether bfloat16 layers run through the panel kernel: it is built, and either the CPU has no bfloat16
    arithmetic for oneDNN (so `F.linear` in bfloat16 takes a slow generic path), or it takes AMX blocks
    (`amx_panels`), or it multiplies bfloat16 pairs with AVX512-BF16 (`pair_panels`) and the CPU has no AMX. The
    head takes them only in the first case (`_head_kind`)."""
    return panel_gemm() is not None and (not cpu_has_bf16() or amx_panels() or (pair_panels() and not cpu_has_amx()))


class PackedLinear(nn.Module):
    """Stands for an `nn.Linear` (the same parameters, the same function) inside contbatch's forwards. Without
    grad its product runs through the prepacked weight (up to `max_rows` rows; 0: any number), in panels for the
    panel kernel when `panels` asks for them and the kernel is built, else in oneDNN's layout; a forward that
    needs grad, or whose input has another dtype than the weight, runs `F.linear`. An eager layer product in
    panels calls the kernel directly (`_direct`, set by `refresh`): the same call as `packed_product` makes,
    without its lookups, about 4 us less a call."""

    def __init__(self, linear: nn.Linear, max_rows: int, panels: bool = False, head: bool = False) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.max_rows = max_rows
        self.panels = panels
        self.dtype = linear.weight.dtype
        self.handle = next(_handles)
        self._packed_from: tuple[int, int, bool, bool] | None = None
        self._direct: tuple[PanelLinear, torch.Tensor, int, int] | None = None
        self._native: Any = None  # `layer_op`'s operator, which a compiled forward calls for this layer's product
        # plain references: `nn.Module.__getattr__` on a parameter costs microseconds, and every forward checks
        # a few hundred of these
        self._parameters_of: tuple[torch.Tensor, torch.Tensor | None] = (linear.weight, linear.bias)
        weakref.finalize(self, _forget_handle, self.handle)
        if head:
            _heads.add(self.handle)

    def stands_for(self, linear: nn.Linear) -> bool:
        own = linear._parameters
        return self._parameters_of[0] is own.get("weight") and self._parameters_of[1] is own.get("bias")

    def refresh(self) -> None:
        """Packs the weight again if its storage, its version or the packing's kind (panels, oneDNN, or for a head
        oneDNN in slices: `head_product.slices_head`) changed since the last packing."""
        weight = self._parameters_of[0]
        panels = self.panels and panel_gemm() is not None
        sliced = not panels and self.handle in _heads and slices_head(weight.shape[0], weight.dtype)
        source = (weight.data_ptr(), weight._version, panels, sliced)
        if source != self._packed_from:
            detached = weight.detach()
            _packed[self.handle] = (pack_layer(detached) if panels else pack_slices(detached) if sliced
                                    else torch.ops.mkldnn._reorder_linear_weight(detached, None))
            self._packed_from = source
            forget_screen(self.handle)
            mkl_products.weight_changed(self.handle)
            gemm, packed = panel_gemm() if panels else None, _packed[self.handle]
            self._direct = (None if gemm is None or self.handle in _heads or not isinstance(packed, torch.Tensor)
                            else (gemm, packed, weight.shape[0], self.max_rows or -1))
            self._native = (layer_op.register(self.handle, packed)
                            if isinstance(packed, torch.Tensor) and self.handle not in _heads else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        direct = self._direct
        if direct is not None and x.dtype is self.dtype and not torch.is_grad_enabled() and x.dim() > 1:
            gemm, packed, out_features, max_rows = direct
            if not torch.compiler.is_compiling() and (max_rows < 0 or math.prod(x.shape[:-1]) <= max_rows):
                return _panel_call(gemm, x, packed, out_features, self._parameters_of[1])
        compiling = torch.compiler.is_compiling()
        weight, bias = (self.weight, self.bias) if compiling else self._parameters_of
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if needs_grad or x.dtype != weight.dtype:
            return F.linear(x, weight, bias)
        if compiling and self._native is not None:
            return self._native(x, weight, bias, self.handle, self.max_rows)
        product = packed_linear if compiling else packed_product
        return product(x, weight, bias, self.handle, self.max_rows, self.panels)

    def amx_blocks(self, x: torch.Tensor) -> torch.Tensor | None:
        """The AMX blocks (`amx_panels`) this layer's product of `x` would run through, directly and without a
        bias; None where it would take another path."""
        direct = self._direct
        if (direct is None or self._parameters_of[1] is not None or x.dtype is not torch.bfloat16 or x.dim() < 2
                or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or direct[1].shape[-1] != 2 * cpu_kernels.AMX_BLOCK or math.prod(x.shape[:-1]) > direct[3]):
            return None
        return direct[1]

    @classmethod
    def for_linear(cls, linear: nn.Linear, max_rows: int = 0, panels: bool = False, head: bool = False) -> PackedLinear:
        """The `PackedLinear` of `linear`: one per module while its parameters stay the same objects, so that a
        compiled forward keeps seeing one module. It holds the parameters, not `linear`. `head`: the model's output
        head, whose product may go through the head screen."""
        packed = _modules.get(linear)
        if (packed is None or not packed.stands_for(linear) or packed.max_rows != max_rows
                or packed.panels != panels or packed.dtype != linear.weight.dtype or (packed.handle in _heads) != head):
            packed = _modules[linear] = cls(linear, max_rows, panels, head)
        return packed


def _forget_handle(handle: int) -> None:
    layer_op.forget(handle)
    mkl_products.forget(handle)
    _packed.pop(handle, None)
    _heads.discard(handle)
    forget_screen(handle)


def _output_head(model: nn.Module) -> nn.Module | None:
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if get_head is not None and hasattr(model, "set_output_embeddings") else None


def _layer_sites(model: nn.Module, head: nn.Module | None) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every packable `nn.Linear` of `model` other than `head`."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if child is not head and packing_applies(child)]


def _packs_layers(sites: list[tuple[nn.Module, str, nn.Linear]]) -> bool:
    """Whether the layers' copies are made: not `CONTBATCH_PACK_WEIGHTS=head`, and within `LAYER_MEMORY_SHARE`."""
    return _setting() != "head" and _fits(sum(linear.weight.nbytes for _, _, linear in sites))


def _fits(nbytes: int) -> bool:  # within `LAYER_MEMORY_SHARE` of the machine's memory
    return nbytes <= LAYER_MEMORY_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _mkl_copies(linears: list[nn.Linear]) -> list[nn.Linear]:
    """The layers among `linears` (all packed) with MKL copies for full prompt steps (`mkl_products`), when those
    fit beside the packed ones in `LAYER_MEMORY_SHARE`."""
    chosen = [linear for linear in linears if _layer_kind(linear)[0] and mkl_products.applies(linear.weight)]
    return chosen if _fits(2 * sum(linear.weight.nbytes for linear in linears)) else []


def pending_packed_bytes(model: nn.Module) -> int:
    """The memory the packed copies of `model`'s weights will take that they do not take yet (for the KV cache's
    sizing: copies made for an earlier engine on the model are already out of the free memory)."""
    head = _output_head(model)
    sites = _layer_sites(model, head)
    linears = [linear for _, _, linear in sites] if _packs_layers(sites) else []
    pending = [linear for linear in _mkl_copies(linears) if not _is_packed(linear, mkl=True)]
    pending += [linear for linear in [*linears, *([head] if packing_applies(head) else [])] if not _is_packed(linear)]
    return sum(linear.weight.nbytes for linear in pending)


def _is_packed(linear: nn.Linear, mkl: bool = False) -> bool:
    """Whether `linear`'s packed copy is made (`mkl`: its MKL copy)."""
    packed = _modules.get(linear)
    return (packed is not None and packed.stands_for(linear)
            and (mkl_products.packed(packed.handle) if mkl else packed._packed_from is not None))


def weights_changed(model: nn.Module) -> None:
    """Packs `model`'s weights again at its next forward: a weight may have changed through an alias that
    bypasses the version counter (a write to `.data`)."""
    for module in model.modules():
        packed = _modules.get(module) if isinstance(module, nn.Linear) else None
        if packed is not None:
            packed._packed_from = None


@dataclass
class _Plan:
    """What `packed_forward` swaps in `model`, found once and kept while it stays true (`holds`): the head and
    its `PackedLinear`, and (parent, attribute, own module, its `PackedLinear`) for each layer. Kept on the model
    object (`PLAN_ATTRIBUTE`), so it lives as long as the model (a parent may be the model itself)."""

    setting: str
    head: nn.Module | None
    packed_head: PackedLinear | None
    swaps: list[tuple[nn.Module, str, nn.Linear, PackedLinear]]
    step_rows: int = -1

    def aim(self, step_rows: int) -> None:
        """Aims the layers with MKL copies (`_mkl_copies`) at `step_rows` rows, past their packed rows."""
        chosen = {id(own) for own in _mkl_copies([own for _, _, own, _ in self.swaps])}
        for _, _, own, swap in self.swaps:
            mkl_products.aim(swap.handle, step_rows if id(own) in chosen and step_rows > swap.max_rows else 0)
        self.step_rows = step_rows

    @classmethod
    def of(cls, model: nn.Module, setting: str) -> _Plan:
        head = _output_head(model)
        sites = _layer_sites(model, head)
        swaps = [(parent, name, own, PackedLinear.for_linear(own, *_layer_kind(own)))
                 for parent, name, own in (sites if _packs_layers(sites) else [])]
        packed_head = (PackedLinear.for_linear(head, *_head_kind(head), head=True)
                       if packing_applies(head) else None)
        return cls(setting, head, packed_head, swaps)

    def holds(self, model: nn.Module, setting: str) -> bool:
        """Whether the plan still describes `model`: same setting and head, every swapped module still in its
        place with its own parameters, of the dtype it was packed for, on CPU (a module replaced or converted since
        makes a new plan)."""
        if setting != self.setting or _output_head(model) is not self.head:
            return False
        if self.packed_head is not None and not self.packed_head.stands_for(self.head):  # type: ignore[arg-type]
            return False
        packed = [self.packed_head] if self.packed_head is not None else []
        return (all(parent._modules.get(name) is own and swap.stands_for(own) for parent, name, own, swap in self.swaps)
                and all(p._parameters_of[0].dtype == p.dtype and p._parameters_of[0].is_cpu
                        for p in packed + [swap[3] for swap in self.swaps]))


def _layer_kind(linear: nn.Linear) -> tuple[int, bool]:
    """(max_rows, panels) of a layer's `PackedLinear`. bfloat16: in AMX blocks up to `AMX_MAX_ROWS` rows where
    `amx_panels()` and K is even (else oneDNN); elsewhere every row count, in panels where `bf16_panels()` (in k
    pairs where `pair_panels()`), else through oneDNN. float32 where ATen runs AVX-512 (`cpu_has_avx512`):
    every row count, in panels where the panel kernel has its AVX-512 tiles (`wide_panels`) and the weight has
    fewer than `PANEL_MAX_WEIGHT` elements (only up to `LAYER_MAX_ROWS` rows where `mkl_is_fast`), else through
    oneDNN; elsewhere in panels up to `LAYER_MAX_ROWS` rows."""
    if linear.weight.dtype == torch.bfloat16:
        if amx_panels():
            return (AMX_MAX_ROWS, True) if linear.weight.shape[1] % 2 == 0 else (0, False)
        return (0, bf16_panels())
    if cpu_has_avx512():
        panels = wide_panels() and linear.weight.numel() < PANEL_MAX_WEIGHT
        return (LAYER_MAX_ROWS if panels and mkl_is_fast() else 0, panels)
    return (LAYER_MAX_ROWS, True)


def _head_kind(head: nn.Linear) -> tuple[int, bool]:
    """(max_rows, panels) of the head's `PackedLinear`: every row count, in panels for bfloat16 where the CPU has
    no bfloat16 arithmetic (`bf16_panels()`), else through oneDNN: the pairs are 0.9x oneDNN for a 49,152-row head
    at 128 rows (docs/performance.md, "a twenty-second session")."""
    return (0, head.weight.dtype == torch.bfloat16 and bf16_panels() and not cpu_has_bf16())


def _setting() -> str:
    return os.environ.get("CONTBATCH_PACK_WEIGHTS", "auto")


@contextmanager
def packed_forward(model: nn.Module, step_rows: int = 0) -> Iterator[None]:
    """Within the block, `model`'s output head and (memory permitting) its other linear layers are their fresh
    `PackedLinear`s, where packing applies; the model's own modules are back afterwards, also on errors.
    `step_rows`: the rows of a full prompt step (the engine's token budget), which float32 layers on Intel compute
    over MKL copies packed for them (`mkl_products`); 0: none."""
    setting = _setting()
    plan: _Plan | None = model.__dict__.get(PLAN_ATTRIBUTE)
    if plan is None or not plan.holds(model, setting):
        plan = model.__dict__[PLAN_ATTRIBUTE] = _Plan.of(model, setting)
    if plan.step_rows != step_rows:
        plan.aim(step_rows)
    for packed in [plan.packed_head, *(swap[3] for swap in plan.swaps)]:
        if packed is not None:
            packed.refresh()
    try:
        if plan.packed_head is not None:
            model.set_output_embeddings(plan.packed_head)  # type: ignore[operator]
        for parent, name, _, packed in plan.swaps:
            parent._modules[name] = packed
        yield
    finally:
        for parent, name, own, _ in plan.swaps:
            parent._modules[name] = own
        if plan.packed_head is not None:
            model.set_output_embeddings(plan.head)  # type: ignore[operator]
