"""The fused norm and MLP gating: the same function as the model's own modules (to the last bit or so), swapped in
only for Llama-style modules without hooks, only inside contbatch's eager CPU forwards, and given back after."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from contbatch.engine.cpu_kernels import kernel_module
from contbatch.engine.fused_modules import (
    PLAN_ATTRIBUTE,
    FusedAttention,
    FusedMLP,
    FusedRMSNorm,
    _Plan,
    fused_forward,
    is_llama_mlp,
    is_llama_norm,
)
from tests.helpers import fresh_tiny_model, make_engine, random_prompts, reference_generate, run_engine

pytestmark = pytest.mark.skipif(kernel_module() is None, reason="the CPU kernels are not built here")
DTYPES = [torch.float32, torch.bfloat16]
ROUNDING = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}


def _close(got: torch.Tensor, want: torch.Tensor, ulps: float, tiny: float = 0.0) -> None:
    """Every element within `ulps` units of the dtype's last place of `want` (or `tiny` absolute)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    error = (got.double() - want.double()).abs()
    bound = want.double().abs() * ulps * ROUNDING[want.dtype] + tiny
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (128, 576), (7, 13), (3, 64), (0, 32)])
def test_rms_norm_is_llama_rms_norm(dtype: torch.dtype, rows: int, width: int) -> None:
    torch.manual_seed(rows + width)
    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width))
        x = (torch.randn(rows, width) * torch.logspace(-3, 3, max(rows, 1))[:rows, None]).to(dtype)
        want, got = norm(x), kernel_module().rms_norm(x, norm.weight, 1e-5)
    # float32: the sum of squares in another order moves the scale by an ulp or two; bfloat16: the two roundings
    # then agree but for an element that lands on a rounding boundary
    _close(got, want, 8 if dtype == torch.float32 else 2)
    if dtype == torch.bfloat16:
        assert (got != want).sum() <= max(1, got.numel() // 1000)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (128, 1536), (5, 37), (0, 8)])
def test_silu_mul_is_silu_times_up(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(shape[0] + shape[1])
    gate = torch.randn(shape) * 6
    if gate.numel():
        gate.view(-1)[:6] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 20.0, 100.0])[: gate.numel()]
    gate, up = gate.to(dtype), torch.randn(shape).to(dtype)
    want, got = F.silu(gate) * up, kernel_module().silu_mul(gate, up)
    # exp by a polynomial (about 1 ulp): float32 a few ulps; bfloat16 one rounding; silu(-100) ~ 4e-37, not -0
    _close(got, want, 4 if dtype == torch.float32 else 1, tiny=1e-35)


def test_kernels_refuse_bad_operands() -> None:
    kernels = kernel_module()
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.rms_norm(torch.randn(2, 8, dtype=torch.float16), torch.randn(8, dtype=torch.float16), 1e-6)
    with pytest.raises(RuntimeError, match="up"):
        kernels.silu_mul(torch.randn(2, 8), torch.randn(2, 8).to(torch.bfloat16))


@pytest.mark.parametrize("name,norms,mlps,attentions", [
    ("llama", 5, 2, 2), ("qwen2", 5, 2, 2), ("qwen3", 9, 2, 0), ("mistral-sliding", 5, 2, 2),
    ("gemma3-hybrid", 0, 0, 0), ("gemma2-softcap", 0, 0, 0),
])
def test_which_modules_are_fused(name: str, norms: int, mlps: int, attentions: int) -> None:
    """Llama-style norms (Qwen3's per-head q/k norms too) and SiLU MLPs; Gemma's (1 + weight) norms and GELU MLPs
    keep their own forwards; attention where the forward is Llama's, or Qwen2's or Mistral's (which pass a window),
    not Qwen3's (which normalises q and k)."""
    plan = _Plan.of(fresh_tiny_model(name, "cpu"))
    assert sum(isinstance(swap[3], FusedRMSNorm) for swap in plan.swaps) == norms
    assert sum(isinstance(swap[3], FusedMLP) for swap in plan.swaps) == mlps
    assert sum(isinstance(swap[3], FusedAttention) for swap in plan.swaps) == attentions


def test_hooked_or_other_modules_are_not_fused() -> None:
    model = fresh_tiny_model("llama", "cpu")
    layer = model.model.layers[0]
    assert is_llama_norm(layer.input_layernorm) and is_llama_mlp(layer.mlp)
    layer.input_layernorm.register_forward_hook(lambda *args: None)
    layer.mlp.act_fn = torch.nn.GELU()
    own_forward = layer.post_attention_layernorm.forward
    layer.post_attention_layernorm.forward = lambda x: own_forward(x)  # as accelerate's device hooks do
    assert not is_llama_norm(layer.input_layernorm) and not is_llama_mlp(layer.mlp)
    assert not is_llama_norm(layer.post_attention_layernorm)
    plan = _Plan.of(model)
    skipped = (layer.input_layernorm, layer.mlp, layer.post_attention_layernorm)
    assert not any(own in skipped for _, _, own, _ in plan.swaps) and len(plan.swaps) == 6


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_forward_is_the_models_forward(name: str, dtype: torch.dtype) -> None:
    model = fresh_tiny_model(name, "cpu").to(dtype)
    ids = torch.tensor([random_prompts([40], seed=3)[0]])
    with torch.inference_mode():
        want = model(ids).logits
        with fused_forward(model):
            assert isinstance(model.model.layers[0].mlp, FusedMLP)
            got = model(ids).logits
    assert not isinstance(model.model.layers[0].mlp, FusedMLP)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= (1.0 if dtype == torch.float32 else 0.9)


