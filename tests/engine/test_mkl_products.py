"""MKL's packed copies of float32 layer weights for full prompt steps (`mkl_products`): used only for the rows they
were packed for, the same function as `F.linear`, never stale, counted in the memory the packed copies take, and
given up where they do not fit or are turned off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from contbatch.engine import mkl_products, packed_weights
from contbatch.engine.packed_weights import PackedLinear, packed_forward, pending_packed_bytes
from tests.helpers import fresh_tiny_model

pytestmark = pytest.mark.skipif(not (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()),
                                reason="needs MKL and oneDNN")
LIMIT, FULL = 8, 12
"""The layers' packed copies serve up to LIMIT rows; a full step has FULL."""


@pytest.fixture(autouse=True)
def mkl_layers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every CPU here as an Intel one (`mkl_is_fast`) whose float32 layers take oneDNN's copy up to LIMIT rows."""
    monkeypatch.setattr(mkl_products, "mkl_is_fast", lambda: True)
    monkeypatch.setattr(packed_weights, "_layer_kind", lambda linear: (LIMIT, False))
    yield


def _layers(model: nn.Module) -> list[nn.Linear]:
    head = model.get_output_embeddings()
    return [m for m in model.modules() if type(m) is nn.Linear and m is not head]


def _copies(model: nn.Module) -> list[bool]:
    return [mkl_products.packed(PackedLinear.for_linear(m, LIMIT).handle) for m in _layers(model)]


def _logits(model: nn.Module, rows: int, step_rows: int) -> torch.Tensor:
    ids = torch.arange(1, rows + 1)[None]
    with torch.no_grad(), packed_forward(model, step_rows):
        return model(ids, use_cache=False).logits


def test_a_full_step_packs_and_uses_the_copies() -> None:
    model = fresh_tiny_model("llama")
    with torch.no_grad():
        reference = model(torch.arange(1, FULL + 1)[None], use_cache=False).logits
    layers = sum(m.weight.nbytes for m in _layers(model))
    head = model.get_output_embeddings().weight.nbytes
    assert pending_packed_bytes(model) == head + 2 * layers  # oneDNN's copies and MKL's
    torch.testing.assert_close(_logits(model, FULL - 1, FULL), reference[:, :FULL - 1], rtol=1e-5, atol=1e-5)
    assert not any(_copies(model))  # not a full step: the plain weight
    assert pending_packed_bytes(model) == layers
    torch.testing.assert_close(_logits(model, FULL, FULL), reference, rtol=1e-5, atol=1e-5)
    assert all(_copies(model)) and pending_packed_bytes(model) == 0


def test_the_copy_is_the_product_of_f_linear() -> None:
    linear = nn.Linear(48, 40, bias=True)
    packed = PackedLinear.for_linear(linear, LIMIT)
    packed.refresh()
    mkl_products.aim(packed.handle, FULL)
    x = torch.randn(1, FULL, 48)
    with torch.no_grad():
        expected = F.linear(x, linear.weight, linear.bias)
        torch.testing.assert_close(packed(x), expected, rtol=1e-6, atol=1e-6)
        assert mkl_products.packed(packed.handle)
        torch.testing.assert_close(packed(x.transpose(0, 1).contiguous().transpose(0, 1)), expected)
        linear.weight.mul_(-1.0)  # in place: the next forward's refresh drops the copy
        packed.refresh()
        assert not mkl_products.packed(packed.handle)
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-6, atol=1e-6)
        mkl_products.aim(packed.handle, FULL + 1)  # aimed elsewhere: the copy for FULL rows goes
        assert not mkl_products.packed(packed.handle)


def test_weights_changed_in_training_are_never_served_stale() -> None:
    model = fresh_tiny_model("llama")
    _logits(model, FULL, FULL)
    assert all(_copies(model))
    with torch.no_grad():
        for linear in _layers(model):
            linear.weight.mul_(0.5)
        reference = model(torch.arange(1, FULL + 1)[None], use_cache=False).logits
    torch.testing.assert_close(_logits(model, FULL, FULL), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["turned off", "does not fit", "not intel"])
def test_no_copies(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fresh_tiny_model("llama")
    layers = sum(m.weight.nbytes for m in _layers(model))
    memory = packed_weights.os.sysconf("SC_PAGE_SIZE") * packed_weights.os.sysconf("SC_PHYS_PAGES")
    if how == "turned off":
        monkeypatch.setenv(mkl_products.ENV, "0")
    elif how == "does not fit":  # oneDNN's copies fit, not twice their bytes
        monkeypatch.setattr(packed_weights, "LAYER_MEMORY_SHARE", 1.5 * layers / memory)
    else:
        monkeypatch.setattr(mkl_products, "mkl_is_fast", lambda: False)
    assert pending_packed_bytes(model) == model.get_output_embeddings().weight.nbytes + layers
    _logits(model, FULL, FULL)
    assert not any(_copies(model)) and pending_packed_bytes(model) == 0
