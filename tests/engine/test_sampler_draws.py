"""Tests for contbatch.engine.sampler's draws: which candidates a row ranks, the block search, the kept-token
scan, and the CPU's row kernel (`draw_rows`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from contbatch.engine import cpu_kernels, warpers
from contbatch.engine import sampler as sampler_module
from contbatch.engine.sampler import Sampler
from contbatch.engine.sampling_params import SamplingParams
from tests.engine.sampling_helpers import (
    ALPHA,
    chi2_pvalue,
    draw_counts,
    generator,
    processed,
    processed_reference,
    run_steps,
)
from tests.helpers import TEST_DEVICE


def test_processed_logprobs_reuse_the_sampling_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scores are processed (and sorted for top-k/top-p) once per step, for sampling and logprobs alike."""
    calls = []
    mask = sampler_module.mask_top_k_top_p

    def counted(scores: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls.append(scores.shape[0])
        return mask(scores, params)

    monkeypatch.setattr(sampler_module, "mask_top_k_top_p", counted)
    params = [processed(do_sample=True, top_k=4, top_p=0.8, top_logprobs=3), SamplingParams(logprobs=True),
              SamplingParams(do_sample=True, top_p=0.5, logprobs=True)]
    Sampler().sample(torch.randn(3, 50, generator=generator(12)), params, [None] * 3)
    assert calls == [2]


def test_rows_rank_only_their_candidates_and_mask_as_a_full_sort_does() -> None:
    """Rows rank only the tokens that can survive: a top-k row its k best, a top-p row without a top-k its
    NUCLEUS_CANDIDATES best when they hold its nucleus (a peaked row), else its whole vocabulary (a flat row).
    Every row gets the documented contract's mask, computed over the whole sorted vocabulary, and the same mask
    alone as in the batch."""
    vocab = 2 * warpers.NUCLEUS_CANDIDATES
    logits = torch.randn(8, vocab, generator=generator(11)) * torch.tensor([3.0] * 6 + [0.05, 3.0])[:, None]
    params = [SamplingParams(do_sample=True, top_k=k, top_p=p) for k, p in
              [(1, 1.0), (7, 1.0), (50, 0.9), (50, 0.5), (120, 0.99), (vocab - 1, 0.95), (0, 0.9), (0, 0.8)]]
    probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values
    candidates_mass = probs[:, :warpers.NUCLEUS_CANDIDATES].sum(dim=-1)
    assert candidates_mass[6] < 0.9 and candidates_mass[7] > 0.8  # row 6 is sorted whole, row 7 is not
    masked, candidates = warpers.mask_top_k_top_p(logits, params)
    assert candidates is None, "rows of different widths"
    for row, row_params in enumerate(params):
        expected = processed_reference(logits[row], row_params)
        assert torch.equal(masked[row].isinf(), expected.isinf()), row
        assert torch.equal(masked[row][~expected.isinf()], expected[~expected.isinf()])
        alone, row_candidates = warpers.mask_top_k_top_p(logits[row:row + 1], [row_params])
        assert torch.equal(masked[row], alone[0])
        if row_candidates is not None:
            kept = (~expected.isinf()).nonzero().squeeze(1)
            assert torch.isin(kept, row_candidates[0]).all() and bool((row_candidates.diff() > 0).all())
    assert [int((~row.isinf()).sum()) for row in masked[:2]] == [1, 7]


def test_draws_read_only_the_kept_tokens_in_vocabulary_order() -> None:
    scores = torch.full((2, 300), float("-inf"))
    scores[0, [250, 7, 99]] = torch.tensor([1.0, 2.0, 3.0])
    scores[1, 5] = 0.5
    values, token_ids = sampler_module._kept_tokens(scores)
    assert values.shape == (2, 64) and token_ids is not None
    assert token_ids[0, :3].tolist() == [7, 99, 250] and values[0, :3].tolist() == [2.0, 3.0, 1.0]
    assert token_ids[1, 0] == 5 and values[1, 1:].isinf().all() and values[0, 3:].isinf().all()
    assert sampler_module._kept_tokens(torch.randn(2, 300))[1] is None  # every token kept: the whole vocabulary


def test_a_seeded_draw_does_not_depend_on_how_many_tokens_other_rows_keep() -> None:
    logits = torch.randn(2, 5000, generator=generator(3))
    mine = SamplingParams(do_sample=True, top_k=3, seed=5)
    alone = run_steps(logits[:1], [mine], [5], steps=40)[:, 0]
    for other in (SamplingParams(do_sample=True, top_k=300), SamplingParams(do_sample=True, top_k=3000),
                  SamplingParams(do_sample=True)):
        assert torch.equal(run_steps(logits, [mine, other], [5, None], steps=40)[:, 0], alone)


def test_a_wide_vocabulary_draws_in_proportion_across_its_blocks(seeded_global_rng: None) -> None:
    """Wider than DRAW_BLOCK, a row finds its block from the blocks' totals, then its token: tokens in the first,
    a middle and the last (partial) block come in proportion, and the negligible rest never."""
    vocab = 2 * sampler_module.DRAW_BLOCK + 452
    chosen = [5, sampler_module.DRAW_BLOCK + 476, vocab - 100, vocab - 1]
    logits = torch.full((vocab,), -40.0)
    logits[chosen] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    counts = draw_counts(logits, SamplingParams(do_sample=True), draws=8000)
    assert int(counts.sum() - counts[chosen].sum()) == 0
    assert chi2_pvalue(counts[chosen], torch.tensor([0.4, 0.3, 0.2, 0.1])) > ALPHA
    assert chi2_pvalue(counts[chosen], torch.tensor([0.35, 0.3, 0.2, 0.15])) < ALPHA


def test_the_block_search_picks_the_token_a_running_sum_picks() -> None:
    """Against one running sum over the whole row: the same token for uniforms spread over [0, 1), the first
    token of positive probability at 0 and the last one just below 1, never a token of probability 0."""
    width = 3 * sampler_module.DRAW_BLOCK + 7
    probs = torch.rand(4, width, generator=generator(6)) * (torch.rand(4, width, generator=generator(7)) > 0.5)
    probs[:, :3] = 0.0
    probs[:, -5:] = 0.0
    uniforms = torch.rand(4, 200, generator=generator(8), dtype=torch.float64)
    uniforms[:, 0], uniforms[:, 1] = 0.0, 1.0 - 2**-53
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    for column in range(uniforms.shape[1]):
        u = uniforms[:, column:column + 1]
        drawn, total = sampler_module._inverse_transform(probs, u)
        assert torch.allclose(total, cdf[:, -1:], rtol=1e-6)
        assert torch.equal(drawn, torch.searchsorted(cdf, sampler_module._target(u, cdf[:, -1:]), right=True))
        assert bool((probs.gather(1, drawn) > 0).all())
    first_positive = (probs > 0).int().argmax(dim=1, keepdim=True)
    assert torch.equal(sampler_module._inverse_transform(probs, torch.zeros(4, 1, dtype=torch.float64))[0],
                       first_positive)


@pytest.mark.parametrize(("settings", "expected"), [
    ({}, [0.4, 0.3, 0.2, 0.1]),
    ({"top_k": 3}, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0.0]),
    ({"top_p": 0.6}, [0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0]),
])
def test_the_test_device_draws_the_documented_distributions(seeded_global_rng: None, settings: dict[str, float],
                                                            expected: list[float]) -> None:
    """On the test device (a GPU with CONTBATCH_TEST_DEVICE=cuda: there top-p sorts the whole vocabulary and the
    draw runs over it, blocks first), plain, top-k and top-p rows over a vocabulary of several blocks draw in
    their documented proportions, never outside the tokens they keep."""
    vocab = 2 * sampler_module.DRAW_BLOCK + 452
    chosen = [5, sampler_module.DRAW_BLOCK + 476, vocab - 100, vocab - 1]
    logits = torch.full((vocab,), -40.0)
    logits[chosen] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    draws = 6000
    batch = logits.to(TEST_DEVICE).expand(draws, -1).contiguous()
    params = [SamplingParams(do_sample=True, **settings)] * draws  # type: ignore[arg-type]
    tokens = Sampler().sample(batch, params, [None] * draws).token_ids
    counts = torch.bincount(tokens, minlength=vocab)
    probs = torch.tensor(expected)
    assert int(counts.sum() - counts[chosen].sum()) == 0 and int(counts[chosen][probs == 0].sum()) == 0
    assert chi2_pvalue(counts[chosen], probs) > ALPHA


