"""Memory-feature benchmarks: a shared-prefix workload with prefix caching on and off, and a GRPO-like workload
(many samples per prompt) against transformers' `generate_batch`."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import cast

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch import ContinuousBatchingConfig
from contbatch.api import generate_batch
from contbatch.bench.throughput import CB_ATTN_IMPLEMENTATION, BenchResult
from contbatch.data.prompts import as_token_ids, load_prompts

SYSTEM_PROMPT = (
    "You are a careful mathematics tutor for primary and secondary school students. For every question, first "
    "restate what is being asked in one short sentence. Then list the quantities given in the question, with "
    "their units, one per line. Then solve the problem step by step, writing each intermediate calculation "
    "explicitly, as an equation with its result, and explaining in plain words why that step is needed. Check "
    "the result against the question: does it have the right unit, is it plausible, does it answer what was "
    "asked? If the question is ambiguous, say so and state the interpretation you chose. Never skip steps, "
    "never guess, and never use methods beyond what a student of that age would know. Finish with a line of "
    "the form 'Answer: <number>' and nothing after it. Keep the whole explanation under two hundred words."
)


def shared_prefix_inputs(tokenizer: PreTrainedTokenizerBase, num_requests: int) -> list[list[int]]:
    """GSM8K questions behind one long system prompt (about 200 tokens with the chat template)."""
    return questions_after(tokenizer, SYSTEM_PROMPT, num_requests)


def questions_after(tokenizer: PreTrainedTokenizerBase, system: str, num_requests: int) -> list[list[int]]:
    """The first `num_requests` GSM8K questions, each as a user turn after the system prompt `system`,
    chat-templated for the assistant's reply."""
    inputs = []
    for question in load_prompts(limit=num_requests):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        inputs.append(as_token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
    return inputs


def run_prefix_caching(model: PreTrainedModel, inputs: list[list[int]], max_new_tokens: int, eos: int,
                       config: ContinuousBatchingConfig) -> list[tuple[BenchResult, int]]:
    """contbatch with prefix caching on, then off; each result with the number of prompt tokens computed."""
    generation = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos)
    results = []
    for sharing in (True, False):
        run_config = replace(config, allow_block_sharing=sharing)
        generate_batch(model, inputs[:2], generation, run_config, progress_bar=False, max_new_tokens=2)
        start = time.perf_counter()
        outputs = generate_batch(model, inputs, generation, run_config, progress_bar=False)
        wall = time.perf_counter() - start
        computed = sum(len(o.prompt_ids) - o.num_cached_tokens for o in outputs.values())
        name = f"contbatch, prefix caching {'on' if sharing else 'off'}"
        results.append((BenchResult(name, wall, sum(len(o.generated_tokens) for o in outputs.values()),
                                    sum(map(len, inputs))), computed))
    return results


def run_grpo(model: PreTrainedModel, model_dir: str, inputs: list[list[int]], samples: int, max_new_tokens: int,
             eos: int, config: ContinuousBatchingConfig, peers: bool) -> list[BenchResult]:
    """`samples` sampled completions (temperature 1.0) per prompt, through contbatch and, with `peers`,
    transformers' `generate_batch` (`num_return_sequences`) on a second instance in `model`'s dtype and device."""
    generation = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                  pad_token_id=eos, num_return_sequences=samples)
    prompt_tokens = samples * sum(map(len, inputs))
    torch.manual_seed(0)
    generate_batch(model, inputs[:1], generation, config, progress_bar=False, max_new_tokens=2)
    start = time.perf_counter()
    outputs = generate_batch(model, inputs, generation, config, progress_bar=False)
    results = [BenchResult("contbatch", time.perf_counter() - start,
                           sum(len(o.generated_tokens) for o in outputs.values()), prompt_tokens)]
    if peers:
        peer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=model.dtype,
                                                    attn_implementation=CB_ATTN_IMPLEMENTATION).eval()
        cast(torch.nn.Module, peer).to(model.device)
        warmup = GenerationConfig(**{**generation.to_diff_dict(), "max_new_tokens": 2})
        peer.generate_batch(inputs=inputs[:1], generation_config=warmup, progress_bar=False)
        start = time.perf_counter()
        peer_outputs = peer.generate_batch(inputs=inputs, generation_config=generation, progress_bar=False)
        wall = time.perf_counter() - start
        if len(peer_outputs) != samples * len(inputs):
            raise RuntimeError(f"transformers returned {len(peer_outputs)} outputs for {samples * len(inputs)}")
        results.append(BenchResult("transformers generate_batch (num_return_sequences)", wall,
                                   sum(len(o.generated_tokens) for o in peer_outputs.values()), prompt_tokens))
    return results
