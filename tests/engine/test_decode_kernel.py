"""The CPU paged decode kernel against attention computed with plain torch ops on gathered K/V."""

from __future__ import annotations

import pytest
import torch

from contbatch.engine.cpu_kernels import kernel_module, paged_decode_kernel

BLOCK = 16


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
              lengths: torch.Tensor, first: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """[B, H, D] attention of each request's query over its positions first..length-1, in float64."""
    batch, heads, _ = query.shape
    group = heads // keys.shape[0]
    out = torch.empty(query.shape, dtype=torch.float64)
    for b in range(batch):
        rows = slots[b, int(first[b]):int(lengths[b])]
        k = keys[:, rows].double().repeat_interleave(group, 0)
        v = values[:, rows].double().repeat_interleave(group, 0)
        logits = torch.einsum("hd,hnd->hn", query[b].double(), k) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        out[b] = torch.einsum("hn,hnd->hd", logits.softmax(-1), v)
    return out


@pytest.mark.parametrize(("kv_heads", "group", "dim", "softcap"), [
    (3, 3, 64, 0.0),   # SmolLM2's shape: the vectorised path
    (2, 1, 128, 0.0),
    (1, 8, 32, 30.0),  # soft-capped logits (Gemma 2)
    (2, 2, 12, 0.0),   # head_dim not a multiple of 8: the scalar path
])
def test_kernel_matches_reference(kv_heads: int, group: int, dim: int, softcap: float) -> None:
    kernel = paged_decode_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(kv_heads * 100 + dim)
    lengths = torch.tensor([1, 7, 8, 9, 16, 17, 40, 203])
    width = int(lengths.max())
    num_blocks = 64
    keys = torch.randn(kv_heads, num_blocks * BLOCK, dim, generator=generator) * 2
    values = torch.randn(kv_heads, num_blocks * BLOCK, dim, generator=generator)
    positions = torch.arange(width)
    tables = torch.randint(0, num_blocks, (len(lengths), -(-width // BLOCK)), generator=generator)
    slots = (tables[:, positions // BLOCK] * BLOCK + positions % BLOCK).contiguous()
    first = torch.tensor([0, 0, 3, 0, 9, 1, 0, 150])  # sliding windows start past 0
    query = torch.randn(len(lengths), kv_heads * group, dim, generator=generator)
    scale = dim**-0.5
    got = kernel(query, keys, values, slots, lengths, first, scale, softcap)
    expected = reference(query, keys, values, slots, lengths, first, scale, softcap)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_kernel_runs_on_every_torch_thread() -> None:
    """ATen's `parallel_for` is inline under OpenMP: built without `-fopenmp`, the kernel runs on one thread."""
    module = kernel_module()
    assert module is not None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert module.parallel_threads() == 2
    finally:
        torch.set_num_threads(threads)