def test_a_draw_from_ranked_candidates_equals_the_draw_from_the_kept_tokens() -> None:
    """Top-k rows draw from their ranked candidates (ascending ids, dropped ones at -inf) without scanning the
    vocabulary for what they keep; a dropped candidate adds an exact 0 to the running sum, so every draw is the
    draw from the kept tokens alone, uniform for uniform."""
    logits = torch.randn(16, 3000, generator=generator(21)) * 2
    for top_k, top_p in ((50, 1.0), (50, 0.8), (7, 0.5), (300, 0.95)):
        params = [SamplingParams(do_sample=True, temperature=0.7, top_k=top_k, top_p=top_p)] * 16
        processed = sampler_module._process(logits, params, list(range(16)))
        scores, candidates = processed.scores, processed.candidates
        assert candidates is not None and candidates.shape == (16, top_k)
        for seed in range(20):
            draws = [sampler_module._draw(sampler_module._Processed(list(range(16)), scores, kept),
                                          [torch.Generator().manual_seed(seed * 16 + row) for row in range(16)])
                     for kept in (candidates, None)]
            assert torch.equal(draws[0], draws[1]), (top_k, top_p, seed)


@pytest.mark.parametrize("vocab", [300, 3 * 1024 + 50])
def test_a_draw_over_the_whole_vocabulary_gives_processed_logprobs_their_normaliser(vocab: int) -> None:
    """A draw over every token (plain sampling) sums the row's probabilities anyway; processed logprobs take
    their normaliser from that sum instead of a second pass, and equal log_softmax of the processed scores, in
    a batch with rows that keep few tokens too."""
    logits = torch.randn(3, vocab, generator=generator(31)) * 4
    params = [processed(do_sample=True, temperature=0.8, top_logprobs=2), processed(do_sample=True, top_k=5),
              processed(do_sample=True)]
    out = Sampler().sample(logits, params, [generator(row) for row in range(3)])
    assert out.logprobs is not None and out.top_logprobs is not None
    for row, row_params in enumerate(params):
        expected = torch.log_softmax(processed_reference(logits[row], row_params), dim=-1)
        assert torch.allclose(out.logprobs[row], expected[out.token_ids[row]], atol=1e-5), row
    expected_top = torch.log_softmax(logits[0] / 0.8, dim=-1).topk(2).values
    assert torch.allclose(out.top_logprobs[0][0], expected_top, atol=1e-5)


