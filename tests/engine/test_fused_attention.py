"""The fused rotary embedding (`rope` kernel, `FusedAttention`): bit for bit `apply_rotary_pos_emb` and the
attention module's own forward, swapped in only where the module's forward and its rotary functions are Llama's."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

from contbatch.engine.cpu_kernels import kernel_module
from contbatch.engine.fused_modules import FusedAttention, fused_forward, is_llama_attention
from tests.helpers import fresh_tiny_model, random_prompts

pytestmark = pytest.mark.skipif(kernel_module() is None, reason="the CPU kernels are not built here")


def _rotary(tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [1, tokens, head_dim] as Llama's rotary embedding makes them (positions far apart: large angles)."""
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = (torch.arange(tokens) * 37.0)[:, None] * inverse[None]
    table = torch.cat((angles, angles), dim=-1)[None]
    return table.cos().to(dtype), table.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim"), [
    (1, 9, 3, 64), (128, 9, 3, 64), (513, 4, 2, 64), (7, 3, 1, 12), (5, 2, 2, 40), (0, 2, 1, 64),
])
def test_rope_kernel_is_apply_rotary_pos_emb(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int,
                                             head_dim: int) -> None:
    """Equal bit for bit: each product and the sum rounded as PyTorch's ops round them (a fused multiply-add
    would differ in the last place), at widths with a vector remainder (40 in AVX-512) and without vectors (12)."""
    generator = torch.Generator().manual_seed(tokens + head_dim)
    queries = (torch.randn(tokens, heads * head_dim, generator=generator) * 3).to(dtype)
    keys = (torch.randn(tokens, kv_heads * head_dim, generator=generator) * 3).to(dtype)
    cos, sin = _rotary(tokens, head_dim, dtype)
    want = modeling_llama.apply_rotary_pos_emb(queries.view(1, tokens, heads, head_dim).transpose(1, 2),
                                               keys.view(1, tokens, kv_heads, head_dim).transpose(1, 2), cos, sin)
    got = kernel_module().rope(queries, keys, cos[0].contiguous(), sin[0].contiguous())
    assert torch.equal(got[0].view(1, tokens, heads, head_dim).transpose(1, 2), want[0])
    assert torch.equal(got[1].view(1, tokens, kv_heads, head_dim).transpose(1, 2), want[1])


def test_rope_kernel_refuses_bad_operands() -> None:
    rope = kernel_module().rope
    cos, sin = _rotary(4, 8, torch.float32)
    with pytest.raises(RuntimeError, match="head_dim even"):
        rope(torch.randn(4, 14), torch.randn(4, 7), cos[0, :, :7].contiguous(), sin[0, :, :7].contiguous())
    with pytest.raises(RuntimeError, match="rows"):
        rope(torch.randn(4, 16).to(torch.bfloat16), torch.randn(4, 8), cos[0], sin[0])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        rope(torch.randn(4, 16).half(), torch.randn(4, 8).half(), cos[0].half(), sin[0].half())


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-sliding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_attention_is_the_modules_forward(name: str, dtype: torch.dtype) -> None:
    """A layer's attention (the model's own SDPA) with the fused rotary embedding: the same output, bit for bit."""
    model = fresh_tiny_model(name, "cpu").to(dtype)
    attention = model.model.layers[1].self_attn
    hidden = torch.randn(1, 37, model.config.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    positions = torch.arange(37)[None] * 5
    with torch.inference_mode():
        rotary = model.model.rotary_emb(hidden, positions)
        want, _ = attention(hidden, rotary, None)
        got, _ = FusedAttention(attention)(hidden, rotary, None)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-sliding"])
def test_a_model_forward_through_fused_attention_is_unchanged(name: str) -> None:
    """With only the attention swapped (norms and MLPs as they are), a float32 forward's logits are the model's own
    bit for bit."""
    model = fresh_tiny_model(name, "cpu")
    ids = torch.tensor([random_prompts([40], seed=3)[0]])
    with torch.inference_mode():
        want = model(ids).logits
        with fused_forward(model):
            layers = model.model.layers
            for layer in layers:
                layer.input_layernorm, layer.post_attention_layernorm = (layer.input_layernorm.own,
                                                                         layer.post_attention_layernorm.own)
                layer.mlp = layer.mlp.own
            model.model.norm = model.model.norm.own
            assert all(isinstance(layer.self_attn, FusedAttention) for layer in layers)
            got = model(ids).logits
    assert torch.equal(got, want)


def _with_globals(function: types.FunctionType, **names: object) -> types.FunctionType:
    """A copy of `function` whose innermost function (through its `functools.wraps` levels: transformers 5.24's
    `deprecate_kwarg` and `kernels`' wrappers around the forwards) reads `names` from its globals."""
    inner = function.__dict__.get("__wrapped__")
    if inner is None:
        return types.FunctionType(function.__code__, {**function.__globals__, **names}, function.__name__,
                                  function.__defaults__, function.__closure__)
    replaced = _with_globals(inner, **names)
    closure = tuple(types.CellType(replaced if cell.cell_contents is inner else cell.cell_contents)
                    for cell in function.__closure__ or ())
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              closure)
    copy.__dict__.update(function.__dict__, __wrapped__=replaced)
    return copy


