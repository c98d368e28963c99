"""Steps replayed from captured CUDA graphs, over shapes padded into buckets: decode steps here, steps with
prompt tokens where the Triton kernel attends them in one ragged group (`varlen_graphs`).

A decode step (every request computes one token, every one samples) has two sizes that change from step to step:
the number of requests B and the longest context L (per layer group of the cache). Both are rounded up to a
bucket, B to a multiple of `q_padding_interval_size` and L to a multiple of `kv_padding_interval_size`, and the
step runs in static buffers of the bucket's shape (`StaticDecodeInputs`). The first step of a bucket captures the
model's forward over those buffers into a graph; later steps of the bucket only copy their inputs into the
buffers and replay it. At most `max_cached_graphs` graphs are kept, least recently used dropped first, decode
and varlen graphs together (`StepGraphs`).

Padding never changes a real request's result:
  - padding requests compute token 0 at position 0 and write their K/V to the cache's scratch slot (never a
    slot of a block in the pool), reading only that slot;
  - padding keys of a real request repeat its last slot and lie after its query, so the causal mask hides them.

The capture backend is pluggable (`GraphBackend`): `CudaGraphBackend` on a GPU; `EagerReplay` re-runs the forward
over the same static buffers, so the whole bucketing and buffer logic runs, and is tested, on a CPU.
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import CompileConfig

from contbatch.engine.attention import AttentionGroup, PagedAttentionMetadata
from contbatch.engine.kv_cache import PagedKVCache
from contbatch.engine.varlen_graphs import (
    StaticVarlenInputs,
    VarlenKey,
    copy_padded,
    fill_key_slots,
    key_buffers,
    varlen_key,
)

PRESET_BATCH_INTERVAL = 8
PRESET_KV_INTERVAL = 256
PRESET_MAX_GRAPHS = 64
SEEN_LIMIT = 4096

Forward = Callable[[dict[str, torch.Tensor], PagedAttentionMetadata], torch.Tensor]


@dataclass(frozen=True)
class GraphSettings:
    """How decode steps are bucketed and how many captured graphs are kept (all >= 1)."""

    batch_interval: int = PRESET_BATCH_INTERVAL
    kv_interval: int = PRESET_KV_INTERVAL
    max_graphs: int = PRESET_MAX_GRAPHS


def resolve_graph_settings(use_cuda_graph: bool | None, q_interval: int, kv_interval: int, max_graphs: int,
                           device: torch.device, decode_compile: CompileConfig | None) -> GraphSettings | None:
    """The graph settings of an engine on `device`, or None when decode steps run without graphs.

    `use_cuda_graph` None means: on where CUDA graphs exist (a CUDA device) unless the decode path's compile config
    makes graphs of its own (inductor's "reduce-overhead" / "max-autotune" modes); True asks for them and warns
    where they cannot be had; False turns them off. A padding interval or graph count of 0 takes the preset.
    """
    if use_cuda_graph is False:
        return None
    if device.type != "cuda":
        if use_cuda_graph:
            warnings.warn(f"use_cuda_graph=True needs a CUDA device; the model is on {device.type}: decode steps "
                          f"run without graphs", stacklevel=3)
        return None
    if decode_compile is not None and _compile_makes_graphs(decode_compile):
        if use_cuda_graph:
            warnings.warn(f"the decode path's compile config (mode {decode_compile.mode!r}) captures CUDA graphs "
                          f"itself: contbatch's decode graphs are off", stacklevel=3)
        return None
    return GraphSettings(q_interval or PRESET_BATCH_INTERVAL, kv_interval or PRESET_KV_INTERVAL,
                         max_graphs or PRESET_MAX_GRAPHS)


def _compile_makes_graphs(config: CompileConfig) -> bool:
    options = dict(torch._inductor.list_mode_options().get(config.mode, {}))
    options.update(config.options or {})
    return bool(options.get("triton.cudagraphs", False))


def round_up(value: int, interval: int) -> int:
    """The smallest multiple of `interval` that is >= `value`."""
    return -(-value // interval) * interval


@dataclass(frozen=True)
class GraphKey:
    """A bucket: the padded number of requests, and per layer group of the cache the padded key length and
    whether keys start at a per-request offset (a sliding window's `KeyLayout.first`)."""

    batch: int
    layouts: tuple[tuple[int, bool], ...]


def graph_key(metadata: PagedAttentionMetadata, settings: GraphSettings) -> GraphKey:
    """The bucket of a decode step's metadata (one attention group, one query per request)."""
    (group,) = metadata.groups
    return GraphKey(round_up(group.batch_size, settings.batch_interval), tuple(
        (round_up(layout.length, settings.kv_interval), layout.first is not None) for layout in group.layouts
    ))


class StaticDecodeInputs:
    """The buffers one bucket's graph reads, and the metadata over them; `fill` copies a step into them."""

    def __init__(self, key: GraphKey, cache: PagedKVCache) -> None:
        device, batch = cache.device, key.batch
        self.key = key
        self.scratch_slot = cache.scratch_slot
        self.inputs = {
            "input_ids": torch.zeros(1, batch, dtype=torch.long, device=device),
            "position_ids": torch.zeros(1, batch, dtype=torch.long, device=device),
            "logits_to_keep": torch.arange(batch, device=device),
        }
        self.slot_mapping = torch.full((len(cache.groups), batch), cache.scratch_slot, dtype=torch.long,
                                       device=device)
        self.query_positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.kv_slots, self.firsts, layouts = key_buffers(key.layouts, batch, cache)
        group = AttentionGroup(
            batch_size=batch, num_queries=1, query_rows=torch.arange(batch, device=device),
            query_positions=self.query_positions, layouts=layouts,
            kv_slots=[slots.view(-1) for slots in self.kv_slots],
        )
        self.metadata = PagedAttentionMetadata(cache, self.slot_mapping, [group])

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata) -> None:
        """Copies a decode step of this bucket into the buffers: the real requests first, then padding."""
        (group,) = metadata.groups
        copy_padded(self.inputs["input_ids"][0], input_ids, 0)
        copy_padded(self.inputs["position_ids"][0], positions, 0)
        copy_padded(self.slot_mapping.T, metadata.slot_mapping.T, self.scratch_slot)
        copy_padded(self.query_positions, group.query_positions, 0)
        fill_key_slots(self.kv_slots, self.firsts, group, self.scratch_slot)

    def forget_masks(self) -> None:
        """Drops the masks the layouts built in an eager run, so a capture records their computation instead of
        baking in this step's."""
        for layout in self.metadata.groups[0].layouts:
            layout.forget_masks()


StaticInputs = StaticDecodeInputs | StaticVarlenInputs


class GraphBackend(Protocol):
    """Turns a forward over static buffers into a replay function returning its logits."""

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]: ...

    def new_pool(self) -> None:
        """Later captures use a memory pool of their own: called once every earlier graph is dropped."""


