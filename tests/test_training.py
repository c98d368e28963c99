"""`contbatch.training.SharedPrompt`: continuations over one recorded prompt compute what full rows compute."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.training import SharedPrompt, supports_shared_prompt


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def test_continuations_over_a_recorded_prompt_equal_full_rows() -> None:
    model = tiny_llama()
    prompt, continuations = torch.randint(0, 96, (6,)), torch.randint(0, 96, (3, 4))
    expected = model(torch.cat([prompt.expand(3, -1), continuations], dim=1)).logits[:, 6:]
    manager = ContinuousBatchingManager(model, None, ContinuousBatchingConfig(block_size=4, num_blocks=8))
    manager.start()
    try:
        assert supports_shared_prompt(model)
        shared = SharedPrompt.record(model, prompt)
        logits = model(continuations, **shared.continuation_kwargs(4)).logits
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        empty = SharedPrompt.record(model, prompt[:0])
        torch.testing.assert_close(model(continuations, **empty.continuation_kwargs(4)).logits,
                                   model(continuations).logits)
    finally:
        manager.stop()


def test_a_model_contbatch_is_not_attached_to_is_refused_by_name() -> None:
    model = tiny_llama()
    assert not supports_shared_prompt(model)
    with pytest.raises(ValueError, match=r"attached to .* runs 'sdpa' attention"):
        SharedPrompt.record(model, torch.tensor([1, 2, 3]))
