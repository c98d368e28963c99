"""The embedded SmolLM2-135M-Instruct on GSM8K prompts: greedy generate_batch equals model.generate."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

from contbatch import ContinuousBatchingConfig, RequestStatus, generate_batch
from contbatch.data.embedded import load_model_and_tokenizer
from contbatch.data.prompts import chat_inputs, load_prompts

MAX_NEW_TOKENS = 40
# `generate`'s references take about 5 s a prompt on one thread: `make test` checks 8 prompts, `make test-slow` 32.
PROMPTS, MORE_PROMPTS = 8, 32


@dataclass
class Workload:
    """The model, a greedy config, chat-formatted GSM8K prompts, and `model.generate`'s output for each prompt,
    generated one prompt at a time (no padding) when first asked for."""

    model: PreTrainedModel
    config: GenerationConfig
    inputs: list[list[int]]
    references: dict[int, list[int]] = field(default_factory=dict)

    def reference(self, index: int) -> list[int]:
        if index not in self.references:
            prompt = self.inputs[index]
            with torch.inference_mode():
                output = self.model.generate(torch.tensor([prompt]),
                                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                             generation_config=self.config)
            self.references[index] = output[0, len(prompt):].tolist()
        return self.references[index]


@pytest.fixture(scope="module")
def workload() -> Workload:
    model, tokenizer = load_model_and_tokenizer()
    eos = tokenizer.eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=eos)
    return Workload(model, config, chat_inputs(tokenizer, load_prompts(limit=MORE_PROMPTS)))


def assert_matches_generate(workload: Workload, count: int, block_size: int, max_batch_tokens: int) -> None:
    cb_config = ContinuousBatchingConfig(block_size=block_size, num_blocks=8192 // block_size + 8,
                                         max_batch_tokens=max_batch_tokens)
    outputs = generate_batch(workload.model, workload.inputs[:count], workload.config, cb_config,
                             progress_bar=False)
    for index in range(count):
        output = outputs[f"req_{index}"]
        assert output.status == RequestStatus.FINISHED
        assert output.generated_tokens == workload.reference(index), f"prompt {index}"


@pytest.mark.parametrize(("block_size", "max_batch_tokens"), [(256, 512), (16, 100)])
def test_embedded_model_matches_generate_on_gsm8k(workload: Workload, block_size: int, max_batch_tokens: int) -> None:
    assert_matches_generate(workload, PROMPTS, block_size, max_batch_tokens)


@pytest.mark.slow
def test_more_gsm8k_prompts_match_generate(workload: Workload) -> None:
    assert_matches_generate(workload, MORE_PROMPTS, 16, 100)