class EagerReplay:
    """The CPU stand-in: a "replay" runs the forward again over the same static buffers."""

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return run

    def new_pool(self) -> None:
        pass


class CudaGraphBackend:
    """CUDA graphs sharing one memory pool (graphs replay one at a time, so they can share it)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def new_pool(self) -> None:
        """Once its graphs are gone, a pool is only freeable: capturing into it again while a tensor of it is
        still alive (the logits of a step in flight) trips the caching allocator's `use_count > 0` assertion
        and leaves its accounting broken, so later tensors can share memory that is still in use."""
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm-up outside the graph: lazy initialisations (cuBLAS handles, autotuning) happen here
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = run()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay


class StepGraphs:
    """The captured steps of one engine, by bucket: decode steps (`run`) and, where the Triton kernel attends in
    ragged groups, varlen steps (`run_varlen`), least recently used dropped past `max_graphs` whatever their kind.

    A varlen bucket is captured the second time a step falls in it (the first runs eagerly): a run's varlen
    steps vary more than its decode steps, and a capture costs more than an eager step, so buckets seen once are
    not worth one. Graphs read the cache's storage and the model's parameters at the addresses they had at
    capture: `clear()` must be called when either is replaced (the cache's storage is checked at every step; the
    engine clears the graphs when it learns of new weights). `num_captures` and `capture_seconds` count every
    capture so far."""

    def __init__(self, cache: PagedKVCache, settings: GraphSettings, backend: GraphBackend) -> None:
        self.cache = cache
        self.settings = settings
        self.backend = backend
        self.graphs: OrderedDict[GraphKey | VarlenKey, tuple[StaticInputs, Callable[[], torch.Tensor]]] = (
            OrderedDict())
        self.num_captures = 0
        self.capture_seconds = 0.0
        self._storage = 0
        self._seen: set[VarlenKey] = set()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata,
            forward: Forward) -> torch.Tensor:
        """The logits [requests, vocab] of a decode step whose every request samples, from its bucket's graph
        (captured now if the bucket has none). The rows are the graph's output buffer: valid until the next
        run."""
        self._check_storage()
        key = graph_key(metadata, self.settings)
        entry = self.graphs.get(key)
        static = StaticDecodeInputs(key, self.cache) if entry is None else entry[0]
        assert isinstance(static, StaticDecodeInputs)
        static.fill(input_ids, positions, metadata)
        if entry is None:
            entry = self._capture(key, static, forward)
        else:
            self.graphs.move_to_end(key)
        return entry[1]()[:len(input_ids)]

    def run_varlen(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                   metadata: PagedAttentionMetadata, forward: Forward) -> torch.Tensor | None:
        """The logits [len(logits_indices), vocab] of a varlen step attended in one ragged group, from its
        bucket's graph (captured now when the bucket is seen a second time); None when the step runs eagerly
        (not ragged, or its bucket seen for the first time). The rows are valid until the next run."""
        settings = self.settings
        key = varlen_key(metadata, len(input_ids), len(logits_indices), settings.batch_interval,
                         settings.kv_interval)
        if key is None:
            return None
        self._check_storage()
        entry = self.graphs.get(key)
        if entry is None and key not in self._seen:
            if len(self._seen) >= SEEN_LIMIT:
                self._seen.clear()
            self._seen.add(key)
            return None
        static = StaticVarlenInputs(key, self.cache) if entry is None else entry[0]
        assert isinstance(static, StaticVarlenInputs)
        static.fill(input_ids, positions, logits_indices, metadata)
        if entry is None:
            entry = self._capture(key, static, forward)
        else:
            self.graphs.move_to_end(key)
        return entry[1]()[:len(logits_indices)]

    def _check_storage(self) -> None:
        if self._storage != self.cache.storage_address:
            self.clear()
            self._storage = self.cache.storage_address

    def _capture(self, key: GraphKey | VarlenKey, static: StaticInputs,
                 forward: Forward) -> tuple[StaticInputs, Callable[[], torch.Tensor]]:
        """Captures the forward over `static`'s buffers (filled with the step) as `key`'s graph."""
        start = time.perf_counter()

        def run() -> torch.Tensor:
            static.forget_masks()
            return forward(static.inputs, static.metadata)

        entry = (static, self.backend.capture(run))
        self.graphs[key] = entry
        self.num_captures += 1
        self.capture_seconds += time.perf_counter() - start
        while len(self.graphs) > self.settings.max_graphs:
            self.graphs.popitem(last=False)
        return entry

    def clear(self) -> None:
        """Drops every graph (their memory goes back to the allocator once nothing of theirs is alive); later
        captures use a new pool."""
        if self.graphs:
            self.graphs.clear()
            self.backend.new_pool()
