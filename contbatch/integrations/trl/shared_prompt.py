"""The GRPO policy forward with each prompt computed once for all of its completions.

TRL repeats every prompt `num_generations` times and runs the policy over each left-padded prompt + right-padded
completion row. Here each distinct prompt goes through the model once, keeping its keys and values (with their
autograd history: `contbatch.training.SharedPrompt`); the prompt's completions run as one batch attending over them.
The gradient of the shared keys and values sums over the completions, so log-probabilities, entropies and
gradients are those of TRL's forward (exactly in exact arithmetic, to rounding in floating point), for less
compute: each prompt token is computed once instead of once per completion, no row is padded on the left, and
completions are cut to the longest one of their prompt.

The completion rows go through the model's own forward with TRL's fused LM head (`fused_lm_head=True`, added by
`GRPOTrainer`), so temperature, logit scaling, soft-capping and the float32 head option apply as in TRL. The model
must be attached to contbatch (`contbatch.training.supports_shared_prompt`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from contbatch.training import SharedPrompt

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PromptGroup:
    """The rows of a batch that share one prompt: their indices, the prompt's tokens (padding removed) and the
    length of the longest of their completions (at least 1)."""

    rows: list[int]
    prompt: torch.Tensor
    completion_width: int


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  logits_to_keep: int) -> list[PromptGroup] | None:
    """Rows grouped by identical prompt, in order of first appearance, or None when the batch is not laid out as
    TRL lays it out (each row a left-padded, non-empty prompt then a right-padded completion of `logits_to_keep`
    columns)."""
    if not 0 < logits_to_keep < input_ids.size(1):
        return None
    prompt_mask, completion_mask = attention_mask[:, :-logits_to_keep], attention_mask[:, -logits_to_keep:]
    if not (_is_binary(attention_mask) and bool((prompt_mask.diff(dim=1) >= 0).all())
            and bool((completion_mask.diff(dim=1) <= 0).all()) and bool(prompt_mask[:, -1].all())):
        return None
    lengths = completion_mask.sum(dim=1).tolist()
    rows_of: dict[tuple[int, ...], list[int]] = {}
    for row, (ids, mask) in enumerate(zip(input_ids[:, :-logits_to_keep], prompt_mask, strict=True)):
        rows_of.setdefault(tuple(ids[mask.bool()].tolist()), []).append(row)
    return [PromptGroup(rows, torch.tensor(prompt, device=input_ids.device),
                        max(1, max(int(lengths[row]) for row in rows)))
            for prompt, rows in rows_of.items()]


def shared_prompt_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        logits_to_keep: int, batch_size: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """TRL's `(per_token_logps, entropies)` of the completion columns, shaped `(rows, logits_to_keep)` with zeros
    at padding, computed one prompt at a time and at most `batch_size` rows per forward; None (nothing computed)
    when `prompt_groups` refuses the layout. `model` is TRL's patched policy (or reference model), possibly
    PEFT-wrapped, attached to contbatch; activation checkpointing must be non-reentrant."""
    groups = prompt_groups(input_ids, attention_mask, logits_to_keep)
    if groups is None:
        return None
    order: list[int] = []
    logps: list[torch.Tensor] = []
    entropies: list[torch.Tensor | None] = []
    for group in groups:
        for rows in _chunks(group.rows, batch_size or len(group.rows)):
            completions = input_ids[rows, -logits_to_keep:][:, :group.completion_width]
            mask = attention_mask[rows, -logits_to_keep:][:, :group.completion_width]
            chunk_logps, chunk_entropy = _completion_forward(model, group.prompt, completions, mask)
            order.extend(rows)
            logps.append(F.pad(chunk_logps, (0, logits_to_keep - group.completion_width)))
            entropies.append(None if chunk_entropy is None
                             else F.pad(chunk_entropy, (0, logits_to_keep - group.completion_width)))
    inverse = torch.empty(len(order), dtype=torch.long, device=input_ids.device)
    inverse[torch.tensor(order, device=input_ids.device)] = torch.arange(len(order), device=input_ids.device)
    entropy = None if any(e is None for e in entropies) else torch.cat(cast(list[torch.Tensor], entropies))[inverse]
    return torch.cat(logps)[inverse], entropy


def _completion_forward(model: torch.nn.Module, prompt: torch.Tensor, completions: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies, if the fused head computes them) of `completions` after `prompt`: the
    prompt but its last token runs once (`SharedPrompt`), then the last prompt token and the completions of every
    row run over its record."""
    shared = SharedPrompt.record(model, prompt[:-1])
    tokens = torch.cat([prompt[-1:].expand(completions.size(0), 1), completions], dim=1)
    labels = torch.cat([torch.full_like(completions[:, :1], IGNORE_INDEX),
                        completions.masked_fill(mask == 0, IGNORE_INDEX)], dim=1)
    outputs = model(input_ids=tokens, labels=labels, fused_lm_head=True,
                    **shared.continuation_kwargs(tokens.size(1), tokens.device))
    return outputs.log_probs, getattr(outputs, "entropy", None)


def _chunks(rows: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(rows), size):
        yield rows[start:start + size]


def _is_binary(mask: torch.Tensor) -> bool:
    return bool(((mask == 0) | (mask == 1)).all())
