"""`ModelRunner`: packs a scheduled batch into tensors and runs the stock model's forward once."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from contbatch.engine.attention import (
    METADATA_KWARG,
    AttentionGroup,
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
            _attention_group(members.nonzero().squeeze(1), counts, starts, offsets, block_tables, block_size)
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
) -> AttentionGroup:
    """The group of requests `members`, padded to their longest query and context.

        request b, padded queries:  [ q0 q1 .. q(n-1) | q(n-1) q(n-1) ... ]   (n = counts[b])
        positions:                  [ s  s+1 ..  s+n-1 | s+n-1 ...         ]   (s = starts[b])
        keys:                       [ 0 1 .. s+n-1 | s+n-1 ... (masked) ]
    """
    counts, starts, offsets = counts[members], starts[members], offsets[members]
    num_queries = int(counts.max())
    context_len = int((starts + counts).max())
    query_offsets = torch.minimum(torch.arange(num_queries).unsqueeze(0), (counts - 1).unsqueeze(1))
    # Padding keys repeat the request's last key: masked, but read, so it must be a written slot (0 * NaN = NaN).
    key_positions = torch.minimum(torch.arange(context_len).unsqueeze(0), (starts + counts - 1).unsqueeze(1))
    tables = block_tables[:, members]
    key_blocks = (key_positions // block_size).expand(tables.shape[0], -1, -1)
    kv_slots = tables.gather(2, key_blocks) * block_size + key_positions % block_size
    real_queries = None
    if bool((counts != num_queries).any()):
        real_queries = (torch.arange(num_queries).unsqueeze(0) < counts.unsqueeze(1)).reshape(-1).nonzero()
        real_queries = real_queries.squeeze(1)
    return AttentionGroup(
        batch_size=len(members),
        num_queries=num_queries,
        context_len=context_len,
        query_rows=(offsets.unsqueeze(1) + query_offsets).reshape(-1),
        query_positions=starts.unsqueeze(1) + query_offsets,
        kv_slots=kv_slots.reshape(len(tables), -1),
        real_queries=real_queries,
    )


def _to_device(group: AttentionGroup, device: torch.device) -> AttentionGroup:
    if device.type == "cpu":
        return group
    group.query_rows = group.query_rows.to(device, non_blocking=True)
    group.query_positions = group.query_positions.to(device, non_blocking=True)
    group.kv_slots = group.kv_slots.to(device, non_blocking=True)
    if group.real_queries is not None:
        group.real_queries = group.real_queries.to(device, non_blocking=True)
    return group
