"""The attention groups of a packed batch: requests padded together to their longest query and key range, so
that each group's attention is one batched kernel call."""

from __future__ import annotations

import torch

from contbatch.engine.attention import AttentionGroup, KeyLayout

MAX_PADDING = 1.25


def padding_bounded_sets(members: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor,
                          max_padding: float | None) -> list[torch.Tensor]:
    """Splits the multi-token requests `members` into attention groups. A group is padded to its longest query
    and key range, so its cost is members x queries x keys; each group here costs at most `max_padding` times
    its requests' own cost (largest first, greedily). With `max_padding` None: one group (fewest kernel launches,
    for GPUs)."""
    if max_padding is None or len(members) <= 1:
        return [members] if len(members) else []
    queries, keys = counts[members], starts[members] + counts[members]
    order = torch.argsort(queries * keys, descending=True, stable=True).tolist()
    sets: list[list[int]] = []
    longest = widest = own = 0
    for index in order:
        q, k = int(queries[index]), int(keys[index])
        grown = (len(sets[-1]) + 1) * max(longest, q) * max(widest, k) if sets else 0
        if sets and grown <= max_padding * (own + q * k):
            sets[-1].append(index)
            longest, widest, own = max(longest, q), max(widest, k), own + q * k
        else:
            sets.append([index])
            longest, widest, own = q, k, q * k
    return [members[torch.tensor(sorted(indices))] for indices in sets]


def attention_group(
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
    layouts = {window: key_layout(starts, counts, window) for window in set(windows)}
    kv_slots = _key_slots(block_tables[:, members], block_size, windows, layouts)
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


def ragged_group(counts: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor, request_of_token: torch.Tensor,
                 block_tables: torch.Tensor, block_size: int, windows: tuple[int | None, ...]) -> AttentionGroup:
    """Every token of the batch in one ragged group (`AttentionGroup.row_requests`): token t queries at
    `positions[t]` over the keys of request `request_of_token[t]`, each request's keys laid out as in
    `attention_group`. One attention shape per step whatever its mix of chunks (the Triton kernel's)."""
    layouts = {window: key_layout(starts, counts, window) for window in set(windows)}
    return AttentionGroup(
        batch_size=len(counts), num_queries=1, query_rows=torch.arange(len(positions)),
        query_positions=positions.unsqueeze(1), layouts=[layouts[window][0] for window in windows],
        kv_slots=_key_slots(block_tables, block_size, windows, layouts), whole_batch=True,
        row_requests=request_of_token,
    )


def _key_slots(block_tables: torch.Tensor, block_size: int, windows: tuple[int | None, ...],
               layouts: dict[int | None, tuple[KeyLayout, torch.Tensor]]) -> list[torch.Tensor]:
    """Per cache group, [requests * length] the slots of the key positions of `layouts` (by window) from the
    requests' `block_tables` [cache groups, requests, blocks]."""
    block_offsets = torch.arange(block_size)
    kv_slots = []
    for group, window in enumerate(windows):
        table_slots = (block_tables[group] * block_size).unsqueeze(2) + block_offsets
        kv_slots.append(table_slots.reshape(block_tables.shape[1], -1).gather(1, layouts[window][1]).reshape(-1))
    return kv_slots


def key_layout(starts: torch.Tensor, counts: torch.Tensor, window: int | None) -> tuple[KeyLayout, torch.Tensor]:
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


def group_to_device(group: AttentionGroup, device: torch.device) -> AttentionGroup:
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
    if group.row_requests is not None:
        group.row_requests = group.row_requests.to(device, non_blocking=True)
    return group
