"""Engine flags shared by the `contbatch` commands, and the engine configuration they describe."""

from __future__ import annotations

import argparse

import torch

from contbatch import ContinuousBatchingConfig
from contbatch.engine.config import SCHEDULER_TYPES

# Prefix caching shares whole blocks: with 256-token blocks a 200-token system prompt is never shared.
CLI_BLOCK_SIZE = 16
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags to `parser`: `--model`, `--dtype`, `--block-size`, `--num-blocks`, `--max-batch-tokens`,
    `--max-prefill-tokens-while-decoding`, `--scheduler`, `--threads`, `--compile`, `--async-batching` and
    `--cuda-graphs`."""
    parser.add_argument("--model", default=None, help="local HF model directory or .gguf file (default: embedded "
                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="auto",
                        help="the model's dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--block-size", type=int, default=CLI_BLOCK_SIZE,
                        help=f"tokens per KV-cache block (default {CLI_BLOCK_SIZE}: prefix caching shares whole "
                        "blocks, and throughput is the same from 16 to 256 on CPU; the Python API keeps "
                        "transformers' default of 256)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="token budget of one forward pass (default: 512 on CPU, 4096 for a bfloat16 model on a "
                        "CPU with AMX, 2048 for `contbatch serve` on CPU, 4096 on CUDA)")
    parser.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None, metavar="N",
                        help="while some request is decoding, prompts get at most N of a step's tokens, which "
                        "bounds the delay new prompts add between the tokens of running requests (default: no "
                        "bound; `contbatch serve` on CPU: 128)")
    parser.add_argument("--scheduler", choices=SCHEDULER_TYPES, default="fifo")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the forward (use_default_compile_configs: inductor, dynamic shapes); "
                        "the first steps pay the compile time (default: off; `contbatch serve` on CPU: on, "
                        "compiled before it listens)")
    parser.add_argument("--async-batching", choices=tuple(AUTO_ON_OFF), default="auto",
                        help="use_async_batching: prepare the next step while the forward runs (auto: on for a "
                        "CUDA model, off on a CPU, where it measured no faster)")
    parser.add_argument("--cuda-graphs", choices=tuple(AUTO_ON_OFF), default="auto",
                        help="use_cuda_graph: replay decode steps from captured CUDA graphs (auto: on for a model "
                        "on a CUDA device)")


def model_dtype(args: argparse.Namespace) -> torch.dtype | None:
    """The dtype `--dtype` names, None for auto (the loader's default)."""
    return DTYPES[getattr(args, "dtype", "auto")]


def engine_config(args: argparse.Namespace) -> ContinuousBatchingConfig:
    """The engine configuration named by the engine flags of `args` (see `add_engine_flags`)."""
    values = {"block_size": args.block_size, "num_blocks": args.num_blocks, "max_batch_tokens": args.max_batch_tokens,
              "max_prefill_tokens_while_decoding": getattr(args, "max_prefill_tokens_while_decoding", None),
              "scheduler_type": args.scheduler, "use_default_compile_configs": getattr(args, "compile", None),
              "use_async_batching": AUTO_ON_OFF[getattr(args, "async_batching", "auto")],
              "use_cuda_graph": AUTO_ON_OFF[getattr(args, "cuda_graphs", "auto")]}
    return ContinuousBatchingConfig.from_sources(None, values)
