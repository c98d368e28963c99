"""Beam search: contbatch's (beams inside continuous batching) against static `generate(num_beams=k)` in batches,
on the same prompts, in one process."""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, PreTrainedModel

from contbatch import ContinuousBatchingConfig
from contbatch.api import generate_batch
from contbatch.bench.throughput import BenchResult, pad_or_first_eos, static_batch


def beam_config(num_beams: int, max_new_tokens: int, eos: int | list[int], pad: int | None) -> GenerationConfig:
    """The benchmark's beam search; `pad` None pads with the first EOS id (`pad_or_first_eos`)."""
    return GenerationConfig(num_beams=num_beams, max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=eos, pad_token_id=pad_or_first_eos(pad, eos), early_stopping=False,
                            length_penalty=1.0)


def run_beam(model: PreTrainedModel, inputs: list[list[int]], config: GenerationConfig,
             engine_config: ContinuousBatchingConfig, batch_size: int) -> tuple[list[BenchResult], int]:
    """contbatch, then `generate` in left-padded batches of `batch_size` prompts, each after an untimed warm-up;
    returns both results (generated tokens: the best sequence's) and how many prompts' best sequences agree
    (padding can change `generate`'s float rounding, so a few may differ)."""
    generate_batch(model, inputs[:1], config, engine_config, progress_bar=False, max_new_tokens=2)
    start = time.perf_counter()
    outputs = generate_batch(model, inputs, config, engine_config, progress_bar=False)
    wall = time.perf_counter() - start
    ours = [o.generated_tokens for o in outputs.values()]
    prompt_tokens = sum(map(len, inputs))
    results = [BenchResult(f"contbatch, num_beams={config.num_beams}", wall, sum(map(len, ours)), prompt_tokens)]
    _static(model, inputs[:1], config)
    start = time.perf_counter()
    theirs = [seq for i in range(0, len(inputs), batch_size) for seq in _static(model, inputs[i:i + batch_size],
                                                                                  config)]
    wall = time.perf_counter() - start
    results.append(BenchResult(f"generate(num_beams={config.num_beams}), batches of {batch_size}", wall,
                               sum(map(len, theirs)), prompt_tokens))
    return results, sum(a == b for a, b in zip(ours, theirs, strict=True))


def _static(model: PreTrainedModel, batch: list[list[int]], config: GenerationConfig) -> list[list[int]]:
    """The best sequence's generated tokens for each prompt of `batch`, left-padded into one `generate` call."""
    eos = set(config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id])
    with torch.inference_mode():
        return static_batch(model, batch, config, int(config.pad_token_id), eos)
