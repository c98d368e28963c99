"""The embedded SmolLM2-135M-Instruct on 16 GSM8K prompts: greedy generate_batch equals model.generate."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

from contbatch import ContinuousBatchingConfig, RequestStatus, generate_batch
from contbatch.data.embedded import load_model_and_tokenizer
from contbatch.data.prompts import chat_inputs, load_prompts

MAX_NEW_TOKENS = 40

Workload = tuple[PreTrainedModel, GenerationConfig, list[list[int]], list[list[int]]]


@pytest.fixture(scope="module")
def workload() -> Workload:
    """The model, a greedy config, 16 chat-formatted GSM8K prompts and `model.generate`'s output for each,
    generated one prompt at a time (no padding)."""
    model, tokenizer = load_model_and_tokenizer()
    inputs = chat_inputs(tokenizer, load_prompts(limit=16))
    eos = tokenizer.eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=eos)
    references = []
    with torch.inference_mode():
        for prompt in inputs:
            output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    generation_config=config)
            references.append(output[0, len(prompt):].tolist())
    return model, config, inputs, references


@pytest.mark.parametrize(("block_size", "max_batch_tokens"), [(256, 512), (16, 100)])
def test_embedded_model_matches_generate_on_gsm8k(workload: Workload, block_size: int, max_batch_tokens: int) -> None:
    model, config, inputs, references = workload
    cb_config = ContinuousBatchingConfig(block_size=block_size, num_blocks=4096 // block_size + 8,
                                         max_batch_tokens=max_batch_tokens)
    outputs = generate_batch(model, inputs, config, cb_config, progress_bar=False)
    for index, reference in enumerate(references):
        output = outputs[f"req_{index}"]
        assert output.status == RequestStatus.FINISHED
        assert output.generated_tokens == reference, f"prompt {index}"
