"""Prompt logprobs: which logits rows a step computes for its requests' prompt logprobs tasks, and the entries
those rows give."""

from __future__ import annotations

import torch

from contbatch.engine import head_buffer
from contbatch.engine.batch import ScheduledRequest
from contbatch.engine.outputs import PromptLogprob

LOG_SOFTMAX_ROWS = 256
LOG_SOFTMAX_BYTES = 64 << 20


def prompt_rows(scheduled: list[ScheduledRequest], offsets: torch.Tensor) -> list[torch.Tensor]:
    """For each request with a prompt logprobs task, in batch order, the packed indices of the tokens whose
    logits score its task's `token_ids` (prompt token i is scored at position i - 1)."""
    rows = []
    for index, entry in enumerate(scheduled):
        task = entry.prompt_logprobs
        if task is not None and task.token_ids:
            first = int(offsets[index]) + task.first_scored - 1 - entry.num_computed_tokens
            rows.append(torch.arange(first, first + len(task.token_ids)))
    return rows


def prompt_logprobs(rows: torch.Tensor, scheduled: list[ScheduledRequest]) -> dict[str, list[PromptLogprob]]:
    """The entries of every prompt logprobs task of `scheduled` from `rows`, their logits rows in batch order
    (see `prompt_rows`): log_softmax in float32 of at most LOG_SOFTMAX_ROWS rows and LOG_SOFTMAX_BYTES at a time
    (so the float32 block stays small whatever the chunk; on CPU, a block above `head_buffer.REUSED_OUTPUT_BYTES`
    goes into the thread's reused "log_softmax" buffer instead of a fresh mapping whose pages all fault), the scored
    token's logprob and the top `num_top` gathered on the device, then one transfer to the CPU."""
    tasks = [(entry.request_id, entry.prompt_logprobs) for entry in scheduled if entry.prompt_logprobs is not None]
    if not tasks:
        return {}
    targets = torch.tensor([token for _, task in tasks for token in task.token_ids], dtype=torch.long,
                           device=rows.device)
    num_top = max(task.num_top for _, task in tasks)
    chosen = torch.empty(len(targets), dtype=torch.float32, device=rows.device)
    top_values = torch.empty(len(targets), num_top, dtype=torch.float32, device=rows.device)
    top_ids = torch.empty(len(targets), num_top, dtype=torch.long, device=rows.device)
    step = max(1, min(LOG_SOFTMAX_ROWS, LOG_SOFTMAX_BYTES // (rows.shape[-1] * 4)))
    for start in range(0, len(targets), step):
        end = min(start + step, len(targets))
        reused = (head_buffer.buffer(end - start, rows.shape[-1], torch.float32, slot="log_softmax")
                  if rows.device.type == "cpu" else None)
        block = torch.log_softmax(rows[start:end], -1, dtype=torch.float32, out=reused)
        chosen[start:end] = block.gather(1, targets[start:end].unsqueeze(1)).squeeze(1)
        if num_top:
            top_values[start:end], top_ids[start:end] = block.topk(num_top, dim=-1)
    chosen_list, values_list, ids_list = chosen.tolist(), top_values.tolist(), top_ids.tolist()
    entries: dict[str, list[PromptLogprob]] = {}
    row = 0
    for request_id, task in tasks:
        k = task.num_top
        entries[request_id] = [
            PromptLogprob(chosen_list[i], tuple(zip(ids_list[i][:k], values_list[i][:k], strict=True)))
            for i in range(row, row + len(task.token_ids))
        ]
        row += len(task.token_ids)
    return entries
