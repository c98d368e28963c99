"""Chooses the next token of every running request from one batched logits tensor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contbatch.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    """The tokens chosen for one batch.

    Attributes:
        token_ids: [N] int64 on CPU; row i is the token chosen for the request of logits row i.
        logprobs: [N] float32 on CPU, log_softmax of the raw logits (before temperature, top-k and top-p)
            at the chosen token, filled for every row; None when no row asked for logprobs.
        top_logprobs: ([N, k] log-probabilities, [N, k] token ids) of each row's k most likely tokens, k the
            largest `top_logprobs` asked for in the batch, on CPU; None when no row asked.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


class Sampler:
    """Greedy, temperature, top-k and top-p sampling, vectorised across the rows of a batch."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> SamplerOutput:
        """Chooses one token per row of `logits`.

        Args:
            logits: [N, vocab] float logits, on any device; all work stays on that device.
            params: N sampling parameters; row i follows params[i].
            generators: N generators on the logits' device; a sampled row with a generator draws its
                randomness only from it, so its token depends only on its logits, its parameters and its
                generator state, not on the rest of the batch. None draws from the global RNG.

        Returns:
            The chosen tokens and, when any row asked, their log-probabilities, moved to CPU.

        Raises:
            ValueError: when logits is not 2-D or params/generators do not have one entry per row.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, vocab], got shape {tuple(logits.shape)}")
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(f"got {n} logits rows, {len(params)} params and {len(generators)} generators")
        token_ids = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if p.do_sample]
        if len(sampled) == n and n > 0:
            token_ids = _sample_rows(logits, params, generators)
        elif sampled:
            rows = torch.tensor(sampled, device=logits.device)
            token_ids[rows] = _sample_rows(
                logits.index_select(0, rows), [params[i] for i in sampled], [generators[i] for i in sampled]
            )
        logprobs = top = None
        if any(p.wants_logprobs for p in params):
            raw = logits.float()
            normaliser = raw.logsumexp(dim=-1, keepdim=True)
            # logit - logsumexp equals log_softmax at the token without materialising a second [N, vocab].
            logprobs = (raw.gather(1, token_ids[:, None]) - normaliser).squeeze(1).cpu()
            k = max(p.top_logprobs for p in params)
            if k:
                values, ids = raw.topk(k, dim=-1)
                top = ((values - normaliser).cpu(), ids.cpu())
        return SamplerOutput(token_ids=token_ids.cpu(), logprobs=logprobs, top_logprobs=top)


def _sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Samples one token per row of [M, vocab] `logits` (all rows with do_sample) and returns [M] int64."""
    device = logits.device
    scores = logits.float()
    temperatures = [p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):
        scores = scores / torch.tensor(temperatures, dtype=torch.float32, device=device)[:, None]
    scores = _mask_top_k_top_p(scores, params)
    probs = torch.softmax(scores, dim=-1)
    noise = _exponential_noise(probs.shape, generators, device)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i / sum(p), exactly;
    # masked tokens have p_i == 0 and noise is bounded away from 0, so they can never win.
    return (probs / noise).argmax(dim=-1)


def _mask_top_k_top_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Returns [M, vocab] `scores` with -inf at every token outside each row's top-k, then outside the nucleus
    of the top-k survivors' renormalised probabilities. Each row keeps at least its most likely token."""
    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if not (use_top_k or use_top_p):
        return scores
    m, vocab = scores.shape
    device = scores.device
    # Stable so that ties are broken the same way whatever else is in the batch.
    sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab, device=device)
    drop = torch.zeros((m, vocab), dtype=torch.bool, device=device)
    if use_top_k:
        ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        drop |= positions[None, :] >= ks[:, None]
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    if use_top_p:
        # Rows without top-p get an unreachable threshold: rounding could push their cumulative sum past 1.0.
        top_ps = torch.tensor(
            [p.top_p if p.top_p < 1.0 else float("inf") for p in params], dtype=torch.float32, device=device
        )
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # A token is in the nucleus iff the tokens ranked above it have not yet reached top_p; the top token's
        # mass before is exactly 0 and top_p > 0, so it is always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_ps[:, None]
    drop_unsorted = torch.empty_like(drop).scatter_(1, order, drop)
    return scores.masked_fill(drop_unsorted, float("-inf"))


def _exponential_noise(
    shape: torch.Size, generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """Returns [M, vocab] float32 Exp(1) noise, strictly positive; row i comes from generators[i] alone when
    it is set, and rows without a generator share one draw from the global RNG."""
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    else:
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
        if shared:
            noise[torch.tensor(shared, device=device)] = torch.empty(
                (len(shared), shape[1]), dtype=torch.float32, device=device
            ).exponential_()
    # A zero draw would turn 0 / 0 into NaN, which argmax would pick.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)
