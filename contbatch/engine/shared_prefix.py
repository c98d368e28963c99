"""One prompt's keys and values shared by many continuations, in a training forward (with autograd).

A forward over the prompt passes a recording `SharedPrefix` as the keyword `SHARED_PREFIX_KWARG`: each layer's
attention stores its keys and values, then attends as usual. A forward over the continuations (rows x tokens,
positions after the prompt's) passes the reading `SharedPrefix` of the same record: each layer's attention puts the
prompt's keys and values in front of the rows' own, and every query sees the whole prompt and its row's causal
past (within the layer's sliding window, if any). The prompt is computed once; the gradient of its keys and values
is the sum over the rows that read them.

Both forwards may be activation-checkpointed (non-reentrant): a recomputed layer records or reads the same tensors
again. It needs a model contbatch is attached to whose own attention is "sdpa" or "eager" (`supports_shared_prefix`);
the attention function dispatches here when it sees the keyword.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from contbatch.engine.attention_types import AttentionModule, visible_keys

SHARED_PREFIX_KWARG = "contbatch_shared_prefix"
SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class SharedPrefix:
    """A record of `length` prompt positions (layer index -> keys, values [1, kv_heads, length, head_dim]);
    `recording` says which forward this object is passed to."""

    length: int
    recording: bool
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def reader(self) -> SharedPrefix:
        """The object to pass to the continuations' forward, over this record."""
        return SharedPrefix(self.length, recording=False, layers=self.layers)


def shared_prefix_attention(own: Callable[..., Any], own_name: str, module: AttentionModule, query: torch.Tensor,
                            key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                            prefix: SharedPrefix, *args: Any, **kwargs: Any) -> Any:
    """transformers' attention-function contract, around the model's own attention function `own` (named
    `own_name`): records this layer's keys and values, or attends the continuations over prefix + their own."""
    if prefix.recording:
        prefix.layers[module.layer_idx] = (key, value)
        return own(module, query, key, value, attention_mask, *args, **kwargs)
    if own_name not in SUPPORTED_ATTENTION:
        raise ValueError(f"a shared-prefix forward needs 'sdpa' or 'eager' attention, the model has {own_name!r}")
    prefix_keys, prefix_values = prefix.layers[module.layer_idx]
    rows = query.shape[0]
    key = torch.cat([prefix_keys.expand(rows, -1, -1, -1), key], dim=2)
    value = torch.cat([prefix_values.expand(rows, -1, -1, -1), value], dim=2)
    mask = continuation_mask(prefix.length, query.shape[2], kwargs.get("sliding_window"), query.device)
    if own_name == "eager":
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    return own(module, query, key, value, mask, *args, **kwargs)


def continuation_mask(prefix_length: int, num_queries: int, sliding_window: int | None,
                      device: torch.device) -> torch.Tensor:
    """[1, 1, num_queries, prefix_length + num_queries] bool: query i (position prefix_length + i) sees key j
    iff j <= prefix_length + i and, with a window W, j > prefix_length + i - W."""
    queries = torch.arange(num_queries, device=device).unsqueeze(1) + prefix_length
    keys = torch.arange(prefix_length + num_queries, device=device).unsqueeze(0)
    return visible_keys(keys, queries, sliding_window)[None, None]
