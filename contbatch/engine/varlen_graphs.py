"""The buckets and static buffers of captured varlen steps: steps with prompt tokens, replayed from CUDA graphs.

A varlen step packs T tokens of S requests, each request's chunk attending over its own key range. Where the Triton
kernel attends (`triton_attention`), such a step's attention is one ragged group (`AttentionGroup.row_requests`):
row t reads the keys of request row_requests[t], so the step has one attention shape whatever its mix of prompt
chunks and decoding requests. T, S and each cache group's longest key range L are rounded up to a bucket
(`bucket`: a multiple of the padding interval, coarser as the size grows, at most a quarter over), and the step
runs in static buffers of the bucket's shape (`StaticVarlenInputs`). `StepGraphs` (`cuda_graphs`) keeps them
beside the decode graphs, under one `max_cached_graphs`.

Padding never changes a real token's result:
  - padding tokens compute token 0 at position 0 of request 0 and write their K/V to the cache's scratch slot
    (never a slot of a block in the pool); they read at most request 0's first key (written before any layer
    attends), and their outputs feed only padding rows;
  - padding requests read only the scratch slot, and no real row belongs to one;
  - padding keys of a real request repeat its last slot and lie after all its queries (the kernel reads each
    row's own range only);
  - padding logits rows repeat row 0; the caller keeps only the rows it asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contbatch.engine.attention import AttentionGroup, KeyLayout, PagedAttentionMetadata
from contbatch.engine.kv_cache import PagedKVCache

MIN_SIZE = 2


def bucket(value: int, interval: int) -> int:
    """`value` rounded up to a multiple of `interval`, or of a quarter of the largest power of two not above
    `value` where that is coarser: at most 25% over, about four buckets per doubling."""
    step = max(interval, (1 << (max(value, 1).bit_length() - 1)) // 4)
    return -(-value // step) * step


@dataclass(frozen=True)
class VarlenKey:
    """A varlen bucket: padded tokens, padded requests, logits rows, and per layer group of the cache the padded
    key length and whether keys start at a per-request offset (a sliding window's `KeyLayout.first`)."""

    tokens: int
    requests: int
    rows: int
    layouts: tuple[tuple[int, bool], ...]


def varlen_key(metadata: PagedAttentionMetadata, num_tokens: int, num_rows: int, interval: int,
               kv_interval: int) -> VarlenKey | None:
    """The bucket of a varlen step (`num_tokens` tokens, `num_rows` logits rows), or None when its metadata is not
    one ragged group. Tokens and rows are at least `MIN_SIZE` (a compiled forward would specialise 0 and 1)."""
    if len(metadata.groups) != 1 or metadata.groups[0].row_requests is None:
        return None
    group = metadata.groups[0]
    tokens, rows = bucket(max(num_tokens, MIN_SIZE), interval), bucket(max(num_rows, MIN_SIZE), interval)
    return VarlenKey(tokens, bucket(group.batch_size, interval), rows, tuple(
        (bucket(layout.length, kv_interval), layout.first is not None) for layout in group.layouts
    ))


def key_buffers(layouts: tuple[tuple[int, bool], ...], requests: int, cache: PagedKVCache
                ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[KeyLayout]]:
    """A bucket's key buffers per cache group, from its (padded length, per-request offset) pairs: the slots
    [requests, length] (the scratch slot), the first positions [requests] (where keys start at an offset), and
    the `KeyLayout`s over them."""
    slots = [torch.full((requests, length), cache.scratch_slot, dtype=torch.long, device=cache.device)
             for length, _ in layouts]
    firsts = [torch.zeros(requests, dtype=torch.long, device=cache.device) if offset else None
              for _, offset in layouts]
    return slots, firsts, [KeyLayout(length, first) for (length, _), first in zip(layouts, firsts, strict=True)]


def fill_key_slots(kv_slots: list[torch.Tensor], firsts: list[torch.Tensor | None], group: AttentionGroup,
                   scratch_slot: int) -> None:
    """Copies `group`'s key slots and first positions, per cache group, into a bucket's buffers ([requests,
    length] and [requests]): a real request's padding keys repeat its last slot, padding requests read the
    scratch slot from position 0."""
    requests = group.batch_size
    for slots, first, layout, real in zip(kv_slots, firsts, group.layouts, group.kv_slots, strict=True):
        length = layout.length
        slots[:requests, :length].copy_(real.view(requests, length), non_blocking=True)
        slots[:requests, length:] = slots[:requests, length - 1:length]
        slots[requests:] = scratch_slot
        if first is not None:
            assert layout.first is not None
            copy_padded(first, layout.first, 0)


def copy_padded(buffer: torch.Tensor, values: torch.Tensor, padding: int) -> None:
    """Copies `values` into the leading rows of `buffer` (along dim 0) and sets its other rows to `padding`."""
    buffer[:len(values)].copy_(values, non_blocking=True)
    buffer[len(values):] = padding


class StaticVarlenInputs:
    """The buffers one varlen bucket's graph reads, and the metadata over them; `fill` copies a step into them."""

    def __init__(self, key: VarlenKey, cache: PagedKVCache) -> None:
        device, tokens, requests = cache.device, key.tokens, key.requests
        self.key = key
        self.scratch_slot = cache.scratch_slot
        self.inputs = {
            "input_ids": torch.zeros(1, tokens, dtype=torch.long, device=device),
            "position_ids": torch.zeros(1, tokens, dtype=torch.long, device=device),
            "logits_to_keep": torch.zeros(key.rows, dtype=torch.long, device=device),
        }
        self.slot_mapping = torch.full((len(cache.groups), tokens), cache.scratch_slot, dtype=torch.long,
                                       device=device)
        self.row_requests = torch.zeros(tokens, dtype=torch.long, device=device)
        self.kv_slots, self.firsts, layouts = key_buffers(key.layouts, requests, cache)
        group = AttentionGroup(
            batch_size=requests, num_queries=1, query_rows=torch.arange(tokens, device=device),
            query_positions=self.inputs["position_ids"].view(tokens, 1), layouts=layouts,
            kv_slots=[slots.view(-1) for slots in self.kv_slots], whole_batch=True, row_requests=self.row_requests,
        )
        self.metadata = PagedAttentionMetadata(cache, self.slot_mapping, [group])

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
             metadata: PagedAttentionMetadata) -> None:
        """Copies a varlen step of this bucket into the buffers: the real tokens, requests and rows first, then
        padding."""
        (group,) = metadata.groups
        assert group.row_requests is not None
        copy_padded(self.inputs["input_ids"][0], input_ids, 0)
        copy_padded(self.inputs["position_ids"][0], positions, 0)
        copy_padded(self.inputs["logits_to_keep"], logits_indices, 0)
        copy_padded(self.slot_mapping.T, metadata.slot_mapping.T, self.scratch_slot)
        copy_padded(self.row_requests, group.row_requests, 0)
        fill_key_slots(self.kv_slots, self.firsts, group, self.scratch_slot)

    def forget_masks(self) -> None:
        """Drops the row ranges the layouts built in an eager run, so a capture records their computation."""
        for layout in self.metadata.groups[0].layouts:
            layout.forget_masks()
