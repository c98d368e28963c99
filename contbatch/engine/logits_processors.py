"""Per-request logits processors, applied to a whole batch of logits at once: biases, penalties, banned tokens
and minimum lengths, in `generate`'s order and with its arithmetic, so greedy outputs stay `generate`'s.

Each step turns the token histories of the rows that use a penalty into flat (row, token) index tensors (the
tokens flattened in one C-level pass, the rows repeated by a tensor op) and gathers the per-request parameters
(biases, banned words, stop ids) into index lists; the arithmetic is batched tensor operations over those rows.
Rows without a processor are left bit-for-bit untouched."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from contbatch.engine.device_values import device_tensor
from contbatch.engine.sampling_params import SamplingParams


class TokenHistory(NamedTuple):
    """A request's tokens when it samples: its prompt followed by what it generated so far."""

    token_ids: Sequence[int]
    num_prompt_tokens: int

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def apply_processors(logits: torch.Tensor, params: Sequence[SamplingParams],
                     histories: Sequence[TokenHistory | None] | None) -> torch.Tensor:
    """Returns [N, vocab] float32 scores: `logits` with, for every row whose parameters use processors
    (`SamplingParams.uses_processors`), in `generate`'s order: the additive biases (`logit_bias`,
    `sequence_bias`), the repetition penalty (prompt and generated tokens), OpenAI's presence and frequency
    penalties (generated tokens), then -inf at banned tokens (`bad_words_ids`, `suppress_tokens`) and, while a
    row has generated fewer than `min_tokens`, at its stop tokens. `logits` itself is never modified; it is
    returned as is (not even converted) when no row uses a processor.

    Raises:
        ValueError: when a row uses processors and `histories` is None, not one per row, or None at that row.
    """
    rows = [i for i, p in enumerate(params) if p.uses_processors]
    if not rows:
        return logits
    if histories is None or len(histories) != len(params):
        raise ValueError("logits processors need one token history per row")
    seen = [history for history in (histories[i] for i in rows) if history is not None]
    if len(seen) != len(rows):
        raise ValueError("logits processors need the token history of every row that uses them")
    scores = logits.float().clone()
    chosen = [params[i] for i in rows]
    index = device_tensor(rows, scores.device)
    part = scores.index_select(0, index)
    part = _add_biases(part, chosen, seen)
    part = _repetition_penalty(part, chosen, seen)
    part = _openai_penalties(part, chosen, seen)
    part = _ban(part, chosen, seen)
    return scores.index_copy_(0, index, part)


def _add_biases(scores: torch.Tensor, params: Sequence[SamplingParams],
                histories: Sequence[TokenHistory]) -> torch.Tensor:
    """scores + bias, the bias of each row summing its `logit_bias`, its one-token `sequence_bias` keys and
    the longer keys whose prefix ends its history (`SequenceBiasLogitsProcessor`'s order: bias first)."""
    entries = [(row, token, bias) for row, (p, h) in enumerate(zip(params, histories, strict=True))
               for token, bias in itertools.chain(p.logit_bias, _sequence_matches(p.sequence_bias, h.token_ids))]
    if not entries:
        return scores
    bias = torch.zeros_like(scores)
    rows, tokens, values = zip(*entries, strict=True)
    bias.index_put_(_indices(rows, tokens, scores.device), torch.tensor(values, dtype=scores.dtype,
                                                                        device=scores.device), accumulate=True)
    return scores + bias


def _sequence_matches(sequence_bias: Sequence[tuple[tuple[int, ...], float]],
                      token_ids: Sequence[int]) -> list[tuple[int, float]]:
    """(last token, bias) of every key that is one token long or whose other tokens end `token_ids`."""
    matches = []
    for key, bias in sequence_bias:
        prefix = len(key) - 1
        if prefix == 0 or (prefix <= len(token_ids) and tuple(token_ids[len(token_ids) - prefix:]) == key[:-1]):
            matches.append((key[-1], bias))
    return matches


def _repetition_penalty(scores: torch.Tensor, params: Sequence[SamplingParams],
                        histories: Sequence[TokenHistory]) -> torch.Tensor:
    """`RepetitionPenaltyLogitsProcessor`: at every token of a row's history, a negative score is multiplied
    by the row's penalty and a positive one divided by it."""
    rows = [row for row, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return scores
    seen = _presence(scores, rows, [histories[row].token_ids for row in rows])
    penalties = torch.ones((scores.shape[0], 1), dtype=scores.dtype, device=scores.device)
    penalties[rows, 0] = torch.tensor([params[row].repetition_penalty for row in rows], dtype=scores.dtype,
                                      device=scores.device)
    penalised = torch.where(scores < 0, scores * penalties, scores / penalties)
    return torch.where(seen, penalised, scores)


def _openai_penalties(scores: torch.Tensor, params: Sequence[SamplingParams],
                      histories: Sequence[TokenHistory]) -> torch.Tensor:
    """OpenAI's penalties over the generated tokens: score - frequency * count - presence * (count > 0)."""
    rows = [row for row, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if not rows:
        return scores
    generated = [h.token_ids[h.num_prompt_tokens:] for h in (histories[row] for row in rows)]
    counts = torch.zeros((scores.shape[0], scores.shape[1]), dtype=scores.dtype, device=scores.device)
    index = _flat_indices(rows, generated, scores.device)
    if not index[0].numel():
        return scores
    counts.index_put_(index, torch.ones(index[0].numel(), dtype=scores.dtype, device=scores.device),
                      accumulate=True)
    frequency = _column([p.frequency_penalty for p in params], scores)
    presence = _column([p.presence_penalty for p in params], scores)
    return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)


def _ban(scores: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]) -> torch.Tensor:
    """-inf at each row's banned tokens: its `bad_words_ids` (as `NoBadWordsLogitsProcessor`: one-token words
    that are EOS ids are dropped; longer words ban their last token when the rest ends the history), its stop
    tokens while it is short of `min_tokens`, and its `suppress_tokens`."""
    banned: list[tuple[int, int]] = []
    for row, (p, h) in enumerate(zip(params, histories, strict=True)):
        words = [(key, 0.0) for key in p.bad_words_ids if not (len(key) == 1 and key[0] in p.eos_token_ids)]
        banned.extend((row, token) for token, _ in _sequence_matches(words, h.token_ids))
        if h.num_generated < p.min_tokens:
            banned.extend((row, token) for token in sorted(p.stop_ids))
        banned.extend((row, token) for token in p.suppress_tokens)
    if not banned:
        return scores
    rows, tokens = zip(*banned, strict=True)
    return scores.index_put_(_indices(rows, tokens, scores.device),
                             device_tensor(float("-inf"), scores.device, scores.dtype))


def _presence(scores: torch.Tensor, rows: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """[R, vocab] bool: True where row `rows[j]` has the token in `token_lists[j]`."""
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    mask[_flat_indices(rows, token_lists, scores.device)] = True
    return mask


def _flat_indices(rows: Sequence[int], token_lists: Sequence[Sequence[int]],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token) tensors of every token of every list: the rows repeated by tensor ops, the tokens
    flattened in one C-level pass."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.long)
    row_index = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), lengths)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    return row_index.to(device, non_blocking=True), tokens.to(device, non_blocking=True)


def _indices(rows: Sequence[int], tokens: Sequence[int],
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return device_tensor(rows, device, torch.long), device_tensor(tokens, device, torch.long)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return device_tensor(values, like.device, like.dtype)[:, None]
