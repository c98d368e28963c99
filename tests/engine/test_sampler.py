"""Tests for contbatch.engine.sampler: greedy, temperature/top-k/top-p distributions, logprobs and seeding."""

from __future__ import annotations

import math

import pytest
import torch

from contbatch.engine.sampler import Sampler, SamplerOutput
from contbatch.engine.sampling_params import SamplingParams
from tests.engine.sampling_helpers import (
    ALPHA,
    DRAWS,
    GREEDY,
    chi2_pvalue,
    chi2_sf,
    draw_counts,
    generator,
    processed,
    processed_reference,
    run_steps,
)


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
