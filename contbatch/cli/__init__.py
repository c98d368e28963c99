"""The `contbatch` command: `generate` (the main job) and `bench` (throughput against peers)."""

from __future__ import annotations

import argparse
import sys

import torch

from contbatch.cli import bench, generate, serve
from contbatch.cli import eval as eval_command


def build_parser() -> argparse.ArgumentParser:
    """The `contbatch` argument parser, with one required subcommand: `generate`, `bench`, `serve` or `eval`."""
    parser = argparse.ArgumentParser(prog="contbatch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate.add_arguments(commands.add_parser("generate", help="generate completions for a JSONL file of prompts"))
    bench.add_arguments(commands.add_parser("bench", help="throughput of contbatch against transformers' engines"))
    serve.add_arguments(commands.add_parser("serve", help="an OpenAI-compatible HTTP server"))
    eval_command.add_arguments(commands.add_parser("eval", help="lm-evaluation-harness on contbatch (lm-eval's flags)",
                                                   **eval_command.PARSER_OPTIONS))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `contbatch` command on `argv` (default `sys.argv[1:]`) and return its exit status.

    A `ValueError`, `FileNotFoundError` or `RuntimeError` from the command is printed to stderr as
    `contbatch COMMAND: error: ...` and gives status 2; bad arguments exit through argparse (status 2).
    """
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    commands = {"generate": generate._generate, "bench": bench._bench, "serve": serve._serve,
                "eval": eval_command._eval}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"contbatch {args.command}: error: {error}", file=sys.stderr)
        return 2
