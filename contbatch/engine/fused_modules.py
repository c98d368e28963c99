"""Fused CPU kernels for a decoder layer's elementwise steps, in contbatch's eager forwards.

An eager decoder layer runs its RMS norms and its MLP's gating as a string of small ATen ops (a norm is eight: a
dtype conversion, `pow`, `mean`, `add`, `rsqrt`, two `mul`s and another conversion), each a pass over the rows and
a dispatch. On a decode step of 128 rows of the embedded model that is about 20 us a norm and 34 us a gating in
float32 (33 and 47 us in bfloat16), where one pass each (`rms_norm`, `silu_mul` in `csrc/fused_ops.cpp`) takes 5
and 17 us (8 and 27 in bfloat16) on a Zen 5 (docs/performance.md, "a twenty-third session").

`fused_forward(model)` puts a `FusedRMSNorm` in the place of each module whose `forward` is transformers'
`LlamaRMSNorm.forward` (the same code object, or the same bytecode, constants and names: the models that copy it,
Qwen2, Qwen3, Mistral and others), a `FusedMLP` in the place of each whose `forward` is `LlamaMLP.forward` with
a SiLU `act_fn`, and a `FusedAttention` in the place of each whose `forward` is `LlamaAttention.forward` (or
Qwen2's or Mistral's, which pass a window) with Llama's rotary functions (its rotary embedding, ten ATen ops over
the query and key rows, in one pass of `rope`: 59 -> 8 us a layer at 128 rows, 1.15 ms -> 24 us at 512), for the
duration of one eager forward, and gives the model its own modules back afterwards. A module with hooks keeps its
own forward. A fused module shares its module's parameters and children under the same names (`_StandIn`), so the
model's tree looks the same to other threads meanwhile.

The fused modules compute what the model's own do, in float32 and rounded to the input's dtype at the same points:
the norm's sum of squares runs in another order and the SiLU's exp is a polynomial, so the results may differ from
the model's own in the last bit (as the panel kernel's products differ from MKL's); the rotary embedding is the
same bit for bit. A forward with grad enabled, off the CPU, or in another dtype than float32 or bfloat16, or than
the weight's, runs the model's own module; so does an attention forward given a KV cache (`generate`'s).
`CONTBATCH_FUSED_MODULES=0` turns the swap off.
"""

from __future__ import annotations

import functools
import inspect
import os
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

from contbatch.engine.cpu_kernels import kernel_module
from contbatch.engine.packed_weights import PackedLinear

PLAN_ATTRIBUTE = "_contbatch_fused_plan"
_DTYPES = (torch.float32, torch.bfloat16)
_KERNELS_FUNCTION_MODULE = "_create_func_module.<locals>.Func"
_CACHE_KWARGS = ("past_key_values", "cache")
"""The attention forward's KV cache, named `past_key_values` before transformers 5.24 and `cache` since; a layer
given one (`generate`'s) runs its own forward, and the attention function gets neither, as in that forward."""


@functools.lru_cache(maxsize=256)
def _same_code(function: object, reference: object) -> bool:
    """Whether `function` computes what `reference` does: it is `reference`, or both are functions compiled from
    the same source text (bytecode, constants and names equal: transformers' "Copied from" classes) whose closures
    hold the same values, the functions among them compared the same way: a decorated function
    (`functools.wraps`, as transformers 5.24's `deprecate_kwarg` wraps the forwards) matches one under the same
    decorators around the same code. A function module of the `kernels` package (`_function_of`) stands for its
    function. Cached: every forward checks its plan with it."""
    return _same_function(function, reference, 0)


def _same_function(function: object, reference: object, depth: int) -> bool:
    if function is reference:
        return True
    function, reference = _function_of(function), _function_of(reference)
    if not (isinstance(function, types.FunctionType) and isinstance(reference, types.FunctionType)) or depth > 6:
        return False
    code, own = function.__code__, reference.__code__
    if (code.co_code, code.co_consts, code.co_names) != (own.co_code, own.co_consts, own.co_names):
        return False
    cells, own_cells = function.__closure__ or (), reference.__closure__ or ()
    return len(cells) == len(own_cells) and all(
        _same_value(cell.cell_contents, own_cell.cell_contents, depth + 1)
        for cell, own_cell in zip(cells, own_cells, strict=True))


