"""Decode CUDA graphs on a GPU: contbatch with graphs on and off against transformers' engines, same run.

Usage: python examples/cuda_graphs_bench.py PROMPTS.json [--shape smollm2-135m|llama-1b] [--dtype bfloat16]
    [--num-prompts 128] [--max-new-tokens 128]

PROMPTS.json holds a list of token-id prompts (e.g. the chat-templated GSM8K questions the CPU benchmark uses,
dumped with `contbatch.data.prompts.chat_inputs`). The model has the named architecture with random weights
(nothing is downloaded on a GPU machine without a network): every engine computes the same amount of work per
token, and with no EOS every request generates `--max-new-tokens` tokens. Greedy outputs of contbatch with and
without graphs are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

from contbatch import ContinuousBatchingConfig, generate_batch
from contbatch.bench.throughput import run_static_generate, run_transformers_generate_batch

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
}


def build_model(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    config = LlamaConfig(max_position_embeddings=8192, rope_theta=100000.0, eos_token_id=None, pad_token_id=0,
                         **SHAPES[shape])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    return model.cuda().eval()


def run_contbatch(model: torch.nn.Module, inputs: list[list[int]], max_new: int,
                  config: ContinuousBatchingConfig) -> tuple[float, list[list[int]]]:
    generation = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=0)
    generate_batch(model, inputs[:4], generation, config, progress_bar=False, max_new_tokens=4)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = generate_batch(model, inputs, generation, config, progress_bar=False)
    wall = time.perf_counter() - start
    return wall, [outputs[f"req_{i}"].generated_tokens for i in range(len(inputs))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompts")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--engines", default="graphs,eager,transformers,static",
                        help="comma-separated subset of graphs,graphs-async,eager,compiled-graphs,transformers,"
                        "static (an engine may repeat, to interleave runs)")
    args = parser.parse_args()
    inputs = json.loads(Path(args.prompts).read_text())[: args.num_prompts]
    model = build_model(args.shape, getattr(torch, args.dtype))
    base = ContinuousBatchingConfig(block_size=16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.shape} random weights, {args.dtype}, "
          f"{len(inputs)} prompts ({sum(map(len, inputs))} tokens), {args.max_new_tokens} new tokens each", flush=True)
    rows, outputs = [], {}
    for engine in args.engines.split(","):
        if engine in ("graphs", "graphs-async", "eager", "compiled-graphs"):
            config = replace(base, use_cuda_graph=engine != "eager",
                             use_default_compile_configs=engine == "compiled-graphs",
                             use_async_batching=engine == "graphs-async")
            wall, outputs[engine] = run_contbatch(model, inputs, args.max_new_tokens, config)
            name = f"contbatch, decode CUDA graphs {'off' if engine == 'eager' else 'on'}"
            name += ", torch.compile" if engine == "compiled-graphs" else ""
            name += ", async batching" if engine == "graphs-async" else ""
            generated = sum(map(len, outputs[engine]))
        elif engine == "transformers":
            result = run_transformers_generate_batch(model, inputs, args.max_new_tokens, None)
            name, wall, generated = result.engine, result.wall_s, result.generated_tokens
        else:
            result = run_static_generate(model, inputs, args.max_new_tokens, None, 0, batch_size=len(inputs))
            name, wall, generated = result.engine, result.wall_s, result.generated_tokens
        rows.append((name, wall, generated / wall))
        print(f"  {name}: {wall:.2f} s, {generated / wall:.0f} generated tok/s", flush=True)
    reference = rows[0][2]
    print("\n| engine | wall s | generated tok/s | ratio to first |\n|---|---:|---:|---:|")
    for name, wall, rate in rows:
        print(f"| {name} | {wall:.2f} | {rate:.0f} | {rate / reference:.2f} |")
    for engine in ("graphs", "graphs-async", "compiled-graphs"):
        if engine in outputs and "eager" in outputs:
            same = sum(a == b for a, b in zip(outputs[engine], outputs["eager"], strict=True))
            print(f"\ngreedy outputs, {engine} vs eager: {same}/{len(inputs)} identical")


if __name__ == "__main__":
    main()
