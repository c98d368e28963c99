"""The beam search benchmark: both engines run the same prompts and their best sequences agree."""

from __future__ import annotations

import pytest

from contbatch import ContinuousBatchingConfig
from contbatch.bench.beam import beam_config, run_beam
from tests.helpers import fresh_tiny_model, random_prompts


def test_contbatch_and_generate_beams_agree_on_the_best_sequences() -> None:
    model = fresh_tiny_model("llama")
    inputs = random_prompts([5, 9, 14], seed=4)
    config = beam_config(4, 6, eos=[7, 9], pad=0)
    results, agree = run_beam(model, inputs, config, ContinuousBatchingConfig(block_size=4, num_blocks=128), 2)
    assert [r.engine for r in results] == ["contbatch, num_beams=4", "generate(num_beams=4), batches of 2"]
    assert agree == len(inputs)
    assert results[0].generated_tokens == results[1].generated_tokens > 0


def test_beam_config_pads_with_the_first_eos_without_a_pad_token() -> None:
    """A model with several EOS ids and no pad token (Llama 3's configuration) pads with its first EOS id."""
    assert beam_config(4, 6, eos=[7, 9], pad=None).pad_token_id == 7
    assert beam_config(4, 6, eos=[7, 9], pad=0).pad_token_id == 0
    with pytest.raises(ValueError, match="neither a pad nor an EOS"):
        beam_config(4, 6, eos=[], pad=None)