def _same_value(value: object, own: object, depth: int) -> bool:
    """A closure's values compared: functions (and `kernels` function modules) by `_same_function`, tuples item by
    item, anything else by equality."""
    if value is own:
        return True
    if isinstance(value, tuple) and isinstance(own, tuple):
        return len(value) == len(own) and all(_same_value(a, b, depth) for a, b in zip(value, own, strict=True))
    if callable(value) or callable(own):
        return _same_function(value, own, depth)
    try:
        return bool(value == own)
    except Exception:  # a value without a plain equality is not shown to be the same
        return False


def _function_of(value: object) -> object:
    """The function a `kernels` function module computes (transformers 5.25 wraps `apply_rotary_pos_emb` in
    one: `use_kernel_forward_from_hub` on a function), while no hub kernel replaced its forward; `value` itself
    otherwise."""
    if not (isinstance(value, nn.Module) and type(value).__qualname__ == _KERNELS_FUNCTION_MODULE
            and "forward" not in value.__dict__):
        return value
    functions = [cell.cell_contents for cell in type(value).forward.__closure__ or ()
                 if isinstance(cell.cell_contents, types.FunctionType)]
    return functions[0] if len(functions) == 1 else value


def _unhooked(module: nn.Module) -> bool:
    """No hooks, and no `forward` of the instance's own (accelerate's device hooks replace it that way)."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or "forward" in module.__dict__)


def is_llama_norm(module: nn.Module) -> bool:
    """Whether `module` computes `LlamaRMSNorm`'s forward: its class's `forward` is that code, it has a 1-D
    `weight` parameter and a float `variance_epsilon`, and no hooks."""
    weight = module._parameters.get("weight")
    return (_same_code(type(module).forward, LlamaRMSNorm.forward) and weight is not None and weight.dim() == 1
            and isinstance(module.__dict__.get("variance_epsilon"), float) and _unhooked(module))


def is_llama_mlp(module: nn.Module) -> bool:
    """Whether `module` computes `LlamaMLP`'s forward with SiLU: its class's `forward` is that code, its `act_fn`
    is exactly `nn.SiLU` or transformers' `SiLUActivation`, and neither has hooks."""
    act = module._modules.get("act_fn")
    return (_same_code(type(module).forward, LlamaMLP.forward) and type(act) in (nn.SiLU, SiLUActivation)
            and _unhooked(module) and act is not None and _unhooked(act))


_ATTENTION_FORWARDS: tuple[tuple[Callable[..., Any], Callable[[nn.Module], dict[str, Any]]], ...] = (
    (LlamaAttention.forward, lambda own: {}),
    (Qwen2Attention.forward, lambda own: {"sliding_window": own.sliding_window}),
    (MistralAttention.forward, lambda own: {"sliding_window": getattr(own.config, "sliding_window", None)}),
)
"""The attention forwards `FusedAttention` computes, each with the extra arguments it gives the attention function
(Qwen2 and Mistral pass a window; their code is otherwise Llama's)."""


def _attention_arguments(module: nn.Module) -> Callable[[nn.Module], dict[str, Any]] | None:
    """The extra arguments of `module`'s attention forward (`_ATTENTION_FORWARDS`), or None when it is none of them."""
    forward = type(module).forward
    return next((arguments for reference, arguments in _ATTENTION_FORWARDS if _same_code(forward, reference)), None)


def is_llama_attention(module: nn.Module) -> bool:
    """Whether `module` computes `LlamaAttention`'s forward, or Qwen2's or Mistral's (Llama's with a window): its
    class's `forward` is that code, and the `apply_rotary_pos_emb` and `rotate_half` it calls (its module's) are
    Llama's code too, with no hub kernel in place of either (`kernels`' private wrappers, `_kernel_funcs`); no
    hooks."""
    private = module.__dict__.get("_kernel_funcs") or {}
    if (_attention_arguments(module) is None or not _unhooked(module)
            or any("forward" in getattr(wrapper, "__dict__", {"forward": None}) for wrapper in private.values())):
        return False
    names = getattr(inspect.unwrap(type(module).forward), "__globals__", {})
    return (_same_code(names.get("apply_rotary_pos_emb"), modeling_llama.apply_rotary_pos_emb)
            and _same_code(names.get("rotate_half"), modeling_llama.rotate_half))


