"""`ModelRunner`: packs a scheduled batch into tensors and runs the stock model's forward once."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from contbatch.engine.attention import (
    METADATA_KWARG,
    AttentionGroup,
    KeyLayout,
    PagedAttentionMetadata,
    register_paged_attention,
)
from contbatch.engine.batch import SchedulerOutput
from contbatch.engine.kv_cache import PagedKVCache
from contbatch.engine.kv_cache_manager import KVCacheManager


class ModelRunner:
    """Runs `model` with contbatch's paged attention.

    While the runner is attached the model's attention implementation is contbatch's; `close()` restores the one
    it had. Every step is one forward over one packed, ragged batch (`[1, num_tokens]`, no padding between
    requests), and logits are computed only at the positions that sample.
    """

    def __init__(self, model: PreTrainedModel, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        # sliding groups leave DEAD_BLOCK entries in block tables
        self.has_dead_blocks = any(group.sliding_window is not None for group in cache.groups)
        self.device = cache.keys[0].device
        self._previous_attention: str | None = None
        self.attach()

    def attach(self) -> None:
        """Switches the model to contbatch's paged attention (idempotent)."""
        if self._previous_attention is None:
            self._previous_attention = self.model.config._attn_implementation
            self.model.set_attn_implementation(register_paged_attention())

    def close(self) -> None:
        """Gives the model back its own attention implementation (idempotent); `attach` takes it again."""
        if self._previous_attention is not None:
            self.model.set_attn_implementation(self._previous_attention)
            self._previous_attention = None

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor:
        """Computes the batch's tokens into the cache; returns the logits [num sampling requests, vocab] of the
        requests that sample, in batch order."""
        input_ids, positions, logits_indices, metadata = self.prepare(batch, kv_manager)
        self.cache.copy_blocks(batch.block_copies)
        output = self.model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            logits_to_keep=logits_indices,
            **{METADATA_KWARG: metadata},
        )
        return output.logits[0]

    def prepare(
        self, batch: SchedulerOutput, kv_manager: KVCacheManager
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        """Builds input ids, positions, the indices of the sampling tokens and the attention metadata with tensor
        ops over the whole batch: the only per-request Python work is slicing its tokens and block table."""
        block_size = self.cache.block_size
        requests = batch.requests
        token_ids: list[int] = []
        for request, count in zip(requests, batch.num_scheduled_tokens, strict=True):
            token_ids.extend(request.token_ids[request.num_computed_tokens:request.num_computed_tokens + count])
        tables = [kv_manager.block_tables(request.request_id) for request in requests]
        width = max(len(request_tables[0]) for request_tables in tables)
        # [groups, requests, width]: every group's tables of one request have the same length
        block_tables = torch.tensor([
            [table + [0] * (width - len(table)) for table in request_tables] for request_tables in tables
        ]).transpose(0, 1)
        if self.has_dead_blocks:
            # Blocks left behind by a sliding window are masked but still gathered: point them at a live block.
            first_live = block_tables.gather(2, (block_tables >= 0).int().argmax(2, keepdim=True))
            block_tables = torch.where(block_tables < 0, first_live, block_tables)
        counts = torch.tensor(batch.num_scheduled_tokens)
        starts = torch.tensor([request.num_computed_tokens for request in requests])
        offsets = torch.cumsum(counts, 0) - counts
        request_of_token = torch.repeat_interleave(torch.arange(len(requests)), counts)
        positions = torch.arange(len(token_ids)) - offsets[request_of_token] + starts[request_of_token]
        slot_mapping = block_tables[:, request_of_token, positions // block_size] * block_size + positions % block_size
        logits_indices = (offsets + counts - 1)[torch.tensor(batch.sampling, dtype=torch.bool)]
        single = counts == 1
        groups = [
            _attention_group(members.nonzero().squeeze(1), counts, starts, offsets, block_tables, block_size,
                             kv_manager.windows)
            for members in (single, ~single)
            if bool(members.any())
        ]
        metadata = PagedAttentionMetadata(self.cache, slot_mapping.to(self.device), [
            _to_device(group, self.device) for group in groups
        ])
        return (torch.tensor(token_ids, device=self.device), positions.to(self.device),
                logits_indices.to(self.device), metadata)


def _attention_group(
    members: torch.Tensor,
    counts: torch.Tensor,
    starts: torch.Tensor,
    offsets: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    windows: tuple[int | None, ...],
) -> AttentionGroup:
    """The group of requests `members`, padded to their longest query and, per cache group, key range.

        request b, padded queries:  [ q0 q1 .. q(n-1) | q(n-1) q(n-1) ... ]   (n = counts[b])
        positions:                  [ s  s+1 ..  s+n-1 | s+n-1 ...         ]   (s = starts[b])
        keys, full attention:       [ 0 1 .. s+n-1 | s+n-1 ... (masked) ]
        keys, window W:             [ s-W+1 .. s+n-1 | s+n-1 ... (masked) ]   (from 0 while s < W)
    """
    counts, starts, offsets = counts[members], starts[members], offsets[members]
    num_queries = int(counts.max())
    query_offsets = torch.minimum(torch.arange(num_queries).unsqueeze(0), (counts - 1).unsqueeze(1))
    layouts = {window: _key_layout(starts, counts, window) for window in set(windows)}
    kv_slots = []
    for group, window in enumerate(windows):
        key_positions = layouts[window][1]
        table = block_tables[group, members]
        kv_slots.append((table.gather(1, key_positions // block_size) * block_size
                         + key_positions % block_size).reshape(-1))
    real_queries = None
    if bool((counts != num_queries).any()):
        real_queries = (torch.arange(num_queries).unsqueeze(0) < counts.unsqueeze(1)).reshape(-1).nonzero()
        real_queries = real_queries.squeeze(1)
    return AttentionGroup(
        batch_size=len(members),
        num_queries=num_queries,
        query_rows=(offsets.unsqueeze(1) + query_offsets).reshape(-1),
        query_positions=starts.unsqueeze(1) + query_offsets,
        layouts=[layouts[window][0] for window in windows],
        kv_slots=kv_slots,
        real_queries=real_queries,
    )


def _key_layout(starts: torch.Tensor, counts: torch.Tensor, window: int | None) -> tuple[KeyLayout, torch.Tensor]:
    """The keys requests read in layers with `window`, and their positions [batch, length]: from each request's
    window start when that shortens the padded range, else from 0."""
    last = starts + counts - 1
    length = int(last.max()) + 1
    first = None
    if window is not None:
        window_start = (starts - window + 1).clamp(min=0)
        window_length = int((last + 1 - window_start).max())
        if window_length < length:
            first, length = window_start, window_length
    positions = torch.arange(length).unsqueeze(0)
    if first is not None:
        positions = positions + first.unsqueeze(1)
    # Padding keys repeat the request's last key: masked, but read, so it must be a written slot (0 * NaN = NaN).
    return KeyLayout(length, first), torch.minimum(positions, last.unsqueeze(1))


def _to_device(group: AttentionGroup, device: torch.device) -> AttentionGroup:
    if device.type == "cpu":
        return group
    group.query_rows = group.query_rows.to(device, non_blocking=True)
    group.query_positions = group.query_positions.to(device, non_blocking=True)
    group.kv_slots = [slots.to(device, non_blocking=True) for slots in group.kv_slots]
    for layout in group.layouts:
        if layout.first is not None:
            layout.first = layout.first.to(device, non_blocking=True)
    if group.real_queries is not None:
        group.real_queries = group.real_queries.to(device, non_blocking=True)
    return group
