"""Paged attention for a stock transformers model, registered through `AttentionInterface`.

The model runner switches the model to `ATTENTION_NAME` and passes a `PagedAttentionMetadata` as the forward
keyword `METADATA_KWARG`; transformers hands every keyword down to the attention function of each layer. There,
the layer's new K/V are written into their cache slots and each request attends over its own context. Requests are
attended in a few padded groups (`attention_groups`), so the work per layer is a handful of calls whatever the
number of requests. On CPU a kernel reads every group's keys straight from the cache, each query row over its own
key range (decode and prefill alike); elsewhere the keys are gathered from the blocks for SDPA.

The model stays a normal model while attached: a forward without the metadata keyword (training, `generate`, a
reference forward, another thread's forward while a step runs) goes to the attention and mask functions of the
implementation the model had before (`remember_own_attention`); only the thread inside `paged_forward` gets
contbatch's.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PretrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from contbatch.engine.attention_math import group_attention
from contbatch.engine.attention_types import AttentionModule, KVShapeProbe, visible_keys
from contbatch.engine.compile import COMPILED_MARKER, paged_attention_op
from contbatch.engine.cpu_kernels import DecodeKernel, paged_decode_kernel
from contbatch.engine.kv_cache import PagedKVCache
from contbatch.engine.model_support import (
    attention_sinks,
    check_attention_kwargs,
    check_kv_shape,
    check_window,
)
from contbatch.engine.shared_prefix import SHARED_PREFIX_KWARG, SUPPORTED_ATTENTION, shared_prefix_attention
from contbatch.engine.triton_attention import KERNEL_ENV
from contbatch.engine.triton_attention import paged_attention as triton_paged_attention
from contbatch.engine.triton_attention import usable_on as triton_usable_on

ATTENTION_NAME = "contbatch_paged"
METADATA_KWARG = "contbatch_metadata"

_own_attention: dict[int, tuple[weakref.ReferenceType[PretrainedConfig], str]] = {}
_forward_state = threading.local()


@dataclass
class KeyLayout:
    """The keys each request of a group reads in the layers of one cache group: `length` positions from
    `first[b]` on (from 0 when `first` is None). A sliding group starts at its window, so it neither gathers
    nor masks keys no query can see. Padding past a request's last key repeats that key and is masked."""

    length: int
    first: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _ranges: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def mask(self, query_positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """[batch, 1, num_queries, length] bool: query at position q sees key k iff k <= q and, with a window W,
        k > q - W (as transformers' sliding-window mask). Built once per step for each window."""
        if sliding_window not in self._masks:
            keys = torch.arange(self.length, device=query_positions.device)
            if self.first is not None:
                keys = (self.first.unsqueeze(1) + keys).unsqueeze(1)
            allowed = visible_keys(keys, query_positions.unsqueeze(-1), sliding_window)
            self._masks[sliding_window] = allowed.unsqueeze(1)
        return self._masks[sliding_window]

    def row_ranges(self, query_positions: torch.Tensor, sliding_window: int | None,
                   real_queries: torch.Tensor | None,
                   row_requests: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(lengths, first), each [batch * num_queries]: query row r reads the keys [first[r], lengths[r]) of
        this layout (counted from its `first`), the same keys `mask` allows it. A padding row (not in
        `real_queries`) reads its last key only: its output is dropped. In a ragged group (`row_requests`,
        `query_positions` [rows, 1]) row r's keys start at its request's `first`. Built once per step for each
        window."""
        if sliding_window not in self._ranges:
            lengths = query_positions + 1
            first = (lengths - sliding_window).clamp_(min=0) if sliding_window else torch.zeros_like(lengths)
            if self.first is not None:
                offset = (self.first if row_requests is None else self.first.index_select(0, row_requests))
                lengths, first = lengths - offset.unsqueeze(1), first - offset.unsqueeze(1)
            lengths, first = lengths.reshape(-1), first.reshape(-1)
            if real_queries is not None:
                padding = torch.ones_like(lengths, dtype=torch.bool).index_fill_(0, real_queries, False)
                first = torch.where(padding, lengths - 1, first)
            self._ranges[sliding_window] = (lengths, first)
        return self._ranges[sliding_window]

    def forget_masks(self) -> None:
        """Drops the masks and row ranges built so far: the next `mask` or `row_ranges` call computes them
        again."""
        self._masks.clear()
        self._ranges.clear()


@dataclass
class AttentionGroup:
    """Requests attended together, padded to `num_queries` queries each.

    Attributes:
        batch_size: requests in the group.
        num_queries: queries per request after padding (1 for a group of decoding requests).
        query_rows: [batch_size * num_queries] rows of the packed batch to use as queries; a padding query
            repeats its request's last real row.
        query_positions: [batch_size, num_queries] the position of each query in its sequence.
        layouts: for each layer group of the cache, the keys its layers read (groups with the same window share
            one layout).
        kv_slots: for each layer group of the cache, [batch_size * layout.length] the slots of those keys.
        real_queries: indices into the flattened padded queries of the real ones, or None when there is no
            padding; the outputs of those go to `query_rows[real_queries]`.
        whole_batch: the group's queries are every row of the packed batch in order, unpadded (`query_rows` is
            0..rows-1): its output is the layer's, with no gather or scatter.
        row_requests: a ragged group (a varlen step's every token, `query_positions` [rows, 1]): [rows] the
            request of each query row, whose keys it reads; None: row r is request r // num_queries's. A kernel
            attends a ragged group: the Triton kernel (`varlen_graphs`) or, on a CPU, the C++ kernel.
    """

    batch_size: int
    num_queries: int
    query_rows: torch.Tensor
    query_positions: torch.Tensor
    layouts: list[KeyLayout]
    kv_slots: list[torch.Tensor]
    real_queries: torch.Tensor | None = None
    whole_batch: bool = False
    row_requests: torch.Tensor | None = None


@dataclass
class PagedAttentionMetadata:
    """What every layer's attention needs for one step.

    Attributes:
        cache: the physical K/V storage.
        slot_mapping: [cache groups, num_tokens] for each layer group of the cache, the slot of each token of
            the packed batch.
        groups: the attention groups covering every token of the batch exactly once.
        attended: the layers that ran the paged attention with it, in call order (`model_support.check_attended`).
    """

    cache: PagedKVCache
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    attended: list[int] = field(default_factory=list)


def paged_attention_forward(
    module: AttentionModule,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function contract. With contbatch's metadata (`METADATA_KWARG`): query
    [1, heads, tokens, head_dim], key/value [1, kv_heads, tokens, head_dim] for the packed batch (values may be
    smaller: multi-head latent attention); returns ([1, tokens, heads, value head size], None). Without it (a
    training forward, `generate`, a forward on another thread while a step runs), the call goes, arguments
    untouched, to the implementation the model had when contbatch attached (`own_attention`), so the model
    computes exactly what it computed before attaching."""
    metadata: PagedAttentionMetadata | KVShapeProbe | str | None = kwargs.get(METADATA_KWARG)
    if metadata is None and getattr(_forward_state, "active", False):
        metadata = _forward_state.metadata  # a layer that drops the forward's keywords (StableLM's)
    if isinstance(metadata, KVShapeProbe):
        return metadata.record(module, query, key, value), None
    if metadata is None:
        prefix = kwargs.pop(SHARED_PREFIX_KWARG, None)
        if prefix is not None:
            return shared_prefix_attention(_own_attention_function(module), own_attention(module.config) or "",
                                           module, query, key, value, attention_mask, prefix, *args, **kwargs)
        return _own_attention_function(module)(module, query, key, value, attention_mask, *args, **kwargs)
    check_attention_kwargs(cast(torch.nn.Module, module), kwargs, attention_mask)
    scaling, window, softcap = kwargs.get("scaling"), kwargs.get("sliding_window"), kwargs.get("softcap")
    sinks = attention_sinks(cast(torch.nn.Module, module), kwargs, query.shape[1])
    if metadata == COMPILED_MARKER:  # inside a compiled forward: one opaque op, the metadata is the step's
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        output = paged_attention_op(query, key, value, module.layer_idx, scale, int(window or 0),
                                    float(softcap or 0.0), sinks)
        return output, None
    assert isinstance(metadata, PagedAttentionMetadata)
    return paged_attention_for_layer(module.layer_idx, query, key, value, metadata, scaling, window, softcap,
                                     sinks), None


def paged_attention_for_layer(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes `layer`'s new K/V into the cache, then attends every group of the batch over its context; returns
    [1, tokens, heads, value head size]. `sinks` ([heads] float32): each head's sink logit (`attention_math`). A
    layer's later calls in one forward take the cache layers of its repeated calls (`PagedKVCache.repeated_calls`)."""
    repeats = metadata.cache.repeated_calls.get(layer)
    if repeats is not None:
        layer = next((cache_layer for cache_layer in (layer, *repeats) if cache_layer not in metadata.attended), layer)
    cache_group = metadata.cache.layer_group[layer]
    check_window(layer, sliding_window, metadata.cache.groups[cache_group].sliding_window)
    check_kv_shape(layer, key, value, metadata.cache.spec)
    metadata.attended.append(layer)
    queries = query[0].transpose(0, 1)
    metadata.cache.write(layer, metadata.slot_mapping[cache_group], key[0], value[0])
    if len(metadata.groups) == 1 and metadata.groups[0].whole_batch:
        output = _attend_group(metadata.groups[0], cache_group, queries, metadata.cache, layer, sliding_window,
                               scaling, softcap, sinks)
    else:
        output = torch.empty(queries.shape, dtype=queries.dtype, device=queries.device)
        for group in metadata.groups:
            attended = _attend_group(group, cache_group, queries, metadata.cache, layer, sliding_window, scaling,
                                     softcap, sinks)
            if group.real_queries is None:
                output.index_copy_(0, group.query_rows, attended)
            else:
                rows = group.query_rows.index_select(0, group.real_queries)
                output.index_copy_(0, rows, attended.index_select(0, group.real_queries))
    if value.shape[-1] != output.shape[-1]:  # values stored zero-padded to the keys' size (`PagedKVCache.write`)
        output = output[..., : value.shape[-1]]
    return output.unsqueeze(0)


def _attend_group(
    group: AttentionGroup,
    cache_group: int,
    queries: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    sliding_window: int | None,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one group in `layer` (of cache group `cache_group`); returns
    [batch_size * num_queries, heads, head_dim]."""
    layout, kv_slots = group.layouts[cache_group], group.kv_slots[cache_group]
    batch, num_queries, context = group.batch_size, group.num_queries, layout.length
    num_heads, head_dim = queries.shape[1], queries.shape[2]
    q = queries if group.whole_batch else queries.index_select(0, group.query_rows)
    kernel = _kernel_for(q, cache)
    if kernel is None or kernel is triton_paged_attention:  # the C++ kernel reads rows and heads at any stride
        q = q.contiguous()
    ragged = () if group.row_requests is None else (group.row_requests,)
    if ragged and kernel is None:
        raise RuntimeError(f"a ragged attention group needs a kernel: the Triton kernel ({KERNEL_ENV}=triton) or, "
                           "for float32 or bfloat16 on a CPU, the C++ kernel")
    if kernel is not None:
        lengths, first = layout.row_ranges(group.query_positions, sliding_window, group.real_queries,
                                           group.row_requests)
        scale = head_dim**-0.5 if scaling is None else scaling
        extra = {} if sinks is None else {"sinks": sinks}
        return kernel(q, cache.keys[layer], cache.values[layer], kv_slots.view(batch, context), lengths, first,
                      scale, softcap or 0.0, num_queries, *ragged, **extra)
    keys, values = cache.gather(layer, kv_slots, batch, context)
    q = q.view(batch, num_queries, num_heads, head_dim).transpose(1, 2)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    mask = layout.mask(group.query_positions, sliding_window)
    out = group_attention(q, keys, values, mask, scaling, softcap, sinks)
    return out.transpose(1, 2).reshape(batch * num_queries, num_heads, head_dim)


def attends_ragged(model: torch.nn.Module, cache: PagedKVCache) -> bool:
    """Whether steps with prompt tokens attend in one ragged group (`attention_groups.ragged_group`): where a kernel
    attends every layer's rows, the Triton kernel where it is asked for and usable (`_kernel_for`), or on a CPU the
    C++ kernel for a model and cache of one dtype, float32 or bfloat16. A ragged step is one kernel call a layer,
    with no gather of query rows, scatter of outputs or padding (padded groups otherwise, `attention_group`)."""
    device = cache.keys[0].device
    if triton_usable_on(device):
        return True
    dtype = getattr(model, "dtype", None)
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cache.spec.dtype == dtype
            and paged_decode_kernel() is not None)


def _kernel_for(q: torch.Tensor, cache: PagedKVCache) -> DecodeKernel | None:
    """The kernel that reads keys straight from the cache (decode and prefill rows), when one applies: the Triton
    kernel where it is asked for and usable (`triton_attention`), else on CPU the C++ kernel, for a query and a
    cache both float32 or both bfloat16, when built; None: gathered K/V and SDPA."""
    if triton_usable_on(q.device):
        return triton_paged_attention
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        return None
    if cache.spec.dtype != q.dtype:
        return None
    return paged_decode_kernel()


def paged_attention_mask(*args: Any, **kwargs: Any) -> Any:
    """Inside contbatch's forward (`paged_forward`) the model's mask builders return nothing: masking happens in
    `paged_attention_forward`, from the batch metadata. Anywhere else the mask is built, arguments untouched, by
    the mask function of the implementation the model had when contbatch attached (or is None when that
    implementation has no mask function, as transformers does)."""
    if getattr(_forward_state, "active", False):
        return None
    config = kwargs.get("config")
    own = own_attention(config) if config is not None else None
    if own is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' is set on a model contbatch did not attach")
    if own not in ALL_MASK_ATTENTION_FUNCTIONS:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[own](*args, **kwargs)


@contextmanager
def paged_forward(metadata: PagedAttentionMetadata | KVShapeProbe | str) -> Iterator[None]:
    """Marks the current thread as running contbatch's forward of `metadata` (or `COMPILED_MARKER`) for the
    duration of the block: the mask builders then stand aside, and a layer whose call drops the forward's
    keywords attends with it; other threads' forwards are unaffected."""
    _forward_state.active, _forward_state.metadata = True, metadata
    try:
        yield
    finally:
        _forward_state.active, _forward_state.metadata = False, None


def remember_own_attention(model: torch.nn.Module) -> None:
    """Records the attention implementation that `model`'s config and each of its sub-configs has now, before
    contbatch switches it to `ATTENTION_NAME` (configs already switched keep their record)."""
    for config in {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None),
                                                                   PretrainedConfig)}.values():
        implementation = config._attn_implementation
        if implementation != ATTENTION_NAME:
            key = id(config)
            _own_attention[key] = (weakref.ref(config, functools.partial(_forget_own_attention, key)),
                                   implementation)


def _forget_own_attention(key: int, _: object) -> None:
    _own_attention.pop(key, None)


def own_attention(config: PretrainedConfig) -> str | None:
    """The implementation `config` had when contbatch attached, or None if contbatch never attached it."""
    entry = _own_attention.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    return entry[1]


def _own_attention_function(module: AttentionModule) -> Callable[..., Any]:
    """The attention function `module` would call under the implementation its model had before attaching;
    "eager" is the modeling file's own `eager_attention_forward`, as transformers' modules resolve it."""
    own = own_attention(module.config)
    if own is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs the keyword '{METADATA_KWARG}' on a model "
                           f"contbatch did not attach: run the model through contbatch")
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if own == "eager" and eager is None:
        raise RuntimeError(f"{type(module).__name__}'s modeling file has no eager_attention_forward")
    return ALL_ATTENTION_FUNCTIONS.get_interface(own, cast(Callable[..., Any], eager))


def supports_shared_prefix(model: torch.nn.Module) -> bool:
    """Whether `model` runs contbatch's attention now over an own implementation a shared-prefix forward
    supports (see `shared_prefix`)."""
    configs = [c for m in model.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)]
    return bool(configs) and all(c._attn_implementation == ATTENTION_NAME and own_attention(c) in SUPPORTED_ATTENTION
                                 for c in configs)


def register_paged_attention() -> str:
    """Registers the attention function and its mask under `ATTENTION_NAME` (idempotent); returns the name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_attention_mask)
    return ATTENTION_NAME