def _runs_fused(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a fused module takes `x`: grad off, `x` on CPU, of `dtype` (its weights'), float32 or bfloat16."""
    return not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype == dtype and dtype in _DTYPES


class _StandIn(nn.Module):
    """Stands for the module `own` in the model's tree: it shares `own`'s parameter, buffer and child dicts (the
    same names and objects, so `named_parameters`, `zero_grad`, `state_dict` and `train` on another thread reach
    the model's own tree while the stand-in is in place), and reads any other attribute from `own`."""

    own: Any

    def __init__(self, own: nn.Module) -> None:
        super().__init__()
        self.__dict__.update(own=own, _parameters=own._parameters, _buffers=own._buffers,
                             _modules=own._modules, training=own.training)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "own" not in self.__dict__:
                raise
            return getattr(self.__dict__["own"], name)

    def train(self, mode: bool = True) -> _StandIn:
        self.own.train(mode)
        self.training = mode
        return self


class FusedRMSNorm(_StandIn):
    """Stands for a `LlamaRMSNorm`-like module (`is_llama_norm`) inside contbatch's eager forwards: one pass of the
    `rms_norm` kernel where `_runs_fused`, else the module's own forward."""

    def stands_for(self, own: nn.Module) -> bool:
        return own is self.own and is_llama_norm(own)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters["weight"]
        assert weight is not None
        if not (_runs_fused(x, weight.dtype) and weight.device.type == "cpu" and x.shape[-1] == weight.shape[0]):
            return self.own(x)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return kernel_module().rms_norm(rows, weight.contiguous(), self.own.variance_epsilon).view(x.shape)


class FusedMLP(_StandIn):
    """Stands for a `LlamaMLP`-like module with SiLU (`is_llama_mlp`) inside contbatch's eager forwards:
    `down_proj(silu_mul(gate_proj(x), up_proj(x)))` through the module's projections (its own, or those another
    swap put in), the gating one pass of the `silu_mul` kernel where `_runs_fused` holds for x and both
    projections' outputs (with the two products where both run in AMX blocks: `_amx_gated`); else the module's
    own forward."""

    def stands_for(self, own: nn.Module) -> bool:
        return own is self.own and is_llama_mlp(own)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _runs_fused(x, x.dtype):
            return self.own(x)
        modules = self._modules
        gated = _amx_gated(modules["gate_proj"], modules["up_proj"], x)
        if gated is not None:
            return modules["down_proj"](gated)  # type: ignore[misc]
        gate, up = modules["gate_proj"](x), modules["up_proj"](x)  # type: ignore[misc]
        if not (_runs_fused(gate, x.dtype) and _runs_fused(up, x.dtype) and gate.shape == up.shape):
            return modules["down_proj"](modules["act_fn"](gate) * up)  # type: ignore[misc]
        width = gate.shape[-1]
        gated = kernel_module().silu_mul(gate.reshape(-1, width).contiguous(), up.reshape(-1, width).contiguous())
        return modules["down_proj"](gated.view(gate.shape))  # type: ignore[misc]


def _amx_gated(gate: nn.Module | None, up: nn.Module | None, x: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate(x)) * up(x)` in one pass of the AMX product (`amx_silu_mul`: both products, each rounded to
    bfloat16, then the `silu_mul` kernel's arithmetic, so bit for bit the unfused result) where both projections
    are `PackedLinear`s whose product of `x` runs in AMX blocks (`PackedLinear.amx_blocks`) with one width, a
    multiple of 16; else None."""
    if not (isinstance(gate, PackedLinear) and isinstance(up, PackedLinear)):
        return None
    gates, ups, width = gate.amx_blocks(x), up.amx_blocks(x), gate.weight.shape[0]
    if gates is None or ups is None or up.weight.shape[0] != width or width % 16:
        return None
    gated = kernel_module().amx_silu_mul(x.reshape(-1, x.shape[-1]).contiguous(), gates, ups, width)
    return gated.view(*x.shape[:-1], width)


class FusedAttention(_StandIn):
    """Stands for a `LlamaAttention`-like module (`is_llama_attention`: Llama's, Qwen2's or Mistral's forward)
    inside contbatch's eager forwards: its own forward's steps, through its projections (its own, or those another
    swap put in) and the attention function its config names, with the rotary embedding of the query and key rows
    in one pass of the `rope` kernel, bit for bit what `apply_rotary_pos_emb` computes, where `_runs_fused` holds
    and the cos/sin rows match the tokens; else the module's own forward."""

    arguments: Callable[[nn.Module], dict[str, Any]]
    eager: Callable[..., Any]

    def __init__(self, own: nn.Module) -> None:
        super().__init__(own)
        forward = inspect.unwrap(type(own).forward)
        self.__dict__.update(arguments=_attention_arguments(own) or (lambda own: {}),
                             eager=forward.__globals__.get("eager_attention_forward",
                                                           modeling_llama.eager_attention_forward))

    def stands_for(self, own: nn.Module) -> bool:
        return own is self.own and is_llama_attention(own)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        own, modules = self.own, self._modules
        input_shape, head_dim = hidden_states.shape[:-1], own.head_dim
        if position_embeddings is None or any(kwargs.get(name) is not None for name in _CACHE_KWARGS) or not all(
                x.shape == (*input_shape, head_dim) and _runs_fused(x, hidden_states.dtype)
                for x in position_embeddings) or head_dim % 2 or not _runs_fused(hidden_states, hidden_states.dtype):
            return own(hidden_states, position_embeddings, attention_mask, **kwargs)
        kwargs = {name: value for name, value in kwargs.items() if name not in _CACHE_KWARGS}
        cos, sin = position_embeddings
        shape = (*input_shape, -1, head_dim)
        queries, keys = _rotated(modules["q_proj"](hidden_states), modules["k_proj"](hidden_states),  # type: ignore[misc]
                                 cos, sin, shape)
        values = modules["v_proj"](hidden_states).view(shape).transpose(1, 2)  # type: ignore[misc]
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(own.config._attn_implementation, self.eager)
        output, weights = attention(own, queries, keys, values, attention_mask,
                                    dropout=0.0 if not own.training else own.attention_dropout, scaling=own.scaling,
                                    **self.arguments(own), **kwargs)
        return modules["o_proj"](output.reshape(*input_shape, -1).contiguous()), weights  # type: ignore[misc]


def _rotated(queries: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary_pos_emb` of the projections' outputs `queries` and `keys` [..., heads * head_dim], viewed as
    [batch, heads, tokens, head_dim] (`shape` is [batch, tokens, -1, head_dim]): one pass of the `rope` kernel where
    both are of cos's dtype, the function itself otherwise."""
    dtype, head_dim = cos.dtype, cos.shape[-1]
    if queries.dtype != dtype or keys.dtype != dtype:
        heads = [x.view(shape).transpose(1, 2) for x in (queries, keys)]
        return modeling_llama.apply_rotary_pos_emb(*heads, cos, sin)
    rows = [x.reshape(-1, x.shape[-1]).contiguous() for x in (queries, keys)]
    table = [x.reshape(-1, head_dim).contiguous() for x in (cos, sin)]
    rotated = kernel_module().rope(*rows, *table)
    return rotated[0].view(shape).transpose(1, 2), rotated[1].view(shape).transpose(1, 2)


Swap = tuple[nn.Module, str, nn.Module, "FusedRMSNorm | FusedMLP | FusedAttention"]


@dataclass
class _Plan:
    """The (parent, attribute, own module, fused module) swaps `fused_forward` makes in a model, found once and
    kept on the model object (`PLAN_ATTRIBUTE`) while it holds."""

    swaps: list[Swap]

    @classmethod
    def of(cls, model: nn.Module) -> _Plan:
        swaps: list[Swap] = []
        for parent in model.modules():
            for name, child in parent._modules.items():
                if child is None:
                    continue
                if is_llama_norm(child):
                    swaps.append((parent, name, child, FusedRMSNorm(child)))
                elif is_llama_mlp(child):
                    swaps.append((parent, name, child, FusedMLP(child)))
                elif is_llama_attention(child):
                    swaps.append((parent, name, child, FusedAttention(child)))
        return cls(swaps)

    def holds(self) -> bool:
        """Whether every swapped module is still in its place and still qualifies (the same code, a weight of the
        norm's shape, no hooks)."""
        return all(parent._modules.get(name) is own and fused.stands_for(own)
                   for parent, name, own, fused in self.swaps)


def fusing() -> bool:
    """Whether the swap is on (`CONTBATCH_FUSED_MODULES` is not "0") and the kernels are built."""
    return os.environ.get("CONTBATCH_FUSED_MODULES", "1") != "0" and kernel_module() is not None


@contextmanager
def fused_forward(model: nn.Module) -> Iterator[None]:
    """Within the block, `model`'s Llama-style RMS norms and SiLU MLPs are their `FusedRMSNorm` / `FusedMLP`
    (when the kernels are built and the swap is on); the model's own modules are back afterwards, also on
    errors. The plan is found again when a module was replaced, re-parametrised or hooked since."""
    if not fusing():
        yield
        return
    plan: _Plan | None = model.__dict__.get(PLAN_ATTRIBUTE)
    if plan is None or not plan.holds():
        plan = model.__dict__[PLAN_ATTRIBUTE] = _Plan.of(model)
    try:
        for parent, name, _, fused in plan.swaps:
            parent._modules[name] = fused
        yield
    finally:
        for parent, name, own, _ in plan.swaps:
            parent._modules[name] = own
