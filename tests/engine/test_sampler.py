"""Tests for contbatch.engine.sampler: greedy, temperature/top-k/top-p distributions, logprobs and seeding."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
import torch

from contbatch.engine import cpu_kernels, warpers
from contbatch.engine import sampler as sampler_module
from contbatch.engine.sampler import Sampler, SamplerOutput
from contbatch.engine.sampling_params import SamplingParams
from tests.conftest import TEST_DEVICE

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


@pytest.fixture
def seeded_global_rng() -> Iterator[None]:
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        yield


def draw_counts(logits: torch.Tensor, params: SamplingParams, draws: int = DRAWS) -> torch.Tensor:
    """Samples `draws` times from one row of logits (as a batch of identical rows) and counts each token."""
    out = Sampler().sample(logits.expand(draws, -1).contiguous(), [params] * draws, [None] * draws)
    return torch.bincount(out.token_ids, minlength=logits.shape[-1])


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_chi2_sf_matches_table_values() -> None:
    for statistic, df in [(3.841, 1), (5.991, 2), (7.815, 3), (14.067, 7), (15.507, 8)]:
        assert chi2_sf(statistic, df) == pytest.approx(0.05, abs=2e-4)
    assert chi2_sf(24.322, 7) == pytest.approx(0.001, abs=2e-5)


def test_greedy_rows_take_argmax() -> None:
    logits = torch.randn(6, 50, generator=generator(0))
    out = Sampler().sample(logits, [GREEDY] * 6, [None] * 6)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.device.type == "cpu"
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_exact_in_mixed_batch() -> None:
    logits = torch.randn(8, 50, generator=generator(1))
    hot = SamplingParams(do_sample=True, temperature=5.0)
    params = [GREEDY, hot, hot, GREEDY, hot, GREEDY, GREEDY, hot]
    for _ in range(20):
        out = Sampler().sample(logits, params, [None] * 8)
        for i, p in enumerate(params):
            if not p.do_sample:
                assert out.token_ids[i] == logits[i].argmax()


def test_greedy_bf16_logits() -> None:
    logits = torch.randn(4, 30, generator=generator(2)).to(torch.bfloat16)
    out = Sampler().sample(logits, [SamplingParams(logprobs=True)] * 4, [None] * 4)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32


def test_empty_batch() -> None:
    out = Sampler().sample(torch.zeros(0, 10), [], [])
    assert out.token_ids.shape == (0,) and out.logprobs is None


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 10), [GREEDY], [None, None])


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_temperature_matches_softmax_and_wrong_temperature_is_rejected(
    seeded_global_rng: None, temperature: float
) -> None:
    logits = torch.randn(8, generator=generator(3)) * 1.5
    counts = draw_counts(logits, SamplingParams(do_sample=True, temperature=temperature))
    assert chi2_pvalue(counts, torch.softmax(logits / temperature, -1)) > ALPHA
    # Power: the same counts must reject a nearby wrong temperature and the untempered distribution.
    assert chi2_pvalue(counts, torch.softmax(logits / (temperature * 1.15), -1)) < ALPHA
    assert chi2_pvalue(counts, torch.softmax(logits, -1)) < ALPHA


def test_top_k_stays_in_top_k_with_renormalised_proportions(seeded_global_rng: None) -> None:
    logits = torch.randn(8, generator=generator(4))
    k = 5
    counts = draw_counts(logits, SamplingParams(do_sample=True, top_k=k))
    top = logits.topk(k).indices
    outside = torch.ones(8, dtype=torch.bool)
    outside[top] = False
    assert counts[outside].sum() == 0
    expected = torch.softmax(logits.masked_fill(outside, float("-inf")), -1)
    assert chi2_pvalue(counts, expected) > ALPHA
    assert chi2_pvalue(counts[top], torch.softmax(logits[top] / 1.15, -1)) < ALPHA


def test_top_k_one_is_argmax_even_among_near_ties(seeded_global_rng: None) -> None:
    logits = torch.tensor([1.0, 1.0 + 1e-4, 1.0, 0.9999, 1.0])
    counts = draw_counts(logits, SamplingParams(do_sample=True, top_k=1, temperature=10.0), draws=5000)
    assert counts.tolist() == [0, 5000, 0, 0, 0]


PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])


def test_top_p_stays_in_known_nucleus_with_renormalised_proportions(seeded_global_rng: None) -> None:
    # Mass before each token: 0, .40, .65, .80, ... so top_p=0.7 keeps exactly the first three.
    counts = draw_counts(PROBS.log(), SamplingParams(do_sample=True, top_p=0.7))
    assert counts[3:].sum() == 0
    assert chi2_pvalue(counts, torch.cat([PROBS[:3] / PROBS[:3].sum(), torch.zeros(4)])) > ALPHA
    assert chi2_pvalue(counts[:3], torch.softmax(PROBS[:3].log() / 1.15, -1)) < ALPHA


def test_top_p_applies_to_top_k_renormalised_probs(seeded_global_rng: None) -> None:
    # After top_k=3 the probs are .5, .3125, .1875: top_p=0.7 keeps two tokens (raw probs would keep three).
    counts = draw_counts(PROBS.log(), SamplingParams(do_sample=True, top_k=3, top_p=0.7))
    assert counts[2:].sum() == 0
    assert chi2_pvalue(counts[:2], torch.tensor([0.4, 0.25]) / 0.65) > ALPHA


def test_tiny_top_p_keeps_the_top_token(seeded_global_rng: None) -> None:
    counts = draw_counts(PROBS.log(), SamplingParams(do_sample=True, top_p=0.01), draws=2000)
    assert counts.tolist() == [2000, 0, 0, 0, 0, 0, 0]


def test_top_p_is_taken_over_tempered_probs(seeded_global_rng: None) -> None:
    # At temperature 0.5 the top token alone has probability 0.4**2 / sum(p**2) ~= 0.56 >= 0.55.
    counts = draw_counts(PROBS.log(), SamplingParams(do_sample=True, temperature=0.5, top_p=0.55), draws=2000)
    assert counts.tolist() == [2000, 0, 0, 0, 0, 0, 0]


def test_per_row_params_in_one_batch(seeded_global_rng: None) -> None:
    logits = torch.randn(8, generator=generator(5))
    params = [SamplingParams(do_sample=True, top_k=2), SamplingParams(do_sample=True, temperature=0.8)]
    out = Sampler().sample(logits.expand(2 * DRAWS, -1).contiguous(), params * DRAWS, [None] * (2 * DRAWS))
    top2 = set(logits.topk(2).indices.tolist())
    assert set(out.token_ids[0::2].tolist()) <= top2
    counts = torch.bincount(out.token_ids[1::2], minlength=8)
    assert chi2_pvalue(counts, torch.softmax(logits / 0.8, -1)) > ALPHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_at_chosen_token(seeded_global_rng: None, dtype: torch.dtype) -> None:
    logits = (torch.randn(6, 40, generator=generator(6)) * 3).to(dtype)
    params = [
        SamplingParams(logprobs=True),
        SamplingParams(do_sample=True, temperature=0.3, logprobs=True),
        SamplingParams(do_sample=True, temperature=2.0, top_k=5, logprobs=True),
        SamplingParams(do_sample=True, top_p=0.5, logprobs=True),
        SamplingParams(),
        SamplingParams(do_sample=True, temperature=1.7),
    ]
    out = Sampler().sample(logits, params, [None] * 6)
    assert out.logprobs is not None
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (6,)
    expected = torch.log_softmax(logits.float(), -1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)


def test_logprobs_none_when_no_row_asks() -> None:
    params = [SamplingParams(), SamplingParams(do_sample=True, top_k=3)]
    out = Sampler().sample(torch.randn(2, 20), params, [None, generator(0)])
    assert out.logprobs is None


def run_steps(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], steps: int
) -> torch.Tensor:
    """Samples `steps` times with generators freshly seeded from `seeds`; returns [steps, N] tokens."""
    generators = [None if s is None else generator(s) for s in seeds]
    return torch.stack([Sampler().sample(logits, params, generators).token_ids for _ in range(steps)])


def test_fresh_seeds_reproduce_tokens() -> None:
    logits = torch.randn(3, 100, generator=generator(7))
    params = [
        SamplingParams(do_sample=True, seed=1),
        SamplingParams(do_sample=True, temperature=0.5, top_k=20, seed=2),
        SamplingParams(do_sample=True, top_p=0.9, seed=3),
    ]
    first = run_steps(logits, params, [1, 2, 3], steps=30)
    assert torch.equal(first, run_steps(logits, params, [1, 2, 3], steps=30))
    assert not torch.equal(first, run_steps(logits, params, [4, 5, 6], steps=30))


def test_seeded_row_independent_of_rest_of_batch() -> None:
    logits = torch.randn(6, 100, generator=generator(8))
    mine = SamplingParams(do_sample=True, temperature=1.3, top_k=40, top_p=0.95, seed=42)
    alone = run_steps(logits[:1], [mine], [42], steps=30)[:, 0]
    others = [
        SamplingParams(),
        SamplingParams(do_sample=True, seed=7),
        SamplingParams(do_sample=True, temperature=0.5, top_k=3),
        SamplingParams(do_sample=True, top_p=0.3),
        SamplingParams(do_sample=True, temperature=2.0, seed=9),
    ]
    # Put the row in the middle of a batch with greedy, seeded and unseeded rows around it.
    batch = torch.cat([logits[1:3], logits[:1], logits[3:]])
    params = [*others[:2], mine, *others[2:]]
    crowded = run_steps(batch, params, [None, 7, 42, None, None, 9], steps=30)[:, 2]
    assert torch.equal(alone, crowded)


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


MODE_BATCHES = {
    "all-processed": [processed(do_sample=True, temperature=0.6, top_logprobs=4),
                      processed(do_sample=True, top_k=3, top_logprobs=4),
                      processed(do_sample=True, temperature=1.4, top_p=0.5)],
    "processed-and-silent-greedy": [SamplingParams(), processed(do_sample=True, temperature=0.6, top_k=7),
                                    SamplingParams(do_sample=True, temperature=2.0),
                                    processed(do_sample=True, top_p=0.3, top_logprobs=4)],
    "mixed": [processed(temperature=0.5, top_k=2, top_logprobs=4),  # greedy: processed == raw
              SamplingParams(logprobs=True, top_logprobs=4),
              processed(do_sample=True, temperature=0.7, top_k=3, top_p=0.8, top_logprobs=4),
              SamplingParams(do_sample=True, temperature=0.7, logprobs=True, top_logprobs=4),
              SamplingParams(do_sample=True, top_k=5),
              processed(do_sample=True, temperature=1.5)],
}


@pytest.mark.parametrize("batch", sorted(MODE_BATCHES))
def test_logprobs_follow_each_rows_mode(batch: str) -> None:
    params = MODE_BATCHES[batch]
    logits = torch.randn(len(params), 40, generator=generator(9)) * 2
    out = Sampler().sample(logits, params, [generator(i) for i in range(len(params))])
    assert out.logprobs is not None
    for i, p in enumerate(params):
        if not p.wants_logprobs:
            continue
        source = processed_reference(logits[i], p) if p.logprobs_mode == "processed" else logits[i].float()
        reference = torch.log_softmax(source, -1)
        token = int(out.token_ids[i])
        assert math.isfinite(float(out.logprobs[i]))
        assert float(out.logprobs[i]) == pytest.approx(float(reference[token]), abs=1e-5)
        if p.top_logprobs:
            assert out.top_logprobs is not None
            values, ids = out.top_logprobs[0][i, :p.top_logprobs], out.top_logprobs[1][i, :p.top_logprobs]
            torch.testing.assert_close(values, reference.topk(p.top_logprobs).values, atol=1e-5, rtol=0)
            torch.testing.assert_close(reference[ids], values, atol=1e-5, rtol=0)


def test_greedy_processed_logprobs_equal_raw_exactly() -> None:
    logits = torch.randn(2, 30, generator=generator(10))
    params = [processed(temperature=0.3, top_k=2, top_p=0.4, top_logprobs=3), SamplingParams(logprobs=True,
                                                                                            top_logprobs=3)]
    out = Sampler().sample(torch.cat([logits[:1], logits[:1]]), params, [None, None])
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.logprobs[0] == out.logprobs[1]
    assert torch.equal(out.top_logprobs[0][0], out.top_logprobs[0][1])
    assert torch.equal(out.top_logprobs[1][0], out.top_logprobs[1][1])


def test_the_mode_does_not_change_the_tokens() -> None:
    logits = torch.randn(3, 60, generator=generator(11))
    settings = [dict(temperature=0.8), dict(top_k=6, top_p=0.9), dict(temperature=1.2, top_p=0.7)]
    modes = {mode: [SamplingParams(do_sample=True, logprobs=True, logprobs_mode=mode, **s)  # type: ignore[arg-type]
                    for s in settings] for mode in ("raw", "processed")}
    tokens = {mode: run_steps(logits, params, [1, 2, 3], steps=20) for mode, params in modes.items()}
    assert torch.equal(tokens["raw"], tokens["processed"])


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
