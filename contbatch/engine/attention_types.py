"""How each kind of attention layer uses its blocks: the policies `KVCacheManager` coordinates, one per group.

A policy answers, for one layer group, the three questions whose answer depends on the kind of attention:
how many blocks a request holds at most, which blocks a query can still see (the others are given back), and
which blocks a cached prefix must have for a request to start after it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class AttentionModule(Protocol):
    """What contbatch reads of the module transformers passes to an attention function: its layer's index and
    its model's config."""

    layer_idx: int
    config: PretrainedConfig


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class FullAttention:
    """Every query sees every earlier token: a request keeps all its blocks."""

    block_size: int

    @property
    def sliding_window(self) -> int | None:
        return None

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request growing to `num_tokens` tokens, `max_chunk` a step, holds at once."""
        return _blocks(num_tokens, self.block_size)

    def num_unreachable_blocks(self, num_computed_tokens: int) -> int:
        """How many leading blocks no query from position `num_computed_tokens` on can see."""
        return 0

    def first_needed_block(self, num_prefix_blocks: int) -> int:
        """The first block a request starting after a cached prefix of `num_prefix_blocks` blocks must have."""
        return 0


@dataclass(frozen=True)
class SlidingWindow(FullAttention):
    """A query at position q sees keys from q - window + 1 on: blocks behind every future query's window are
    given back, so a request holds about `window / block_size + 1` blocks however long it grows."""

    window: int = 1

    @property
    def sliding_window(self) -> int | None:
        return self.window

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The window before a chunk, the chunk, and a partial block at each end."""
        return min(_blocks(num_tokens, self.block_size), _blocks(self.window - 1 + max_chunk, self.block_size) + 1)

    def num_unreachable_blocks(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def first_needed_block(self, num_prefix_blocks: int) -> int:
        return max(0, num_prefix_blocks * self.block_size - self.window + 1) // self.block_size


def visible_keys(key_positions: torch.Tensor, query_positions: torch.Tensor,
                 sliding_window: int | None) -> torch.Tensor:
    """Bool, broadcast over the two position tensors: a query at position q sees a key at position k iff k <= q
    and, with a window W, k > q - W (transformers' sliding-window mask)."""
    allowed = key_positions <= query_positions
    if sliding_window is not None:
        allowed &= key_positions > query_positions - sliding_window
    return allowed


def attention_policy(block_size: int, window: int | None) -> FullAttention:
    """The policy of a group whose layers attend within `window` tokens (None: full attention)."""
    return FullAttention(block_size) if window is None else SlidingWindow(block_size, window)


TWIN_KEY_TOLERANCE = 0.05
"""Two equal tokens at one position whose keys differ by more than this share of the keys' largest magnitude were
numbered apart by the model itself: far above rounding (bfloat16's is 0.4%), far below what one position of RoPE or
a learned position embedding moves."""


@dataclass
class KVShapeProbe:
    """Passed as the attention metadata of a probing forward (`kv_probe.probe_layers`): each layer's attention call
    records the layer's `(key/value heads, key head size, value head size)` in `shapes`, counts it in `calls`, and
    returns zeros of its output's shape, attending nothing. In a forward of equal tokens given one position, a
    layer whose keys differ between the tokens (`TWIN_KEY_TOLERANCE`) goes into `renumbered`: the model told the
    tokens apart by something else than their id and position (it numbers them itself, or mixes tokens outside
    its attention)."""

    shapes: dict[int, tuple[int, int, int]]
    renumbered: set[int] = field(default_factory=set)
    calls: Counter[int] = field(default_factory=Counter)

    def record(self, module: object, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Records the call of `module` (a layer without a `layer_idx` is not recorded); returns
        [batch, tokens, heads, value head size] zeros."""
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int):
            self.shapes[layer] = (key.shape[1], key.shape[-1], value.shape[-1])
            self.calls[layer] += 1
            if key.shape[2] > 1 and _twins_differ(key.detach().float()):
                self.renumbered.add(layer)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


def _twins_differ(key: torch.Tensor) -> bool:
    """Whether `key` [batch, heads, tokens, head size] differs between its tokens beyond `TWIN_KEY_TOLERANCE`."""
    scale = float(key.abs().max())
    return float((key - key[:, :, :1]).abs().max()) > TWIN_KEY_TOLERANCE * max(scale, 1e-6)
