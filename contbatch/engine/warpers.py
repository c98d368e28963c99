"""`generate`'s warpers as masks over a batch of scores: top-k, top-p and min-p, each row as if alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contbatch.engine.device_values import device_tensor
from contbatch.engine.sampling_params import SamplingParams

NUCLEUS_CANDIDATES = 256
"""On a CPU, a top-p row without a top-k first looks for its nucleus among its this many best tokens (`topk`), and
sorts its whole vocabulary only when their mass falls short of top_p (`_mask_nucleus`)."""


def mask_top_k_top_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor,
                                                                                       torch.Tensor | None]:
    """Returns [M, vocab] `scores` with -inf at every token outside each row's top-k, then outside the nucleus
    of the top-k survivors' renormalised probabilities, and the rows' candidates when every row ranked the same
    number of them ([M, w] ids, ascending, holding every token the row keeps; else None). Each row keeps at
    least its most likely token.

    Ranking a whole vocabulary is the cost (on a CPU, sorting 32 rows of a 49k vocabulary takes longer than the
    model's decode step), so rows rank only the tokens that can survive: a row with a top-k below the vocabulary
    its k best (`topk`, in groups of equal k), a top-p row without one the smallest candidate set that holds its
    nucleus (`_mask_nucleus`). A row's result depends only on its own scores and parameters, never on the rest
    of the batch."""
    vocab = scores.shape[1]
    kinds = [p.top_k if 0 < p.top_k < vocab else (0 if p.top_p < 1.0 else None) for p in params]
    groups = sorted({kind for kind in kinds if kind is not None})
    if not groups:
        return scores, None
    if len(groups) == 1 and None not in kinds:
        return _mask_group(scores, params, groups[0])
    masked = scores.clone()
    for kind in groups:
        rows = [i for i, row_kind in enumerate(kinds) if row_kind == kind]
        index = device_tensor(rows, scores.device)
        masked[index] = _mask_group(scores.index_select(0, index), [params[i] for i in rows], kind)[0]
    return masked, None


def _mask_group(scores: torch.Tensor, params: Sequence[SamplingParams], top_k: int) -> tuple[torch.Tensor,
                                                                                             torch.Tensor | None]:
    """`mask_top_k_top_p` of rows that share `top_k` (0: top-p rows without a top-k)."""
    if top_k:
        ranked, order = scores.topk(top_k, dim=-1)
        masked = _mask_ranked(scores, ranked, order, _top_ps(params, scores.device), torch.softmax(ranked, dim=-1))
        return masked, order.sort(dim=-1).values
    return _mask_nucleus(scores, params)


def _mask_nucleus(scores: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor,
                                                                                  torch.Tensor | None]:
    """The top-p mask of rows without a top-k: among each row's NUCLEUS_CANDIDATES best tokens, with their
    probabilities over the whole vocabulary, when those hold at least top_p of the mass (every token ranked
    after them then has top_p or more before it); else over the row's whole vocabulary, stably sorted. On a GPU,
    where a sort is cheap and the check would wait for the device, always the latter."""
    top_ps = _top_ps(params, scores.device)
    if scores.shape[1] <= NUCLEUS_CANDIDATES or scores.device.type != "cpu":
        return _mask_sorted(scores, top_ps), None
    ranked, order = scores.topk(NUCLEUS_CANDIDATES, dim=-1)
    probs = (ranked - scores.logsumexp(dim=-1, keepdim=True)).exp()
    closed = probs.cumsum(dim=-1)[:, -1:] >= top_ps
    masked = _mask_ranked(scores, ranked, order, top_ps, probs)
    if bool(closed.all()):
        return masked, order.sort(dim=-1).values
    rows = (~closed).squeeze(1).nonzero().squeeze(1)
    masked[rows] = _mask_sorted(scores.index_select(0, rows), top_ps.index_select(0, rows))
    return masked, None


def _mask_sorted(scores: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """The top-p mask of rows over their whole vocabulary, stably sorted (ties broken by token id)."""
    ranked, order = scores.sort(dim=-1, descending=True, stable=True)
    return _mask_ranked(scores, ranked, order, top_ps, torch.softmax(ranked, dim=-1))


def _top_ps(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    """[M, 1] top-p thresholds; rows without top-p get an unreachable one (rounding could push their cumulative
    mass past 1.0)."""
    return device_tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device, torch.float32)[:, None]


def _mask_ranked(scores: torch.Tensor, ranked: torch.Tensor, order: torch.Tensor, top_ps: torch.Tensor,
                 probs: torch.Tensor) -> torch.Tensor:
    """[M, vocab] -inf but at the tokens of `order` (each row's candidates, best first, `ranked` their scores and
    `probs` their probabilities) that are in the row's nucleus: a token is in it iff the tokens ranked above it
    have not yet reached top_p (the top token's mass before is exactly 0 and top_p > 0: it is always kept)."""
    drop = probs.cumsum(dim=-1) - probs >= top_ps
    return torch.full_like(scores, float("-inf")).scatter_(1, order, ranked.masked_fill(drop, float("-inf")))


def mask_min_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`MinPLogitsWarper`: -inf at every token whose probability is below the row's min_p times its most likely
    token's (which always stays)."""
    if not any(p.min_p > 0 for p in params):
        return scores
    probs = torch.softmax(scores, dim=-1)
    min_p = device_tensor([p.min_p for p in params], probs.device, probs.dtype)[:, None]
    return scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
