"""A cache whose layers' keys differ in shape (Gemma 4: larger heads in its full-attention layers): each shape's
groups get block positions of their own, each layer's keys and values are `[heads, slots, head_dim]` of its
shape, and no layer's block shares memory with another layer's or another block's."""

from __future__ import annotations

import mmap

import torch
from transformers import Gemma3TextConfig

from contbatch.engine.kv_cache import KVCacheGroup, KVCacheSpec, PagedKVCache, block_positions, kv_cache_groups

CPU = torch.device("cpu")
SHAPES = ((2, 16), (1, 32), (2, 16), (1, 32), (2, 16), (2, 16))
SPEC = KVCacheSpec(num_layers=6, num_kv_heads=2, head_dim=16, dtype=torch.float32, layer_shapes=SHAPES)
CONFIG = Gemma3TextConfig(num_hidden_layers=6, sliding_window=8, layer_types=[
    "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention",
    "sliding_attention"])


def test_groups_split_by_shape_and_shapes_take_positions_of_their_own() -> None:
    groups = kv_cache_groups(CONFIG, SPEC)
    assert groups == [KVCacheGroup((1, 3), None), KVCacheGroup((0, 2), 8), KVCacheGroup((4, 5), 8)]
    assert block_positions(SPEC, groups) == ({(1, 32): 0, (2, 16): 2}, 4)
    uniform = KVCacheSpec(num_layers=6, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    assert block_positions(uniform, kv_cache_groups(CONFIG, uniform))[1] == 2


GROUP_OF = {1: 0, 3: 0, 0: 1, 2: 1, 4: 2, 5: 2}
"""Each layer's group: layers of one shape in different groups share positions, never block ids."""


def test_every_layers_blocks_are_its_own_memory() -> None:
    cache = PagedKVCache(SPEC, num_blocks=6, block_size=4, device=CPU, groups=kv_cache_groups(CONFIG, SPEC))
    assert [tuple(keys.shape) for keys in cache.keys] == [(2, 28, 16), (1, 28, 32)] * 2 + [(2, 28, 16)] * 2
    assert all(plane.is_contiguous() for plane in [*cache.keys, *cache.values])
    cache._storage.zero_()
    written = {}
    for layer in range(6):  # a group holds blocks g and g + 3: each layer writes its own values into both
        heads, head_dim = SHAPES[layer]
        for block in (GROUP_OF[layer], GROUP_OF[layer] + 3):
            key = torch.full((heads, 4, head_dim), 10.0 * layer + block)
            cache.write(layer, torch.arange(block * 4, block * 4 + 4), key, -key)
            written[layer, block] = key
    for (layer, block), key in written.items():
        slots = slice(block * 4, block * 4 + 4)
        assert torch.equal(cache.keys[layer][:, slots], key) and torch.equal(cache.values[layer][:, slots], -key)


def test_copy_blocks_and_commit_reach_every_layer_in_its_shape() -> None:
    cache = PagedKVCache(SPEC, num_blocks=6, block_size=4, device=CPU, groups=kv_cache_groups(CONFIG, SPEC))
    cache._storage.fill_(7.0)
    for layer in (1, 3, 0, 2):  # groups 0 and 1: their layers hold every position
        cache.keys[layer][:, 4:8] = layer + 1.0
        cache.values[layer][:, 4:8] = -layer - 1.0
    cache.copy_blocks([(1, 4)])
    for layer in (1, 3, 0, 2):
        assert bool((cache.keys[layer][:, 16:20] == layer + 1).all())
        assert bool((cache.values[layer][:, 16:20] == -layer - 1).all())
    cache.commit(2, 4)
    step = mmap.PAGESIZE // 4
    for layer in range(6):
        for plane in (cache.keys[layer], cache.values[layer]):
            assert bool((plane[:, :4] == 7).all()) and bool((plane[:, 16:] != 0).all()), "outside: untouched"
            touched = plane[:, 8:16].flatten(1)
            assert int((touched == 0).sum()) == touched.shape[0] * -(-touched.shape[1] // step)
