"""Chooses the next token of every running request from one batched logits tensor."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contbatch.engine.cpu_kernels import greedy_tokens, row_draw_kernel
from contbatch.engine.device_values import device_tensor
from contbatch.engine.logits_processors import TokenHistory, apply_processors
from contbatch.engine.sampling_params import SamplingParams
from contbatch.engine.warpers import mask_min_p, mask_top_k_top_p


@dataclass
class SamplerOutput:
    """The tokens chosen for one batch.

    Attributes:
        token_ids: [N] int64; row i is the token chosen for the request of logits row i.
        logprobs: [N] float32: for each row that asked for logprobs, log_softmax at the chosen token of
            the distribution its `logprobs_mode` names (see `SamplingParams`); the values of the other rows are
            unspecified. None when no row asked.
        top_logprobs: ([N, k] log-probabilities, [N, k] token ids) of each asking row's k most likely tokens
            under that distribution, k the largest `top_logprobs` asked for in the batch; tokens that top-k or
            top-p removed have log-probability -inf. None when no row asked.

    All on one device: the logits' (`Sampler.draw`) or the CPU (`Sampler.sample`).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SamplerOutput:
        """The same output on `device` (`Tensor.to` of each tensor: itself where it is there already)."""
        top = self.top_logprobs
        return SamplerOutput(
            self.token_ids.to(device, non_blocking=non_blocking),
            None if self.logprobs is None else self.logprobs.to(device, non_blocking=non_blocking),
            None if top is None else (top[0].to(device, non_blocking=non_blocking),
                                      top[1].to(device, non_blocking=non_blocking)))


DRAW_CANDIDATES = 4096
"""On a CPU, a sampled batch whose rows each keep at most this many tokens (the others at -inf: top-k, top-p, min-p,
a grammar) draws from those tokens alone (`_kept_tokens`): over a 49k vocabulary, the exponentials of the -inf
scores (a slow path of the vectorised exp) and their float64 running sum cost more than the model's head."""


DRAW_BLOCK = 1024
"""The draw's block of tokens (`_inverse_transform`)."""


@dataclass
class _Processed:
    """The distribution the sampled rows were drawn from.

    Attributes:
        rows: the batch rows that sampled, in batch order; row j of `scores` is batch row rows[j].
        scores: [M, vocab] float32 processed scores (see `process_logits`).
        candidates: [M, w] each row's candidate token ids, ascending, holding every token the row keeps (a
            score above -inf), when masking ranked them (`mask_top_k_top_p`); else None.
        drawn_log_norm: [M, 1] the rows' logsumexp from a draw over the whole vocabulary (`_draw` sets it).
        warped: whether a warper (top-k, top-p, min-p) may have removed tokens; False: only the processors or a
            grammar did, if anything.
    """

    rows: list[int]
    scores: torch.Tensor
    candidates: torch.Tensor | None = None
    drawn_log_norm: torch.Tensor | None = None
    warped: bool = True

    @functools.cached_property
    def log_norm(self) -> torch.Tensor:
        """[M, 1] logsumexp of `scores`: scores - log_norm is the log-probability of every token (computed for
        the rows that read processed logprobs, unless the draw summed the whole vocabulary: `drawn_log_norm`)."""
        if self.drawn_log_norm is not None:
            return self.drawn_log_norm
        return self.scores.logsumexp(dim=-1, keepdim=True)


