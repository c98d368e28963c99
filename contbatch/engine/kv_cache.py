"""`PagedKVCache`: the physical per-layer K/V storage, its layer groups, and how many blocks fit in memory."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
from transformers import PretrainedConfig

from contbatch.engine.cpu_kernels import kv_row_writer


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one token's K/V in one layer of a model: `num_kv_heads` heads of `head_dim`, or, where the
    layers differ (Gemma 4's full-attention layers take larger heads), each layer's `(heads, head_dim)` in
    `layer_shapes`, and `num_kv_heads` x `head_dim` the largest of them (the size of a layer's slice of a block).

    `value_head_dim`: the values' head size where it is smaller than the keys' (multi-head latent attention:
    DeepSeek-V2/V3's keys take 192 dimensions, their values 128), else None. Values are stored in planes of the
    keys' shape, zero-padded (`PagedKVCache.write`), so that every attention kernel reads one head size; the
    attention's output is cut back to the values' size.

    `measured`: the shapes are what the layers computed in a probing forward (`kv_probe`), not the config's."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layer_shapes: tuple[tuple[int, int], ...] = ()
    value_head_dim: int | None = None
    measured: bool = False

    def shape_of(self, layer: int) -> tuple[int, int]:
        """`layer`'s (key/value heads, key head size)."""
        return self.layer_shapes[layer] if self.layer_shapes else (self.num_kv_heads, self.head_dim)

    def value_dim_of(self, layer: int) -> int:
        """`layer`'s value head size (its key head size unless `value_head_dim` says otherwise)."""
        return self.value_head_dim or self.shape_of(layer)[1]

    @classmethod
    def from_model_config(cls, config: PretrainedConfig, dtype: torch.dtype) -> KVCacheSpec:
        """The spec a config states for layers that are alike (the engine takes the shapes its probing forward
        measures, `kv_probe`, and this where that fails). Multi-head latent attention (a config with `kv_lora_rank`,
        `qk_nope_head_dim` and `qk_rope_head_dim`: DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite...) expands its latent
        into keys and values of every attention head: `num_attention_heads` heads of `qk_head_dim` (nope + rope)
        for keys, of `v_head_dim` for values, whatever `num_key_value_heads` and `head_dim` (the rotary part)
        say. Elsewhere a `v_head_dim` other than `head_dim` is the values' size (MiMo-V2-Flash)."""
        config = config.get_text_config()
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        value_dim = getattr(config, "v_head_dim", None)
        nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
        if getattr(config, "kv_lora_rank", None) and nope is not None and rope is not None:
            num_kv_heads, head_dim = num_heads, getattr(config, "qk_head_dim", None) or nope + rope
        value_dim = value_dim if isinstance(value_dim, int) and value_dim != head_dim else None
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, dtype, value_head_dim=value_dim)

    def bytes_per_block(self, block_size: int, layers_per_block: int) -> int:
        return 2 * layers_per_block * self.num_kv_heads * self.head_dim * self.dtype.itemsize * block_size


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that keep the same tokens, so they share one block table per request.

    Attributes:
        layers: the model's layer indices; layer `layers[i]` stores its K/V at position `i` of a block.
        sliding_window: the attention window of these layers, or None for full attention.
    """

    layers: tuple[int, ...]
    sliding_window: int | None = None


def attending_layers(config: PretrainedConfig) -> list[int]:
    """The indices of the layers of `config`'s text model that attend over the tokens: all but those its
    `cross_attention_layers` lists (Mllama's, which attend to an image's states, and which a forward without an
    image skips: contbatch's requests are text), which take no KV cache."""
    config = config.get_text_config()
    skipped = set(getattr(config, "cross_attention_layers", None) or ())
    return [layer for layer in range(config.num_hidden_layers) if layer not in skipped]


@dataclass(frozen=True)
class RepeatedCalls:
    """Cache layers for the attention calls a layer makes beyond its first in one forward (DiffLlama's layers attend
    twice, over two halves of their values; Dory's recurrent layers once a loop): `extra[layer]` holds the cache
    layers of calls 2, 3, ... of model layer `layer`, numbered after the model's layers, and `source[i]` is the
    model layer of cache layer `i`. A call's keys and values stay apart from the other calls' (a layer called twice
    takes twice its cache)."""

    extra: dict[int, tuple[int, ...]] = field(default_factory=dict)
    source: tuple[int, ...] = ()

    @classmethod
    def of(cls, num_layers: int, calls: Mapping[int, int]) -> RepeatedCalls:
        """The cache layers of a model of `num_layers` layers whose layer `i` attends `calls[i]` times a forward (1
        where absent)."""
        extra: dict[int, tuple[int, ...]] = {}
        source = list(range(num_layers))
        for layer in sorted(layer for layer, count in calls.items() if count > 1 and 0 <= layer < num_layers):
            extra[layer] = tuple(range(len(source), len(source) + calls[layer] - 1))
            source += [layer] * (calls[layer] - 1)
        return cls(extra, tuple(source) if extra else ())

    def spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """`spec` of the model's layers extended to the cache layers."""
        if not self.extra:
            return spec
        shapes = tuple(spec.shape_of(layer) for layer in self.source) if spec.layer_shapes else ()
        return replace(spec, num_layers=len(self.source), layer_shapes=shapes)


def kv_cache_groups(config: PretrainedConfig, spec: KVCacheSpec | None = None,
                    repeats: RepeatedCalls | None = None) -> list[KVCacheGroup]:
    """The model's attending layers (`attending_layers`), and the cache layers of their repeated calls (`repeats`,
    each of its layer's kind), split into groups of one attention kind (full, or one sliding window) and, with
    `spec`, one key shape (`KVCacheSpec.shape_of`), all groups of the same size but the last of each kind,
    full-attention groups first.

    A model whose layers are all alike is one group. A hybrid model (Gemma 2/3: sliding and full layers) gets
    groups of `min(count of each kind)` layers, so that one block of the pool, which holds `block_size` tokens of
    one group, has the same size for every group; sliding groups then hold only a window's worth of blocks.
    """
    attending = attending_layers(config)
    config = config.get_text_config()
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # e.g. Mistral: the config's window applies to every layer
        layer_types = ["sliding_attention" if window else "full_attention"] * num_layers
    extra = repeats.extra if repeats is not None else {}
    by_kind: dict[tuple[int | None, tuple[int, int]], list[int]] = {}
    cache_layers = [(cache_layer, layer) for layer in attending if layer < len(layer_types)
                    for cache_layer in (layer, *extra.get(layer, ()))]
    for layer, model_layer in cache_layers:
        kind = layer_types[model_layer]
        shape = spec.shape_of(layer) if spec is not None else (0, 0)
        by_kind.setdefault((int(window) if window and kind == "sliding_attention" else None, shape), []).append(layer)
    if len(by_kind) == 1:
        ((only_window, _), layers), = by_kind.items()
        return [KVCacheGroup(tuple(layers), only_window)]
    size = min(len(layers) for layers in by_kind.values())
    kinds = sorted(by_kind.items(), key=lambda item: (-1 if item[0][0] is None else item[0][0], item[0][1]))
    return [KVCacheGroup(tuple(layers[start:start + size]), kind_window)
            for (kind_window, _), layers in kinds for start in range(0, len(layers), size)]


def block_positions(spec: KVCacheSpec, groups: list[KVCacheGroup]) -> tuple[dict[tuple[int, int], int], int]:
    """Where each key shape's layers start in a block, and how many positions a block has (each layer takes one
    position, a slice of a block the size of the spec's largest shape): the groups of one shape share its
    positions, as their block ids differ; shapes get positions of their own, so that two layers' views of one
    position never differ in shape."""
    starts: dict[tuple[int, int], int] = {}
    total = 0
    for shape in dict.fromkeys(spec.shape_of(group.layers[0]) for group in groups):
        starts[shape] = total
        total += max(len(group.layers) for group in groups if spec.shape_of(group.layers[0]) == shape)
    return starts, total


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


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_host_heap() -> None:
    """Gives the C heap's free pages back to the OS (glibc's `malloc_trim`; nothing elsewhere). The engine
    thread allocates from a glibc arena of its own, which keeps the memory its steps freed: without a trim, a
    trainer's process holds that memory (about 1 GiB in a GRPO step of the 135M model) through the training step."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def num_blocks_for_memory(spec: KVCacheSpec, groups: list[KVCacheGroup], block_size: int, memory_bytes: int,
                          percent: float) -> int:
    """How many blocks fit in `percent` of `memory_bytes`."""
    _, layers_per_block = block_positions(spec, groups)
    return max(1, int(memory_bytes * percent) // spec.bytes_per_block(block_size, layers_per_block))


RESIDENT_GIB_ENV = "CONTBATCH_CPU_CACHE_RESIDENT_GIB"
DEFAULT_RESIDENT_GIB = 4.0


def resident_block_limit(cache: PagedKVCache) -> int | None:
    """The pool's `touch_limit` for `cache`: on CPU, the blocks of `CONTBATCH_CPU_CACHE_RESIDENT_GIB` GiB
    (default 4, vLLM-CPU's default KV space), past which cached prefixes are evicted before new memory is
    touched; None elsewhere (a GPU cache is committed when allocated). A CPU cache is `torch.empty`: its pages
    are committed as they are first written, each new page a fault (about 1-5 us here), and a cache sized at 80%
    of the RAM would otherwise fill all of it with cached content over a long run."""
    if cache.device.type != "cpu":
        return None
    value = os.environ.get(RESIDENT_GIB_ENV, "")
    try:
        gib = float(value) if value else DEFAULT_RESIDENT_GIB
    except ValueError:
        raise ValueError(f"{RESIDENT_GIB_ENV} must be a number of GiB, got {value!r}") from None
    if not (gib > 0 and math.isfinite(gib)):
        raise ValueError(f"{RESIDENT_GIB_ENV} must be > 0, got {value!r}")
    return max(1, int(gib * 2**30) // cache.spec.bytes_per_block(cache.block_size, cache.shape[0]))


class PagedKVCache:
    """K and V of every layer, in blocks of `block_size` token slots.

    Every block has room for `layers_per_block` layers (the size of the largest group); the layers of one group
    hold the same block ids, and a block id is held by one group at a time. Layer `l`'s keys are `keys[l]`,
    shaped `[num_kv_heads, (num_blocks + 1) * block_size, head_dim]`: slot `block_id * block_size + offset` holds
    the token at `offset` in block `block_id`. The block past the pool's is scratch space: `scratch_slot` takes the
    K/V of padding tokens (`cuda_graphs`), which no block table ever points at. Layers at the same position of
    different groups share that tensor (their block ids differ). Slots are flat so that one `index_select` gathers
    a whole batch's context; heads come first so that one request's keys of one head lie contiguous within a
    block, as the decode kernel reads.

    Memory: `release()` gives the storage back and `allocate()` makes it again (see both); while released, the
    cache holds no tensor memory, `keys` and `values` are empty, and no other method may be called.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device,
                 groups: list[KVCacheGroup] | None = None, repeats: RepeatedCalls | None = None) -> None:
        """`spec` and `groups` are of cache layers: the model's, and those of `repeats` (whose `extra` the attention
        function reads as `repeated_calls`)."""
        self.spec = spec
        self.repeated_calls = repeats.extra if repeats is not None else {}
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.groups = groups or [KVCacheGroup(tuple(range(spec.num_layers)))]
        self.layers = tuple(sorted(layer for group in self.groups for layer in group.layers))
        self._starts, positions = block_positions(spec, self.groups)
        self.shape = (positions, 2, spec.num_kv_heads, (num_blocks + 1) * block_size, spec.head_dim)
        self.scratch_slot = num_blocks * block_size
        self.layer_group = [0] * spec.num_layers
        for index, group in enumerate(self.groups):
            for layer in group.layers:
                self.layer_group[layer] = index
        self._storage = torch.empty(0, dtype=spec.dtype, device=self.device)
        self._row_writer = kv_row_writer() if self.device.type == "cpu" else None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.allocate()

    @property
    def is_allocated(self) -> bool:
        """False between `release()` and the next `allocate()`."""
        return bool(self.keys)

    @property
    def storage_address(self) -> int:
        """The address of the storage (0 while released): it changes when `allocate()` makes a new one."""
        return self._storage.data_ptr() if self.is_allocated else 0

    @property
    def nbytes(self) -> int:
        """The size of the storage when allocated."""
        return math.prod(self.shape) * self.spec.dtype.itemsize

    def allocate(self) -> None:
        """Makes the storage (`shape`, the spec's dtype, `device`) and the per-layer views; does nothing when
        allocated. The content is undefined: blocks must be written before they are read, which the block tables
        guarantee for an empty prefix cache. The storage is `torch.empty`, so pages are only touched when written
        and a large cache costs what it holds. On CUDA the caching allocator's free segments are given back
        first, so that the storage is not carved from a cached segment that later tensors would share: such a
        segment never goes back to the driver, and `release()` could not give the cache's memory back."""
        if self.is_allocated:
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        storage = torch.empty(self.shape, dtype=self.spec.dtype, device=self.device)
        keys = [storage[0, 0]] * self.spec.num_layers
        values = [storage[0, 1]] * self.spec.num_layers
        for group in self.groups:
            shape = self.spec.shape_of(group.layers[0])
            for position, layer in enumerate(group.layers, self._starts[shape]):
                keys[layer] = self._plane(storage, position, 0, shape)
                values[layer] = self._plane(storage, position, 1, shape)
        self._storage, self.keys, self.values = storage, keys, values

    def _plane(self, storage: torch.Tensor, position: int, kind: int, shape: tuple[int, int]) -> torch.Tensor:
        """The keys (`kind` 0) or values (1) of the layers at `position` of a block, as `[heads, slots, head_dim]`
        of `shape`: the start of the position's slice where the shape is smaller than the largest."""
        plane = storage[position, kind]
        if shape == (self.spec.num_kv_heads, self.spec.head_dim):
            return plane
        heads, head_dim = shape
        return plane.view(-1)[: heads * plane.shape[1] * head_dim].view(heads, plane.shape[1], head_dim)

    def _planes(self) -> list[torch.Tensor]:
        """One view per position of a block and keys or values, in its layers' shape."""
        planes = {plane.data_ptr(): plane for group in self.groups for layer in group.layers
                  for plane in (self.keys[layer], self.values[layer])}
        return list(planes.values())

    def release(self) -> None:
        """Drops the storage and every view of it, so its memory goes back: to the OS on CPU (a large tensor is
        its own mapping), to the driver on CUDA (the caching allocator's unused blocks are emptied); the host heap
        is trimmed too (`trim_host_heap`). Every block's content is lost: the caller must make sure no block is
        held and nothing cached is reused (the engine empties the prefix cache first). Idempotent; `allocate()`
        makes a new storage."""
        if not self.is_allocated:
            return
        self._storage = torch.empty(0, dtype=self.spec.dtype, device=self.device)
        self.keys, self.values = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        trim_host_heap()

    def commit(self, first: int, last: int) -> None:
        """Commits the memory of blocks `[first, last)` (clamped to the pool's) of every layer, so that writing
        them later costs no page faults: a CPU cache's pages are otherwise committed as they are first written,
        inside the step that writes them (1-20 us a page on the VMs measured, docs/performance.md). One element
        per page is set to zero, so the blocks must hold nothing anyone reads (blocks never handed out). A no-op
        on other devices, where the storage is committed when allocated, and while released."""
        last = min(last, self.num_blocks)
        if self.device.type != "cpu" or not self.is_allocated or first >= last:
            return
        step = max(1, mmap.PAGESIZE // self.spec.dtype.itemsize)
        if not self.spec.layer_shapes:
            row = self.shape[-1]
            planes = self._storage.view(-1, self.shape[-2] * row)
            planes[:, first * self.block_size * row: last * self.block_size * row: step].zero_()
            return
        for plane in self._planes():
            plane[:, first * self.block_size: last * self.block_size].flatten(1)[:, ::step].zero_()

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stores `key`/`value` ([num_kv_heads, num_tokens, head_dim]) of `layer` at `slot_mapping` (on CPU
        through the kernels' `write_rows` where they are built, else `index_copy_`); values smaller than the keys
        (`KVCacheSpec.value_head_dim`) are stored zero-padded to the keys' size."""
        key, value = key.to(self.spec.dtype), value.to(self.spec.dtype)
        if value.shape[-1] != key.shape[-1]:
            value = torch.nn.functional.pad(value, (0, key.shape[-1] - value.shape[-1]))
        writer = self._row_writer
        if (writer is not None and key.stride(-1) == 1 and value.stride(-1) == 1
                and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
            writer(self.keys[layer], key, slot_mapping)
            writer(self.values[layer], value, slot_mapping)
            return
        self.keys[layer].index_copy_(1, slot_mapping, key)
        self.values[layer].index_copy_(1, slot_mapping, value)

    def gather(self, layer: int, slots: torch.Tensor, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` ([batch * length]) as [batch, num_kv_heads, length, head_dim] views."""
        heads, head_dim = self.spec.shape_of(layer)
        shape = (heads, batch, length, head_dim)
        keys = self.keys[layer].index_select(1, slots).view(shape).transpose(0, 1)
        values = self.values[layer].index_select(1, slots).view(shape).transpose(0, 1)
        return keys, values

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies the whole content of block `src` to block `dst` for each `(src, dst)`, in every layer."""
        if not copies:
            return
        size = self.block_size
        offsets = torch.arange(size)
        src = (torch.tensor([s for s, _ in copies]).unsqueeze(1) * size + offsets).reshape(-1)
        dst = (torch.tensor([d for _, d in copies]).unsqueeze(1) * size + offsets).reshape(-1)
        device = self._storage.device
        src, dst = src.to(device, non_blocking=True), dst.to(device, non_blocking=True)
        if not self.spec.layer_shapes:
            self._storage.index_copy_(3, dst, self._storage.index_select(3, src))
            return
        for plane in self._planes():
            plane.index_copy_(1, dst, plane.index_select(1, src))
