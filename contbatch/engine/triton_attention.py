"""Paged attention in one Triton kernel: the GPU form of the CPU kernel's contract (`paged_decode_kernel`).

`paged_attention(query, key_cache, value_cache, slots, lengths, first, scale, softcap, queries_per_request)`: query
rows [R, heads, dim], row r of request r // queries_per_request attending to the positions [first[r], lengths[r]) of
that request's slots [B, L] in the cache ([kv_heads, slots, dim] per layer); returns [R, heads, dim] in the
query's dtype (the cache's may differ). Decode rows (one query per request) and a prefill chunk's causal rows
alike; a sliding window is a later `first`; a ragged batch names each row's request (`row_requests`: a varlen
step's every token in one call, `varlen_graphs`). The keys are read straight from the cache by slot: no gathered
copy of K/V, no mask tensor, one launch per attention group, so a step's attention is capturable in a CUDA graph
as it is.

One program per query row and KV head computes that row's query heads of the KV head together (GQA), over key
tiles, with an online softmax in float32. Everything is widened to float32: a float32 model's products run at full
precision (`input_precision "ieee"`: TF32 would break float32 parity with `generate`); a bfloat16 or float16
model's take TF32, exact for their query-key products (TF32 holds their values), the probabilities rounded to
TF32 (finer than the bfloat16 of SDPA's GPU kernels).

Opt-in (`CONTBATCH_ATTENTION_KERNEL=triton`) until a GPU session has run it: on a CUDA model it replaces the
gather of K/V and SDPA, and steps with prompt tokens attend in one ragged group; on a CPU it runs only under
Triton's interpreter (`TRITON_INTERPRET=1`), which is how the test suite checks it without a GPU. `available()`
says whether Triton can be imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

KERNEL_ENV = "CONTBATCH_ATTENTION_KERNEL"
_MIN_DOT = 16


@functools.cache
def available() -> bool:
    """Whether Triton is installed (it comes with torch's CUDA wheels)."""
    return importlib.util.find_spec("triton") is not None


def requested() -> bool:
    """Whether `CONTBATCH_ATTENTION_KERNEL=triton` asks for this kernel."""
    return os.environ.get(KERNEL_ENV, "").strip().lower() == "triton"


def usable_on(device: torch.device) -> bool:
    """Whether the kernel attends on `device`: requested, Triton installed, and a CUDA device, or a CPU under
    Triton's interpreter."""
    if not requested() or not available():
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
                    lengths: torch.Tensor, first: torch.Tensor, scale: float, softcap: float,
                    queries_per_request: int, row_requests: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """See the module's docstring. `row_requests` ([R] int64), when given, names each row's request instead
    (a ragged batch: rows of any request in any order; `queries_per_request` is then ignored). `sinks` ([H]
    float32), when given, adds each head's sink logit to its softmax's denominator (gpt-oss). A row whose range
    is empty gets zeros (a padding row). Raises ValueError on shapes that disagree."""
    rows, heads, dim = query.shape
    kv_heads = key_cache.shape[0]
    if heads % kv_heads or key_cache.shape != value_cache.shape or key_cache.shape[2] != dim:
        raise ValueError(f"query {tuple(query.shape)} does not fit the cache {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)}")
    if row_requests is not None:
        if row_requests.shape != (rows,) or slots.dim() != 2:
            raise ValueError(f"need slots [requests, L] and a request for each of {rows} rows, got "
                             f"{tuple(slots.shape)} and {tuple(row_requests.shape)}")
    elif slots.dim() != 2 or slots.shape[0] * queries_per_request != rows:
        raise ValueError(f"slots {tuple(slots.shape)} for {rows} query rows, {queries_per_request} per request")
    if lengths.shape != (rows,) or first.shape != (rows,):
        raise ValueError(f"need a length and a first position for each of {rows} rows, got "
                         f"{tuple(lengths.shape)} and {tuple(first.shape)}")
    if sinks is not None and (sinks.shape != (heads,) or sinks.dtype != torch.float32):
        raise ValueError(f"need float32 sinks [{heads}], got {sinks.dtype} {tuple(sinks.shape)}")
    group = heads // kv_heads
    output = torch.empty_like(query, memory_format=torch.contiguous_format)
    if rows == 0:
        return output
    key_cache, value_cache, slots = key_cache.contiguous(), value_cache.contiguous(), slots.contiguous()
    block_n = 64 if query.element_size() < 4 else 32
    _kernel(_interpreting())[(rows, kv_heads)](
        query, key_cache, value_cache, output, slots, lengths.contiguous(), first.contiguous(),
        lengths if row_requests is None else row_requests.contiguous(),
        lengths if sinks is None else sinks.contiguous(),
        float(scale), float(softcap), queries_per_request, slots.shape[1],
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        GROUP=group, BLOCK_G=max(_MIN_DOT, _next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_D=max(_MIN_DOT, _next_power_of_2(dim)), BLOCK_N=block_n, SOFTCAP=bool(softcap),
        IEEE=query.dtype == torch.float32, RAGGED=row_requests is not None, SINKS=sinks is not None,
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

    # sizes that change from step to step would otherwise compile a variant each (1, or a multiple of 16)
    return triton.jit(triton_kernels.paged_attention_kernel,
                      do_not_specialize=["queries_per_request", "slots_per_request"])
