"""Paged attention in one Triton kernel: the GPU form of the CPU kernel's contract (`paged_decode_kernel`).

`paged_attention(query, key_cache, value_cache, slots, lengths, first, scale, softcap, queries_per_request)`: query
rows [R, heads, dim], row r of request r // queries_per_request attending to the positions [first[r], lengths[r]) of
that request's slots [B, L] in the cache ([kv_heads, slots, dim] per layer); returns [R, heads, dim] in the
query's dtype. Decode rows (one query per request) and a prefill chunk's causal rows alike; a sliding window is a
later `first`. The keys are read straight from the cache by slot: no gathered copy of K/V, no mask tensor, one
launch per attention group, so a decode step's attention is capturable in a CUDA graph as it is.

One program per query row and KV head computes that row's query heads of the KV head together (GQA), over key
tiles, with an online softmax in float32. Everything is widened to float32: a float32 model's products run at full
precision (`input_precision "ieee"`: TF32 would break float32 parity with `generate`); a bfloat16 or float16
model's take TF32, exact for their query-key products (TF32 holds their values), the probabilities rounded to
TF32 (finer than the bfloat16 of SDPA's GPU kernels).

Opt-in (`CONTBATCH_ATTENTION_KERNEL=triton`) until a GPU session has run it: on a CUDA model it replaces the
gather of K/V and SDPA; on a CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`), which is how the
test suite checks it without a GPU. `available()` says whether Triton can be imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

KERNEL_ENV = "CONTBATCH_ATTENTION_KERNEL"
_MIN_DOT = 16


def available() -> bool:
    """Whether Triton is installed (it comes with torch's CUDA wheels)."""
    return importlib.util.find_spec("triton") is not None


def requested() -> bool:
    """Whether `CONTBATCH_ATTENTION_KERNEL=triton` asks for this kernel."""
    return os.environ.get(KERNEL_ENV, "").strip().lower() == "triton"


def usable_for(query: torch.Tensor) -> bool:
    """Whether the kernel can attend `query` here: requested, Triton installed, and the tensor on a CUDA device,
    or on a CPU under Triton's interpreter."""
    if not requested() or not available():
        return False
    return query.device.type == "cuda" or (query.device.type == "cpu" and _interpreting())


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
                    lengths: torch.Tensor, first: torch.Tensor, scale: float, softcap: float,
                    queries_per_request: int) -> torch.Tensor:
    """See the module's docstring. Every row's range must hold at least one position (a padding row reads its
    last one). Raises ValueError on shapes that disagree."""
    rows, heads, dim = query.shape
    kv_heads = key_cache.shape[0]
    if heads % kv_heads or key_cache.shape != value_cache.shape or key_cache.shape[2] != dim:
        raise ValueError(f"query {tuple(query.shape)} does not fit the cache {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)}")
    if slots.dim() != 2 or slots.shape[0] * queries_per_request != rows:
        raise ValueError(f"slots {tuple(slots.shape)} for {rows} query rows, {queries_per_request} per request")
    if lengths.shape != (rows,) or first.shape != (rows,):
        raise ValueError(f"need a length and a first position for each of {rows} rows, got "
                         f"{tuple(lengths.shape)} and {tuple(first.shape)}")
    group = heads // kv_heads
    output = torch.empty_like(query, memory_format=torch.contiguous_format)
    if rows == 0:
        return output
    key_cache, value_cache, slots = key_cache.contiguous(), value_cache.contiguous(), slots.contiguous()
    block_n = 64 if query.element_size() < 4 else 32
    _kernel(_interpreting())[(rows, kv_heads)](
        query, key_cache, value_cache, output, slots, lengths.contiguous(), first.contiguous(),
        float(scale), float(softcap), queries_per_request, slots.shape[1],
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        GROUP=group, BLOCK_G=max(_MIN_DOT, _next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_D=max(_MIN_DOT, _next_power_of_2(dim)), BLOCK_N=block_n, SOFTCAP=bool(softcap),
        IEEE=query.dtype == torch.float32,
    )
    return output


def _next_power_of_2(value: int) -> int:
    return 1 << (value - 1).bit_length()


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel, for Triton's interpreter or not (Triton decides at decoration), built on first use."""
    del interpret
    import triton

    from contbatch.engine import triton_kernels

    return triton.jit(triton_kernels.paged_attention_kernel)