needs_draw_rows = pytest.mark.skipif(cpu_kernels.row_draw_kernel() is None,
                                     reason="draw_rows needs AVX2 and a C++ compiler")


@needs_draw_rows
@pytest.mark.parametrize("vocab", [300, 1024, 3 * 1024 + 50])
def test_the_row_kernel_draws_by_the_inverse_transform(vocab: int) -> None:
    """`draw_rows` (the CPU's draw over whole rows): each token is where the row's uniform falls in its cumulative
    probabilities (float64 here, to the rounding of a float32 block sum), never a -inf token, and each row's
    logsumexp comes back; a row of -inf only gets token 0."""
    kernel = cpu_kernels.row_draw_kernel()
    assert kernel is not None
    scores = torch.randn(64, vocab, generator=generator(vocab)) * 4
    scores[::3, ::2] = float("-inf")
    scores[5] = float("-inf")
    scores[5, vocab - 7] = 2.0
    scores[7] = float("-inf")
    uniforms = torch.rand(64, generator=generator(1), dtype=torch.float64)
    uniforms[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 0.25], dtype=torch.float64)
    tokens, log_norm = kernel(torch.cat([scores[:7], scores[8:]]), torch.cat([uniforms[:7], uniforms[8:]]))
    rows = [row for row in range(64) if row != 7]
    probs = (scores[rows].double() - scores[rows].double().amax(dim=1, keepdim=True)).exp()
    cdf = probs.cumsum(dim=1)
    target = uniforms[rows] * cdf[:, -1]
    before = torch.where(tokens > 0, cdf.gather(1, (tokens - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    slack = 1e-5 * cdf[:, -1]
    after = cdf.gather(1, tokens[:, None])[:, 0]
    assert bool((before <= target + slack).all()) and bool((target <= after + slack).all())
    assert bool((scores[rows].gather(1, tokens[:, None]) > float("-inf")).all()) and tokens[5] == vocab - 7
    torch.testing.assert_close(log_norm, torch.logsumexp(scores[rows], dim=1), rtol=1e-5, atol=1e-5)
    assert kernel(scores[7:8].contiguous(), uniforms[7:8])[0].tolist() == [0]


@needs_draw_rows
def test_plain_rows_on_a_cpu_draw_through_the_row_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows no warper masked skip the scan for kept tokens and draw in the kernel; the chi-square tests above then
    check its distribution."""
    calls = []
    kernel = cpu_kernels.row_draw_kernel()
    assert kernel is not None

    def counted(scores: torch.Tensor, uniforms: torch.Tensor) -> list[torch.Tensor]:
        calls.append(scores.shape)
        return kernel(scores, uniforms)

    monkeypatch.setattr(sampler_module, "row_draw_kernel", lambda: counted)
    monkeypatch.setattr(sampler_module, "_kept_tokens", lambda _: pytest.fail("scanned for kept tokens"))
    logits = torch.randn(4, 5000, generator=generator(3))
    Sampler().sample(logits, [SamplingParams(do_sample=True, temperature=0.9)] * 4, [None] * 4)
    assert calls == [torch.Size([4, 5000])]
