"""`contbatch generate`: the main job. Completions for a file or dataset of prompts, streamed to a JSONL (or
Parquet) output one line per id, resumable after a crash; `--ray` spreads it over engine replicas."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from contbatch.cli.common import add_engine_flags, engine_config, model_dtype
from contbatch.jobs import JobInput, JobSettings, JobSummary, OutputLog, run_job


def add_arguments(generate: argparse.ArgumentParser) -> None:
    """Add the flags of `contbatch generate` to its subparser `generate`."""
    generate.add_argument("--input", default=None, help="JSONL (text field, chat `messages`, or OpenAI batch "
                          "request lines), CSV, Parquet or a local Hugging Face dataset directory (default: the "
                          "shipped GSM8K test set)")
    generate.add_argument("--field", default="question", help="the field holding the prompt text or messages")
    generate.add_argument("--id-field", default=None, help="the field holding each record's id (default: its "
                          "0-based position in the input)")
    generate.add_argument("--split", default="train", help="the split of a dataset directory")
    generate.add_argument("--output", default="results.jsonl", help="the JSONL output (a .parquet name writes "
                          "Parquet once the job is complete); an existing output is resumed")
    generate.add_argument("--limit", type=int, default=None, help="run only the first N records of the input")
    generate.add_argument("--max-new-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 means greedy decoding")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (0: all; "
                          "default: as `generate` resolves it)")
    generate.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p times the likeliest's "
                          "probability")
    generate.add_argument("--repetition-penalty", type=float, default=None, help="`generate`'s repetition penalty "
                          "(greedy decoding too)")
    generate.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end a completion before "
                          "this text (repeatable)")
    generate.add_argument("--seed", type=int, default=None, help="seed each record's sampling from this and its id")
    generate.add_argument("--n", type=int, default=1, help="samples per prompt")
    generate.add_argument("--max-prompt-tokens", type=int, default=None, help="fail prompts longer than this")
    generate.add_argument("--max-in-flight", type=int, default=256, help="records submitted and not finished")
    generate.add_argument("--no-chat-template", action="store_true", help="tokenize text prompts as they are")
    generate.add_argument("--overwrite", action="store_true", help="start the output over, whatever it holds")
    generate.add_argument("--retry-failed", action="store_true", help="run again the ids whose line is an error")
    generate.add_argument("--show", type=int, default=0, help="print the first N lines of the output")
    generate.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bar")
    generate.add_argument("--ray", action="store_true", help="run on engine replicas on a Ray cluster")
    generate.add_argument("--replicas", type=int, default=1, help="with --ray: engine replicas")
    generate.add_argument("--ray-address", default=None, help="with --ray: the cluster (default: a local Ray)")
    generate.add_argument("--cpus-per-replica", type=float, default=1.0, help="with --ray: CPUs per replica")
    generate.add_argument("--gpus-per-replica", type=float, default=0.0, help="with --ray: GPUs per replica")
    add_engine_flags(generate)


def job_parts(args: argparse.Namespace) -> tuple[JobInput, JobSettings]:
    """The input and the settings named by `args`."""
    from contbatch.data.prompts import GSM8K_TEST_PATH

    job_input = JobInput(Path(args.input) if args.input is not None else GSM8K_TEST_PATH, args.field,
                         args.id_field, args.split)
    settings = JobSettings(model=args.model or "SmolLM2-135M-Instruct", max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed, n=args.n,
                           chat_template=not args.no_chat_template, max_prompt_tokens=args.max_prompt_tokens,
                           max_in_flight=args.max_in_flight, id_field=args.id_field, text_field=args.field,
                           top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                           stop=tuple(args.stop))
    return job_input, settings


def _generate(args: argparse.Namespace) -> int:
    """Run `contbatch generate`; the exit status is 0 when every line of the output is a success, 1 otherwise."""
    from contbatch.data.embedded import load_model_and_tokenizer

    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    job_input, settings = job_parts(args)
    if args.ray:
        summary = _ray_job(args, job_input, settings)
    else:
        model, tokenizer = load_model_and_tokenizer(args.model, model_dtype(args))
        output = OutputLog(args.output, settings.record(tokenizer), args.overwrite, args.retry_failed)
        summary = run_job(model, tokenizer, job_input, output, settings, engine_config(args), args.limit,
                          progress=not args.quiet)
    _show(Path(args.output), args.show)
    print(f"{summary} -> {args.output}", file=sys.stderr)
    return 0 if summary.ok else 1


def _ray_job(args: argparse.Namespace, job_input: JobInput, settings: JobSettings) -> JobSummary:
    from contbatch.integrations.ray import RayJobOptions, run_ray_job

    options = RayJobOptions(replicas=args.replicas, address=args.ray_address, num_cpus=args.cpus_per_replica,
                            num_gpus=args.gpus_per_replica, threads=args.threads)
    return run_ray_job(args.model, job_input, args.output, settings, engine_config(args), options,
                       limit=args.limit, overwrite=args.overwrite, retry_failed=args.retry_failed,
                       progress=not args.quiet)


def _show(output: Path, count: int) -> None:
    """Print the first `count` lines of a JSONL output as prompt and completion."""
    if count <= 0 or not output.is_file() or output.suffix != ".jsonl":
        return
    with output.open(encoding="utf-8") as lines:
        for line, _ in zip(lines, range(count), strict=False):
            record = json.loads(line)
            answer = record.get("completion", record.get("completions", record.get("error")))
            print(f"--- {record.get('id')}: {record.get('prompt')}\n>>> {answer}\n")