def test_grad_forward_is_the_own_forward() -> None:
    model = fresh_tiny_model("llama", "cpu")
    ids = torch.tensor([random_prompts([12], seed=4)[0]])
    want = model(ids).logits
    with fused_forward(model):
        got = model(ids).logits
    assert got.requires_grad and torch.equal(got, want)


def test_the_tree_looks_the_same_while_fused() -> None:
    """Another thread sees the same parameter names and objects, reaches every gradient with `zero_grad`, and
    switches the model's own modules with `train`/`eval`."""
    model = fresh_tiny_model("llama", "cpu")
    names = [(name, id(param)) for name, param in model.named_parameters()]
    state = model.state_dict().keys()
    model(torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    own_mlp = model.model.layers[0].mlp
    with fused_forward(model):
        assert isinstance(model.model.layers[0].mlp, FusedMLP)
        assert [(name, id(param)) for name, param in model.named_parameters()] == names
        assert model.state_dict().keys() == state
        assert model.model.layers[0].mlp.intermediate_size == own_mlp.intermediate_size
        model.zero_grad(set_to_none=True)
        model.train()
    assert all(param.grad is None for param in model.parameters())
    assert own_mlp.training and model.model.norm.training


def test_modules_given_back_when_the_forward_fails() -> None:
    model = fresh_tiny_model("llama", "cpu")
    own = model.model.norm, model.model.layers[0].mlp

    def fail(*args: object) -> None:
        raise ValueError("midway")

    model.model.layers[1].self_attn.register_forward_pre_hook(fail)
    with pytest.raises(ValueError, match="midway"), torch.inference_mode(), fused_forward(model):
        assert isinstance(model.model.norm, FusedRMSNorm)
        model(torch.tensor([[5, 6, 7]]))
    assert (model.model.norm, model.model.layers[0].mlp) == own


def test_the_plan_follows_replaced_modules_and_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fresh_tiny_model("llama", "cpu")
    with fused_forward(model):
        pass
    first = model.__dict__[PLAN_ATTRIBUTE]
    model.model.norm = LlamaRMSNorm(model.config.hidden_size)
    with fused_forward(model):
        assert isinstance(model.model.norm, FusedRMSNorm) and model.model.norm.own is not first.swaps[-1][2]
    assert model.__dict__[PLAN_ATTRIBUTE] is not first
    monkeypatch.setenv("CONTBATCH_FUSED_MODULES", "0")
    with fused_forward(model):
        assert isinstance(model.model.norm, LlamaRMSNorm)


def test_the_plan_does_not_keep_the_model_alive_and_copies_with_it() -> None:
    model = fresh_tiny_model("llama", "cpu")
    with fused_forward(model):
        pass
    copied = copy.deepcopy(model)
    modules = {id(module) for module in copied.modules()}
    plan = copied.__dict__[PLAN_ATTRIBUTE]
    assert plan.holds() and all(id(parent) in modules and id(own) in modules for parent, _, own, _ in plan.swaps)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_runs_fused_and_matches_generate(dtype: torch.dtype) -> None:
    """The engine's eager CPU forwards take the fused modules; float32 greedy outputs stay `generate`'s (bfloat16
    ones within the near-tie tolerance that tests/engine/test_bfloat16.py checks, through these modules too)."""
    model = fresh_tiny_model("llama", "cpu").to(dtype)
    calls = {"norm": 0, "mlp": 0, "attention": 0}
    norm_forward, mlp_forward, attention_forward = FusedRMSNorm.forward, FusedMLP.forward, FusedAttention.forward

    def counted(kind: str, forward):  # type: ignore[no-untyped-def]
        def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls[kind] += 1
            return forward(self, *args, **kwargs)
        return wrapper

    prompts = random_prompts([9, 23, 40])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedRMSNorm, "forward", counted("norm", norm_forward))
        patch.setattr(FusedMLP, "forward", counted("mlp", mlp_forward))
        patch.setattr(FusedAttention, "forward", counted("attention", attention_forward))
        engine = make_engine(model)
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, request_id=str(index))
        outputs = run_engine(engine)
    assert calls["norm"] > 0 and calls["mlp"] > 0 and calls["attention"] > 0
    assert all(len(outputs[str(index)].generated_tokens) == 8 for index in range(len(prompts)))
    if dtype == torch.float32:
        for index, prompt in enumerate(prompts):
            assert outputs[str(index)].generated_tokens == reference_generate(model, prompt, 8)


def test_other_dtypes_take_the_own_forward() -> None:
    """A float32 norm fed bfloat16 (autocast-style mixing) or a float16 model: the model's own modules run."""
    norm = LlamaRMSNorm(16)
    fused = FusedRMSNorm(norm)
    with torch.inference_mode():
        for x in (torch.randn(3, 16).to(torch.bfloat16), torch.randn(3, 16).half()):
            assert torch.equal(fused(x), norm(x))
        half = fresh_tiny_model("llama", "cpu").half()
        ids = torch.tensor([[5, 6, 7]])
        want = half(ids).logits
        with fused_forward(half):
            assert torch.equal(half(ids).logits, want)