def test_other_rotary_functions_or_a_cache_keep_the_own_forward() -> None:
    """A class with Llama's forward whose module rotates differently is not fused (a copy reading Llama's is), nor
    one whose rotary function a hub kernel replaced (`kernels`' private wrapper with a forward of its own); a
    forward given a KV cache (`generate`'s), no position embeddings, or run with grad takes the module's own."""
    model = fresh_tiny_model("llama", "cpu")
    attention = model.model.layers[0].self_attn
    assert is_llama_attention(attention)
    other = _with_globals(modeling_llama.LlamaAttention.forward, apply_rotary_pos_emb=lambda *a: a[:2])
    attention.__class__ = type("OtherAttention", (modeling_llama.LlamaAttention,), {"forward": other})
    assert not is_llama_attention(attention)
    same = _with_globals(modeling_llama.LlamaAttention.forward)
    attention.__class__ = type("SameAttention", (modeling_llama.LlamaAttention,), {"forward": same})
    assert is_llama_attention(attention)
    attention.__class__ = modeling_llama.LlamaAttention
    kernelized, own_wrappers = torch.nn.Module(), attention.__dict__.get("_kernel_funcs")
    kernelized.forward = lambda *a: a[:2]  # type: ignore[method-assign]
    attention.__dict__["_kernel_funcs"] = {"apply_rotary_pos_emb": kernelized}
    assert not is_llama_attention(attention)
    attention.__dict__["_kernel_funcs"] = {"apply_rotary_pos_emb": torch.nn.Module()}
    assert is_llama_attention(attention)
    attention.__dict__.pop("_kernel_funcs")
    if own_wrappers is not None:
        attention.__dict__["_kernel_funcs"] = own_wrappers
    fused, calls = FusedAttention(attention), []
    attention.register_forward_pre_hook(lambda *args: calls.append(1))
    hidden = torch.randn(1, 6, model.config.hidden_size)
    rotary = model.model.rotary_emb(hidden, torch.arange(6)[None])
    fused(hidden, rotary, None)
    assert calls == [1]
    with torch.inference_mode():
        fused(hidden, rotary, None, past_key_values=DynamicCache(config=model.config))
        assert calls == [1, 1]
        fused(hidden, rotary, None)
        assert calls == [1, 1]
        with pytest.raises(TypeError):  # no position embeddings: the module's own forward, and its error
            fused(hidden, None, None)
    assert calls == [1, 1, 1]


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-sliding"])
def test_the_attention_function_gets_the_modules_own_arguments(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention function receives what the module's own forward gives it: Qwen2's and Mistral's window too."""
    model = fresh_tiny_model(name, "cpu")
    attention = model.model.layers[0].self_attn
    if name == "qwen2":
        attention.sliding_window = 5
    calls: list[dict[str, object]] = []

    def recording(module: torch.nn.Module, query: torch.Tensor, *args: object, **kwargs: object) -> tuple:
        calls.append(kwargs)
        return query.transpose(1, 2), None

    monkeypatch.setattr(ALL_ATTENTION_FUNCTIONS, "get_interface", lambda name, default: recording)
    hidden = torch.randn(1, 6, model.config.hidden_size)
    with torch.inference_mode():
        rotary = model.model.rotary_emb(hidden, torch.arange(6)[None])
        attention(hidden, rotary, None, marker=3)
        FusedAttention(attention)(hidden, rotary, None, marker=3)
    assert calls[0] == calls[1] and calls[1]["marker"] == 3
    assert calls[1].get("sliding_window") == {"llama": None, "qwen2": 5, "mistral-sliding": 7}[name]