class Sampler:
    """Greedy, temperature, top-k and top-p sampling, vectorised across the rows of a batch."""

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None],
               histories: Sequence[TokenHistory | None] | None = None) -> SamplerOutput:
        """`draw`, its output moved to the CPU."""
        return self.draw(logits, params, generators, histories).to("cpu")

    def draw(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[TokenHistory | None] | None = None,
    ) -> SamplerOutput:
        """Chooses one token per row of `logits`, leaving the results on the logits' device. On a GPU nothing in it
        waits for the device (no synchronisation), so the host may launch the next step's forward at once.

        Args:
            logits: [N, vocab] float logits, on any device; all work stays on that device.
            params: N sampling parameters; row i follows params[i]. Rows may mix greedy and sampling, and
                logprobs modes.
            generators: N generators on the logits' device; a sampled row with a generator draws its
                randomness only from it, so its token depends only on its logits, its parameters and its
                generator state, not on the rest of the batch (nor on whether or how it asked for logprobs).
                None draws from the global RNG.
            histories: each row's tokens so far (None for a row that needs none); needed when a row uses logits
                processors (penalties, biases, banned tokens, `min_tokens`: see `apply_processors`), which apply
                to greedy rows too, as in `generate`.

        Returns:
            The chosen tokens and, when any row asked, their log-probabilities. Processed
            logprobs reuse the scores and normaliser the tokens were drawn with: no second pass of processing.

        Raises:
            ValueError: when logits is not 2-D, params/generators do not have one entry per row, or a row uses
                processors without histories.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, vocab], got shape {tuple(logits.shape)}")
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(f"got {n} logits rows, {len(params)} params and {len(generators)} generators")
        adjusted = apply_processors(logits, params, histories)
        sampled = [i for i, p in enumerate(params) if p.do_sample]
        whole = len(sampled) == n
        token_ids = adjusted.new_empty(0, dtype=torch.long) if whole else greedy_tokens(adjusted)
        processed = None
        if sampled:
            rows = None if whole else device_tensor(sampled, logits.device)
            processed = _process(adjusted if rows is None else adjusted.index_select(0, rows),
                                 params if whole else [params[i] for i in sampled], sampled)
            chosen = _draw(processed, generators if whole else [generators[i] for i in sampled])
            if rows is None:
                token_ids = chosen
            else:
                token_ids[rows] = chosen
        logprobs, top = _logprobs(_logprobs_base(logits, adjusted, params), token_ids, params, processed)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The scores sampled rows draw from: [M, vocab] float32 `logits` (already through `apply_processors`)
    divided by each row's temperature, then masked to -inf outside its top-k, outside its top-p nucleus
    (`mask_top_k_top_p`) and below its min-p threshold (`mask_min_p`): `generate`'s warpers, in its order.
    Every warper belongs here, so that "processed" logprobs see exactly what sampling saw."""
    return _process(logits, params, []).scores


def _process(logits: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]) -> _Processed:
    """`process_logits` of batch rows `rows`, with the candidates of `mask_top_k_top_p` (min-p only removes
    more tokens)."""
    scores = logits.float()
    temperatures = [p.temperature for p in params]
    if len(set(temperatures)) == 1:
        scores = scores if temperatures[0] == 1.0 else scores / temperatures[0]
    else:
        scores = scores / device_tensor(temperatures, scores.device, torch.float32)[:, None]
    masked, candidates = mask_top_k_top_p(scores, params)
    processed = mask_min_p(masked, params)
    return _Processed(rows, processed, candidates, warped=processed is not scores)


