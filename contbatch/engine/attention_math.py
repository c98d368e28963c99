"""Attention over a padded group's gathered keys (the path without a kernel): SDPA where it computes the layer's
function, written out where SDPA lacks a part of it (soft-capping, attention sinks).

Every function takes q [batch, heads, queries, head_dim], k and v [batch, kv_heads, keys, head_dim] (query head h
reads KV head h // (heads // kv_heads), as transformers' `repeat_kv`) and a boolean mask [batch, 1, queries, keys]
(True: visible), and returns [batch, heads, queries, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_GPU_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float | None,
                    softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The layer's attention: scaled dot products (default scale head_dim^-0.5), soft-capped as softcap *
    tanh(logits / softcap) when `softcap`, and with each head's sink logit `sinks` [heads] in its softmax's
    denominator when given (gpt-oss)."""
    if softcap or sinks is not None:
        return written_attention(q, k, v, mask, scaling, softcap, sinks)
    if q.device.type == "cuda":
        return folded_gqa_attention(q, k, v, mask, scaling)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)


def folded_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scaling: float | None) -> torch.Tensor:
    """SDPA on a GPU with the query heads of each KV head folded into its query length ([batch, kv_heads,
    groups * queries, head_dim]): no K/V is repeated and the memory-efficient kernel takes the mask. cuDNN's
    kernel is left out: it builds a plan for every new shape, about 2 ms of CPU a call."""
    batch, heads, num_queries, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    folded = q.reshape(batch, kv_heads, groups * num_queries, head_dim)
    length = mask.shape[-1]
    mask = mask.unsqueeze(2).expand(batch, 1, groups, num_queries, length).reshape(batch, 1, -1, length)
    with sdpa_kernel(_GPU_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, num_queries, head_dim)


def written_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float | None,
                      softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """`group_attention` written out, as transformers' eager attention computes it: the softmax in float32, a sink
    as one more logit per row whose probability is dropped."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(logits.softmax(-1, dtype=torch.float32).to(v.dtype), v)
    sink = sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
