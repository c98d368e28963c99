"""`PagedKVCache`: the physical per-layer K/V storage, and how many blocks fit in memory."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one token's K/V in every layer of a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model_config(cls, config: PretrainedConfig, dtype: torch.dtype) -> KVCacheSpec:
        config = config.get_text_config()
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, dtype)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def uniform_sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window when every layer slides (e.g. Mistral), else None (full or hybrid models)."""
    config = config.get_text_config()
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and any(kind != "sliding_attention" for kind in layer_types)):
        return None
    return int(window)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on `device`: free GPU memory after the model is loaded, or the available RAM on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_blocks_for_memory(spec: KVCacheSpec, block_size: int, memory_bytes: int, percent: float) -> int:
    """How many blocks fit in `percent` of `memory_bytes`."""
    return max(1, int(memory_bytes * percent) // (spec.bytes_per_token() * block_size))


class PagedKVCache:
    """K and V of every layer, in blocks of `block_size` token slots.

    Layer `l`'s keys are `keys[l]`, shaped `[num_kv_heads, num_blocks * block_size, head_dim]`: slot
    `block_id * block_size + offset` holds the token at `offset` in block `block_id`. Slots are flat so that one
    `index_select` gathers a whole batch's context; heads come first so that one request's keys of one head lie
    contiguous within a block, which the decode kernel reads directly.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (spec.num_layers, 2, spec.num_kv_heads, num_blocks * block_size, spec.head_dim)
        # torch.empty: pages are only touched when written, so a large cache costs what it holds.
        self._storage = torch.empty(shape, dtype=spec.dtype, device=device)
        self.keys = [self._storage[layer, 0] for layer in range(spec.num_layers)]
        self.values = [self._storage[layer, 1] for layer in range(spec.num_layers)]

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stores `key`/`value` ([num_kv_heads, num_tokens, head_dim]) of `layer` at `slot_mapping`."""
        self.keys[layer].index_copy_(1, slot_mapping, key.to(self.spec.dtype))
        self.values[layer].index_copy_(1, slot_mapping, value.to(self.spec.dtype))

    def gather(self, layer: int, slots: torch.Tensor, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` ([batch * length]) as [batch, num_kv_heads, length, head_dim] views."""
        shape = (self.spec.num_kv_heads, batch, length, self.spec.head_dim)
        keys = self.keys[layer].index_select(1, slots).view(shape).transpose(0, 1)
        values = self.values[layer].index_select(1, slots).view(shape).transpose(0, 1)
        return keys, values