def _draw(processed: _Processed, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draws one token per row of `processed` from softmax(scores) and returns [M] int64.

    Inverse transform over the tokens each row keeps, in vocabulary order (`_kept_tokens`): with u uniform in
    [0, 1), the row's token is the first whose cumulative probability (float64) exceeds u times the row's total;
    the probabilities are exp(score - the row's largest score), which the total normalises. A token of
    probability 0 spans an empty interval and is never drawn. One random number per row: drawing noise over the
    whole vocabulary instead cost ~20% of a CPU decode step. A draw over the whole vocabulary also records the
    rows' logsumexp (the shift plus the log of the total) in `processed.drawn_log_norm`. On a CPU such a draw
    (rows no warper masked, or keeping more than DRAW_CANDIDATES tokens) runs in one kernel, `draw_rows`: the
    same draw in two passes over the scores (1.3 ms against 6.3 ms at 128 rows of the embedded model)."""
    values, token_ids = _candidate_scores(processed.scores, processed.candidates)
    kernel = row_draw_kernel() if token_ids is None and _whole_rows_on_cpu(values) else None
    if token_ids is None and (kernel is None or processed.warped):
        values, token_ids = _kept_tokens(processed.scores)
    if kernel is not None and token_ids is None:
        chosen, log_norm = kernel(values.contiguous(), _uniforms(generators, values.device).view(-1))
        processed.drawn_log_norm = log_norm[:, None]
        return chosen
    shift = values.amax(dim=-1, keepdim=True)
    probs = (values - shift).exp_()
    chosen, total = _inverse_transform(probs, _uniforms(generators, probs.device))
    if token_ids is None:
        processed.drawn_log_norm = shift + total.log().float()
    return (chosen if token_ids is None else token_ids.gather(1, chosen)).squeeze(1)


def _whole_rows_on_cpu(values: torch.Tensor) -> bool:
    """Whether `draw_rows` takes these rows: float32 on a CPU, the sampler's block of 1,024 tokens."""
    return values.device.type == "cpu" and values.dtype == torch.float32 and DRAW_BLOCK == 1024


def _inverse_transform(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, 1] the index of each row's drawn token, the first whose cumulative probability (float64) exceeds the
    row's uniform times its total, and [M, 1] that total. A row wider than DRAW_BLOCK finds its block first, from
    the blocks' totals, then its token within that block, so that only one block per row is summed a token at a
    time (the running sum of a 49k vocabulary in float64 cost more than its exponentials); the blocks are fixed by
    the width, so a row's draw does not depend on the batch. A block's total is summed in float32 (relative error
    ~1e-7; a float64 sum converts the whole row first, 70 times slower), the running sums over blocks and within
    the chosen block in float64."""
    width = probs.shape[1]
    if width <= DRAW_BLOCK:
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        return torch.searchsorted(cdf, _target(uniforms, cdf[:, -1:]), right=True), cdf[:, -1:]
    full = width // DRAW_BLOCK * DRAW_BLOCK
    sums = [probs[:, :full].view(probs.shape[0], -1, DRAW_BLOCK).sum(dim=-1)]
    if full < width:
        sums.append(probs[:, full:].sum(dim=-1, keepdim=True))
    block_cdf = torch.cat(sums, dim=1).double().cumsum(dim=-1)
    target = _target(uniforms, block_cdf[:, -1:])
    block = torch.searchsorted(block_cdf, target, right=True)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    index = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)
    within = probs.gather(1, index.clamp(max=width - 1)).masked_fill(index >= width, 0.0)
    cdf = within.cumsum(dim=-1, dtype=torch.float64)
    # The block's running sum may round below its total: the last token of positive probability then takes it.
    local = torch.minimum(target - before, torch.nextafter(cdf[:, -1:], torch.zeros_like(before)))
    return block * DRAW_BLOCK + torch.searchsorted(cdf, local, right=True), block_cdf[:, -1:]


def _target(uniforms: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """u times the total, kept below it (u < 1 could round the product up to the total)."""
    return torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))


def _candidate_scores(scores: torch.Tensor, candidates: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                                      torch.Tensor | None]:
    """[M, w] the scores of each row's `candidates` and [M, w] their ids, w their width rounded up to a multiple
    of 64 (padding: -inf at token 0), on any device: the same draw as from the kept tokens alone, since a
    candidate the row does not keep adds an exact 0 to the running sum. `(scores, None)` when there are no
    candidates or they are wider than DRAW_BLOCK (the draw from the kept tokens then sums differently)."""
    if candidates is None:
        return scores, None
    width = -(-candidates.shape[1] // 64) * 64
    if width > DRAW_BLOCK:
        return scores, None
    values = scores.gather(1, candidates)
    if width > candidates.shape[1]:
        pad = (0, width - candidates.shape[1])
        values = torch.nn.functional.pad(values, pad, value=float("-inf"))
        candidates = torch.nn.functional.pad(candidates, pad)
    return values, candidates


def _kept_tokens(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens each row of [M, vocab] `scores` keeps (a score above -inf), in vocabulary order: [M, w] their
    scores (padded with -inf) and [M, w] their ids, w the most any row keeps rounded up to a multiple of 64 (so
    that no element of an elementwise op over them falls in a scalar tail, whose rounding could differ: a row's
    draw stays independent of the batch). `(scores, None)` on a GPU, or when some row keeps more than
    DRAW_CANDIDATES tokens."""
    if scores.device.type != "cpu":
        return scores, None
    kept = scores > float("-inf")
    if scores.shape[1] > DRAW_CANDIDATES and bool(kept.all()):
        return scores, None
    counts = kept.view(torch.uint8).sum(dim=-1, dtype=torch.int32)  # a bool sum converts to int64 first: 6x slower
    width = -(-int(counts.max()) // 64) * 64
    if width > min(DRAW_CANDIDATES, scores.shape[1]):
        return scores, None
    rows, ids = kept.nonzero(as_tuple=True)
    slots = torch.arange(len(rows)) - (counts.cumsum(0) - counts)[rows]
    values = scores.new_full((scores.shape[0], width), float("-inf"))
    values[rows, slots] = scores[rows, ids]
    token_ids = torch.zeros((scores.shape[0], width), dtype=torch.long)
    token_ids[rows, slots] = ids
    return values, token_ids


def _logprobs_base(logits: torch.Tensor, adjusted: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The scores logprobs are read from for rows that did not sample: raw `logits`, except the rows in
    "processed" mode, which read the processors' output `adjusted`."""
    if adjusted is logits or not any(p.wants_logprobs for p in params):
        return logits
    rows = [i for i, p in enumerate(params) if p.wants_logprobs and p.processed_logprobs and not p.do_sample]
    if not rows:
        return logits
    index = device_tensor(rows, logits.device)
    return logits.float().index_copy(0, index, adjusted.index_select(0, index))


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams], processed: _Processed | None
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """The `SamplerOutput` logprobs and top logprobs of the batch; (None, None) when no row asks.
    Sampled rows in "processed" mode are read from `processed` (which holds every sampled row), the others
    from `logits` (see `_logprobs_base`); the pass over `logits` is skipped when no row needs it."""
    if not any(p.wants_logprobs for p in params):
        return None, None
    k = max(p.top_logprobs for p in params)
    targets = [i for i, p in enumerate(params) if p.wants_logprobs and p.processed_logprobs and p.do_sample]
    if processed is None or not targets:
        return _read(logits.float(), None, token_ids, k)
    dest = device_tensor(targets, token_ids.device)
    values, top = _read_processed(processed, targets, token_ids.index_select(0, dest), k)
    if len(targets) == len(params):
        return values, top
    if any(p.wants_logprobs and not (p.processed_logprobs and p.do_sample) for p in params):
        base, base_top = _read(logits.float(), None, token_ids, k)
    else:
        base = torch.zeros(token_ids.shape, device=token_ids.device)
        base_top = (torch.zeros((len(params), k), device=token_ids.device),
                    torch.zeros((len(params), k), dtype=torch.long, device=token_ids.device))
    base = base.index_copy(0, dest, values)
    if top is not None and base_top is not None:
        base_top = (base_top[0].index_copy(0, dest, top[0]), base_top[1].index_copy(0, dest, top[1]))
    return base, base_top


def _read_processed(
    processed: _Processed, targets: list[int], token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """`_read` of the processed rows of batch rows `targets` (sampled rows, in batch order) at `token_ids`."""
    scores, log_norm = processed.scores, processed.log_norm
    if len(targets) < len(processed.rows):
        wanted = set(targets)
        index = device_tensor([j for j, row in enumerate(processed.rows) if row in wanted], scores.device)
        scores, log_norm = scores.index_select(0, index), log_norm.index_select(0, index)
    return _read(scores, log_norm, token_ids, k)


def _read(
    scores: torch.Tensor, log_norm: torch.Tensor | None, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """log_softmax of [R, vocab] float32 `scores` at `token_ids` ([R]) and, when k > 0, its k largest values
    with their ids, computed as score - `log_norm` (the rows' logsumexp, computed here when None) so that no
    second [R, vocab] tensor is materialised."""
    if log_norm is None:
        log_norm = scores.logsumexp(dim=-1, keepdim=True)
    values = (scores.gather(1, token_ids[:, None]) - log_norm).squeeze(1)
    if not k:
        return values, None
    top_values, top_ids = scores.topk(k, dim=-1)
    return values, (top_values - log_norm, top_ids)


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[M, 1] float64 uniforms in [0, 1): row i from generators[i] alone when it is set, the others from the
    global RNG in one draw."""
    uniforms = torch.rand((len(generators), 1), dtype=torch.float64, device=device)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniforms[i] = torch.rand((1,), dtype=torch.float64, device=device, generator=generator)
    return uniforms
