"""The `contbatch` command: `generate` (the main job) and `bench` (throughput against peers)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from contbatch.api import generate_batch
from contbatch.config import ContinuousBatchingConfig

# Prefix caching shares whole blocks: with 256-token blocks a 200-token system prompt is never shared.
CLI_BLOCK_SIZE = 16


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local HF model directory or .gguf file (default: embedded "
                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--block-size", type=int, default=CLI_BLOCK_SIZE,
                        help=f"tokens per KV-cache block (default {CLI_BLOCK_SIZE}: prefix caching shares whole "
                        "blocks, and throughput is the same from 16 to 256 on CPU; the Python API keeps "
                        "transformers' default of 256)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="token budget of one forward pass")
    parser.add_argument("--scheduler", choices=["fifo", "prefill_first"], default="fifo")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _engine_config(args: argparse.Namespace) -> ContinuousBatchingConfig:
    values = {"block_size": args.block_size, "num_blocks": args.num_blocks, "max_batch_tokens": args.max_batch_tokens,
              "scheduler_type": args.scheduler}
    return ContinuousBatchingConfig.from_sources(None, values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="contbatch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate completions for a JSONL file of prompts")
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
    _add_engine_flags(generate)
    bench = commands.add_parser("bench", help="throughput of contbatch against transformers' engines")
    bench.add_argument("--num-prompts", type=int, default=128, help="first N GSM8K test questions")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--static-batch-size", type=int, default=32)
    bench.add_argument("--engines", default="contbatch,transformers,static",
                       help="comma-separated subset of contbatch,transformers,static")
    bench.add_argument("--output", default=None, help="also write the table (markdown) to this file")
    bench.add_argument("--workload", choices=["throughput", "prefix", "grpo"], default="throughput",
                       help="throughput: N GSM8K prompts vs transformers' engines; prefix: N prompts behind one "
                       "~200-token system prompt, prefix caching on vs off; grpo: N prompts x --samples samples, "
                       "temperature 1.0, vs transformers' generate_batch")
    bench.add_argument("--samples", type=int, default=8, help="--workload grpo: samples per prompt")
    bench.add_argument("--serve", action="store_true",
                       help="benchmark OpenAI-compatible servers under a Poisson request load instead")
    bench.add_argument("--rate", type=float, default=2.0, help="--serve: mean requests/s (inf: all at once)")
    bench.add_argument("--peers", default="contbatch", help="--serve: comma-separated subset of contbatch,transformers")
    bench.add_argument("--port-base", type=int, default=8100, help="--serve: the i-th peer listens on port-base + i")
    bench.add_argument("--seed", type=int, default=0, help="--serve: seed of the arrival schedule")
    _add_engine_flags(bench)
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="the model id clients use (default: from --model)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="reject larger request bodies (413)")
    serve.add_argument("--max-queue-size", type=int, default=0, help="bound on waiting requests (0: none)")
    serve.add_argument("--continuous-batching", action="store_true",
                       help="accepted for compatibility with `transformers serve`; always on")
    _add_engine_flags(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    commands = {"generate": _generate, "bench": _bench, "serve": _serve}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"contbatch {args.command}: error: {error}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from contbatch.datasets import chat_inputs, load_prompts
    from contbatch.embedded import load_model_and_tokenizer

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
    outputs = generate_batch(model, inputs, generation_config, _engine_config(args), progress_bar=not args.no_progress)
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


def _bench(args: argparse.Namespace) -> int:
    if args.serve:
        from contbatch import bench_serve

        return bench_serve.run(args)
    if args.workload != "throughput":
        return _bench_workload(args)
    from contbatch import bench
    from contbatch.datasets import chat_inputs, load_prompts
    from contbatch.embedded import load_model_and_tokenizer, resolve_model_dir

    engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    unknown = set(engines) - {"contbatch", "transformers", "static"}
    if unknown or not engines:
        raise ValueError(f"--engines: unknown engine(s) {sorted(unknown)}; choose among contbatch,transformers,static")
    model, tokenizer = load_model_and_tokenizer(args.model)
    inputs = chat_inputs(tokenizer, load_prompts(limit=args.num_prompts))
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else eos
    print(f"workload: {len(inputs)} GSM8K prompts ({sum(map(len, inputs))} prompt tokens), greedy, "
          f"max_new_tokens={args.max_new_tokens}; {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads",
          flush=True)
    results = []
    for name in engines:
        if name == "contbatch":
            result = bench.run_contbatch(model, inputs, args.max_new_tokens, eos, _engine_config(args))
        elif name == "transformers":
            result = bench.run_transformers_generate_batch(resolve_model_dir(args.model), inputs,
                                                           args.max_new_tokens, eos)
        else:
            result = bench.run_static_generate(model, inputs, args.max_new_tokens, eos, pad, args.static_batch_size)
        print(f"  {result.engine}: {result.wall_s:.1f} s, {result.generated_tok_s:.1f} generated tok/s", flush=True)
        results.append(result)
    num_params = sum(parameter.numel() for parameter in model.parameters())
    table = bench.format_table(results, results[0].engine, bench.measure_gemm_gflops(), num_params)
    print("\n" + table)
    if args.output:
        Path(args.output).write_text(table + "\n")
    return 0


def _bench_workload(args: argparse.Namespace) -> int:
    from contbatch import bench, bench_workloads
    from contbatch.datasets import chat_inputs, load_prompts
    from contbatch.embedded import load_model_and_tokenizer, resolve_model_dir

    model, tokenizer = load_model_and_tokenizer(args.model)
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    if args.workload == "prefix":
        inputs = bench_workloads.shared_prefix_inputs(tokenizer, args.num_prompts)
        runs = bench_workloads.run_prefix_caching(model, inputs, args.max_new_tokens, eos, _engine_config(args))
        results = [result for result, _ in runs]
        lines = [f"prompt tokens computed, {result.engine}: {computed} of {result.prompt_tokens}"
                 for result, computed in runs]
        title = (f"{len(inputs)} GSM8K prompts behind one system prompt ({sum(map(len, inputs))} prompt tokens), "
                 f"greedy, max_new_tokens={args.max_new_tokens}")
    else:
        inputs = chat_inputs(tokenizer, load_prompts(limit=args.num_prompts))
        peers = "transformers" in args.engines
        results = bench_workloads.run_grpo(model, str(resolve_model_dir(args.model)), inputs, args.samples,
                                           args.max_new_tokens, eos, _engine_config(args), peers)
        lines = []
        title = (f"{len(inputs)} GSM8K prompts x {args.samples} samples, temperature 1.0, "
                 f"max_new_tokens={args.max_new_tokens}")
    num_params = sum(parameter.numel() for parameter in model.parameters())
    table = bench.format_table(results, results[0].engine, bench.measure_gemm_gflops(), num_params)
    text = "\n".join([f"workload: {title}", "", table, "", *lines])
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from contbatch.embedded import load_model_and_tokenizer
    from contbatch.manager import ContinuousBatchingManager
    from contbatch.server.app import create_app

    model, tokenizer = load_model_and_tokenizer(args.model)
    config = ContinuousBatchingConfig.from_sources(_engine_config(args), {"max_queue_size": args.max_queue_size})
    name = args.served_model_name or (Path(args.model).stem if args.model else "SmolLM2-135M-Instruct")
    # queue_timeout=0: with --max-queue-size, a full queue answers 503 at once instead of blocking the event loop.
    manager = ContinuousBatchingManager(model, model.generation_config, config, queue_timeout=0.0)
    manager.start()
    try:
        uvicorn.run(create_app(manager, tokenizer, name, args.api_key, args.max_body_bytes), host=args.host,
                    port=args.port, log_level="info")
    finally:
        manager.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
