"""contbatch's batched logits processors against transformers' own processors, row by row, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TopKLogitsWarper,
)

from contbatch.engine.logits_processors import TokenHistory, apply_processors
from contbatch.engine.sampler import Sampler, process_logits
from contbatch.engine.sampling_params import SamplingParams

VOCAB = 64
EOS = 7


def batch(rows: int = 6, seed: int = 0) -> tuple[torch.Tensor, list[TokenHistory]]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=generator) * 3
    histories = [TokenHistory(torch.randint(0, VOCAB, (5 + 2 * i,), generator=generator).tolist(), 3 + i)
                 for i in range(rows)]
    return logits, histories


def reference(processor: object, logits: torch.Tensor, history: TokenHistory) -> torch.Tensor:
    return processor(torch.tensor([list(history.token_ids)]), logits[None].clone())[0]  # type: ignore[operator]


def test_rows_without_processors_are_returned_untouched() -> None:
    logits, histories = batch()
    assert apply_processors(logits, [SamplingParams()] * len(histories), histories) is logits
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5)] * 3
    out = apply_processors(logits, params, histories)
    assert torch.equal(out[0::2], logits[0::2])
    assert not torch.equal(out[1::2], logits[1::2])


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_is_generates_bit_for_bit(penalty: float) -> None:
    logits, histories = batch()
    params = [SamplingParams(repetition_penalty=penalty if i % 2 else 1.0) for i in range(len(histories))]
    out = apply_processors(logits, params, histories)
    for i, history in enumerate(histories):
        expected = reference(RepetitionPenaltyLogitsProcessor(penalty), logits[i], history) if i % 2 else logits[i]
        assert torch.equal(out[i], expected)


def test_sequence_bias_and_bad_words_are_generates() -> None:
    logits, histories = batch()
    last_two = tuple(histories[2].token_ids[-2:])
    bias = {(3,): -2.5, (11,): 4.0, (*last_two, 9): 6.0, (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15): 1.0}
    bad = [[5], [EOS], [*last_two, 13], [histories[4].token_ids[-1], 21]]
    for i, history in enumerate(histories):
        params = SamplingParams(sequence_bias=tuple(bias.items()), bad_words_ids=tuple(map(tuple, bad)),
                                eos_token_ids=(EOS,))
        out = apply_processors(logits[i:i + 1], [params], [history])[0]
        expected = reference(SequenceBiasLogitsProcessor(bias), logits[i], history)
        expected = reference(NoBadWordsLogitsProcessor(bad, EOS), expected, history)
        assert torch.equal(out, expected)
    banned = apply_processors(logits, [params] * len(histories), histories)
    assert torch.isneginf(banned[2, 13]) and torch.isneginf(banned[4, 21]) and not torch.isneginf(banned[3, 13])
    assert not torch.isneginf(banned[:, EOS]).any(), "a one-token bad word that is EOS is dropped, as generate does"


def test_logit_bias_adds_to_the_logits() -> None:
    logits, histories = batch()
    params = [SamplingParams(logit_bias=((4, 50.0), (9, -100.0)))] * len(histories)
    out = apply_processors(logits, params, histories)
    assert torch.equal(out[:, 4], logits[:, 4] + 50.0) and torch.equal(out[:, 9], logits[:, 9] - 100.0)
    assert torch.equal(out[:, 10:], logits[:, 10:])


def test_min_tokens_and_suppress_tokens_are_generates() -> None:
    logits, histories = batch()
    for i, history in enumerate(histories):
        params = SamplingParams(min_tokens=4, eos_token_ids=(EOS, 8), suppress_tokens=(1, 30))
        out = apply_processors(logits[i:i + 1], [params], [history])[0]
        expected = reference(MinNewTokensLengthLogitsProcessor(history.num_prompt_tokens, 4, [EOS, 8]),
                             logits[i], history)
        expected = reference(SuppressTokensLogitsProcessor([1, 30]), expected, history)
        assert torch.equal(out, expected)
    assert histories[0].num_generated < 4 and histories[-1].num_generated >= 4  # both branches ran


def test_min_tokens_also_holds_back_stop_token_ids_but_not_an_ignored_eos() -> None:
    logits, histories = batch(rows=1)
    params = SamplingParams(min_tokens=10, eos_token_ids=(EOS,), stop_token_ids=(12,), ignore_eos=True)
    out = apply_processors(logits, [params], histories)[0]
    assert torch.isneginf(out[12]) and out[EOS] == logits[0, EOS]


def test_openai_penalties_count_generated_tokens_only() -> None:
    logits = torch.zeros(1, VOCAB)
    history = TokenHistory([4, 4, 9, 9, 9, 9, 5], num_prompt_tokens=3)  # generated: 9, 9, 9, 5 (4 is prompt only)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_processors(logits, [params], [history])[0]
    assert out[4] == 0 and out[9] == pytest.approx(-0.5 - 0.75) and out[5] == pytest.approx(-0.5 - 0.25)
    assert out[[i for i in range(VOCAB) if i not in (5, 9)]].eq(0).all()


def test_min_p_after_top_k_is_generates() -> None:
    logits, _ = batch()
    params = [SamplingParams(do_sample=True, top_k=20, min_p=0.1), SamplingParams(do_sample=True, min_p=0.3)] * 3
    out = process_logits(logits, params)
    for i, p in enumerate(params):
        expected = logits[i][None]
        if p.top_k:
            expected = TopKLogitsWarper(p.top_k)(None, expected)
        expected = MinPLogitsWarper(p.min_p)(None, expected)[0]
        assert torch.equal(torch.isneginf(out[i]), torch.isneginf(expected))
        assert torch.isneginf(out[i]).sum() > (VOCAB - 20 if p.top_k else 0)  # min-p removed some


def test_greedy_rows_take_the_processed_argmax_and_report_processed_logprobs_on_request() -> None:
    logits, histories = batch(rows=2)
    top = int(logits[0].argmax())
    params = [SamplingParams(suppress_tokens=(top,), logprobs=True, logprobs_mode="processed"),
              SamplingParams(suppress_tokens=(top,), logprobs=True)]
    out = Sampler().sample(logits[[0, 0]], params, [None, None], [histories[0]] * 2)
    assert out.token_ids.tolist()[0] != top and out.token_ids.tolist()[0] == out.token_ids.tolist()[1]
    processed = torch.log_softmax(apply_processors(logits[:1], params[:1], histories[:1])[0], -1)
    raw = torch.log_softmax(logits[0], -1)
    chosen = int(out.token_ids[0])
    assert out.logprobs is not None
    assert out.logprobs[0] == pytest.approx(float(processed[chosen])) and out.logprobs[0] != out.logprobs[1]
    assert out.logprobs[1] == pytest.approx(float(raw[chosen]))


def test_a_row_with_processors_needs_its_history() -> None:
    logits, _ = batch(rows=1)
    with pytest.raises(ValueError, match="token history"):
        apply_processors(logits, [SamplingParams(repetition_penalty=1.2)], None)


def test_only_the_rows_with_processors_need_a_history() -> None:
    """The engine passes None for the history of a row that needs none; a processor row without one is refused."""
    logits, histories = batch(rows=2)
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5)]
    out = apply_processors(logits, params, [None, histories[1]])
    assert torch.equal(out, apply_processors(logits, params, histories))
    with pytest.raises(ValueError, match="token history of every row"):
        apply_processors(logits, params, [histories[0], None])
