"""`contbatch generate`: completions for a JSONL file of prompts, written as JSONL."""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import GenerationConfig

from contbatch.api import generate_batch
from contbatch.cli.common import add_engine_flags, engine_config


def add_arguments(generate: argparse.ArgumentParser) -> None:
    """Add the flags of `contbatch generate` to its subparser `generate`."""
    generate.add_argument("--input", default=None, help="JSONL of prompts (default: the shipped GSM8K test set)")
    generate.add_argument("--field", default="question", help="the JSON field holding the prompt")
    generate.add_argument("--output", default="results.jsonl", help="where to write the JSONL results")
    generate.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    generate.add_argument("--max-new-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 means greedy decoding")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None, help="seed the sampling RNG for a reproducible run")
    generate.add_argument("--show", type=int, default=0, help="print the first N answers")
    generate.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_flags(generate)


def _generate(args: argparse.Namespace) -> int:
    """Run `contbatch generate`: write one JSON record per prompt to `args.output` and return the exit status 0."""
    from contbatch.data.embedded import load_model_and_tokenizer
    from contbatch.data.prompts import chat_inputs, load_prompts

    prompts = load_prompts(args.input, field=args.field, limit=args.limit)
    model, tokenizer = load_model_and_tokenizer(args.model)
    inputs = chat_inputs(tokenizer, prompts)
    sampling = args.temperature > 0
    generation_config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, do_sample=sampling, temperature=args.temperature if sampling else 1.0,
        top_p=args.top_p, eos_token_id=model.generation_config.eos_token_id or tokenizer.eos_token_id,
    )
    if args.seed is not None:
        torch.manual_seed(args.seed)
    start = time.perf_counter()
    outputs = generate_batch(model, inputs, generation_config, engine_config(args), progress_bar=not args.no_progress)
    wall = time.perf_counter() - start
    generated = 0
    with open(args.output, "w") as sink:
        for (request_id, output), prompt in zip(outputs.items(), prompts, strict=True):
            record = {"id": request_id, "prompt": prompt,
                      "completion": tokenizer.decode(output.generated_tokens, skip_special_tokens=True),
                      "prompt_tokens": len(output.prompt_ids), "completion_tokens": len(output.generated_tokens),
                      "finish_reason": output.finish_reason}
            if output.error:
                record["error"] = output.error
            generated += len(output.generated_tokens)
            sink.write(json.dumps(record) + "\n")
            if args.show > 0 and int(request_id.removeprefix("req_")) < args.show:
                print(f"--- {request_id}: {prompt}\n>>> {record['completion']}\n")
    print(f"{len(outputs)} requests, {generated} tokens in {wall:.1f} s ({generated / wall:.1f} tok/s) "
          f"-> {args.output}")
    return 0
