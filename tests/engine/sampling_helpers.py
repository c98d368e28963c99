"""Shared by the sampler's test files: goodness-of-fit checks, draw counting, seeded generators, and the
documented processed-scores contract."""

from __future__ import annotations

import math

import torch

from contbatch.engine.sampler import Sampler
from contbatch.engine.sampling_params import SamplingParams

ALPHA = 1e-4  # strict, so a correct sampler essentially never fails; the power checks show it still rejects
DRAWS = 20_000
GREEDY = SamplingParams()


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df), by the closed forms of the regularised upper gamma."""
    h = statistic / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h**j / math.factorial(j) for j in range(df // 2))
    return math.erfc(math.sqrt(h)) + math.exp(-h) * sum(
        h ** (j + 0.5) / math.gamma(j + 1.5) for j in range(df // 2)
    )


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness-of-fit p-value of `counts` against `probs`, over the categories with probs > 0."""
    support = probs > 0
    expected = probs[support].double() * counts.sum()
    statistic = float(((counts[support].double() - expected) ** 2 / expected).sum())
    return chi2_sf(statistic, int(support.sum()) - 1)


def draw_counts(logits: torch.Tensor, params: SamplingParams, draws: int = DRAWS) -> torch.Tensor:
    """Samples `draws` times from one row of logits (as a batch of identical rows) and counts each token."""
    out = Sampler().sample(logits.expand(draws, -1).contiguous(), [params] * draws, [None] * draws)
    return torch.bincount(out.token_ids, minlength=logits.shape[-1])


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run_steps(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], steps: int
) -> torch.Tensor:
    """Samples `steps` times with generators freshly seeded from `seeds`; returns [steps, N] tokens."""
    generators = [None if s is None else generator(s) for s in seeds]
    return torch.stack([Sampler().sample(logits, params, generators).token_ids for _ in range(steps)])


def processed_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's processed scores by the documented contract, row by row: logits / temperature, then -inf
    outside the top-k, then -inf at every token whose preceding (descending) mass reaches top_p; greedy: raw."""
    if not params.do_sample:
        return logits.float()
    scores = logits.float() / params.temperature
    if params.top_k:
        scores = scores.masked_fill(scores < scores.topk(params.top_k).values[-1], float("-inf"))
    if params.top_p < 1.0:
        probs, order = torch.softmax(scores, -1).sort(descending=True)
        drop = torch.zeros_like(scores, dtype=torch.bool)
        drop[order] = probs.cumsum(-1) - probs >= params.top_p
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def processed(**kwargs: object) -> SamplingParams:
    return SamplingParams(logprobs_mode="processed", logprobs=True, **kwargs)  # type: ignore[arg-type]
