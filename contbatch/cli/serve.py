"""`contbatch serve`: an OpenAI-compatible HTTP server over one engine."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, UnsupportedModelError, generate_batch
from contbatch.cli.common import add_engine_flags, engine_config, model_dtype
from contbatch.engine.compile import engine_compile_paths, served_compile_config
from contbatch.engine.model_support import UNSUPPORTED_PREFIX
from contbatch.entrypoints.openai.tool_parsers import TOOL_PARSERS

SERVE_MAX_BATCH_TOKENS = {"cpu": 2048}
"""The served engine's token budget by device type when `--max-batch-tokens` is not given (other devices keep the
engine's default). On CPU the engine's default of 512 splits a burst of prompts into many prefill chunks, and
every request already decoding waits on each: on the serving benchmark 2048 (vLLM's API-server default on CPU)
cut the p99 inter-token latency from 1.3-1.5 s to 0.53-0.54 s at the same throughput (docs/performance.md)."""


SERVE_PREFILL_TOKENS_WHILE_DECODING = {"cpu": 128}
"""The served engine's `max_prefill_tokens_while_decoding` by device type when `--max-prefill-tokens-while-decoding`
is not given (other devices: no bound). On the serving benchmark on a 2-core Zen 5, four alternating rounds: 128
held the p99 inter-token latency at 111-128 ms, against 182-188 ms at 256 and 98-410 ms with no bound, at the same
output tok/s and a median time to first token half of the unbounded one's; 64 cost 7% of the throughput
(docs/performance.md, "a twenty-fourth session")."""

SERVE_COMPILE = {"cpu": True}
"""Whether `contbatch serve` compiles the forward when neither `--compile` nor `--no-compile` is given, by device
type (others: off). A server runs long enough to repay the compile, which it does before it listens
(`warm_up_before_serving`). On the serving benchmark, compiled, it served 1.16-1.21x vLLM's output tok/s; eager
1.09-1.10x, in the same hour (docs/performance.md)."""

WARM_UP_TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps"
WARM_UP_NEW_TOKENS = 3


def add_arguments(serve: argparse.ArgumentParser) -> None:
    """Add the flags of `contbatch serve` to its subparser `serve`."""
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="the model id clients use (default: from --model)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="reject larger request bodies (413)")
    serve.add_argument("--max-queue-size", type=int, default=0, help="bound on waiting requests (0: none)")
    serve.add_argument("--continuous-batching", action="store_true",
                       help="accepted for compatibility with `transformers serve`; always on")
    serve.add_argument("--tool-call-parser", default="auto", choices=sorted(TOOL_PARSERS),
                       help="how chat replies' tool calls are parsed: 'hermes' (<tool_call>{json}</tool_call>), "
                            "'transformers' (the tokenizer's response_template), or 'auto' (the template when the "
                            "tokenizer has one, else hermes)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for compatibility with `vllm serve`; tool_choice='auto' is always enabled")
    serve.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send a span per request over OTLP/HTTP to URL (e.g. http://127.0.0.1:4318; a URL "
                            "without a path gets /v1/traces); the OTEL_* environment variables configure the rest "
                            "(extra `otel`, docs/monitoring.md)")
    serve.add_argument("--detailed-traces", action="store_true",
                       help="with tracing on, also a span per engine step (schedule, forward, sample)")
    serve.add_argument("--commit-cache", action=argparse.BooleanOptionalAction, default=True,
                       help="on a CPU, commit the resident KV cache's memory (CONTBATCH_CPU_CACHE_RESIDENT_GIB, "
                            "default 4 GiB, at most the cache) before listening, as vLLM-CPU does with its KV "
                            "space, so that no request's steps pay its page faults (default: on)")
    add_engine_flags(serve)


def serve_config(args: argparse.Namespace, device: torch.device) -> ContinuousBatchingConfig:
    """The served engine's configuration: the engine flags of `args`, `--max-queue-size`, and the serving defaults
    of `device`'s type for the flags not given: the token budget without `--max-batch-tokens`
    (`SERVE_MAX_BATCH_TOKENS`), the prompts' share of a step while requests decode without
    `--max-prefill-tokens-while-decoding` (`SERVE_PREFILL_TOKENS_WHILE_DECODING`), the compile without `--compile` /
    `--no-compile` (`SERVE_COMPILE`). Compiled paths take `served_compile_config()`: the server owns its model and
    changes none of its modules, so dynamo skips their guards on every call."""
    values: dict[str, int | bool] = {"max_queue_size": args.max_queue_size}
    if args.max_batch_tokens is None and device.type in SERVE_MAX_BATCH_TOKENS:
        values["max_batch_tokens"] = SERVE_MAX_BATCH_TOKENS[device.type]
    if args.max_prefill_tokens_while_decoding is None and device.type in SERVE_PREFILL_TOKENS_WHILE_DECODING:
        values["max_prefill_tokens_while_decoding"] = SERVE_PREFILL_TOKENS_WHILE_DECODING[device.type]
    if args.compile is None:
        values["use_default_compile_configs"] = SERVE_COMPILE.get(device.type, False)
    config = ContinuousBatchingConfig.from_sources(engine_config(args), values)
    if not config.use_default_compile_configs:
        return config
    served = served_compile_config()
    return ContinuousBatchingConfig.from_sources(config, {"varlen_compile_config": served,
                                                          "decode_compile_config": served})


class WarmUpFailed(RuntimeError):
    """A warm-up request failed: the server would fail its clients' requests the same way."""


def warm_up_before_serving(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                           config: ContinuousBatchingConfig) -> float | None:
    """Runs a prefill and decode steps of two requests before the server takes its first request, on an engine of
    its own with a few cache blocks. They compile the forwards `config` asks for, so that no client waits on a
    compile (their graph serves every later step: steps of one token or logits row are padded to two,
    `pad_for_compile`; the compiled graphs are the model's, shared by every engine on it). They also show that the
    model runs at all: a model contbatch cannot compute exactly fails them (`UnsupportedModelError`), and this
    raises `WarmUpFailed` with that error instead of a server that fails every request. Returns the seconds the
    warm-up took when it compiled, else None (no path compiled, by `config` or by the model's generation config:
    `engine_compile_paths`)."""
    compiles = bool(engine_compile_paths(config, model.generation_config))
    ids = tokenizer.encode(WARM_UP_TEXT, add_special_tokens=False)
    blocks = 2 * -(-(len(ids) + WARM_UP_NEW_TOKENS) // config.block_size) + 2
    warm = ContinuousBatchingConfig.from_sources(config, {"num_blocks": blocks, "max_queue_size": 0})
    generation = GenerationConfig(max_new_tokens=WARM_UP_NEW_TOKENS, min_new_tokens=WARM_UP_NEW_TOKENS,
                                  do_sample=False)
    start = time.perf_counter()
    try:
        outputs = generate_batch(model, [ids[:5], ids[:9]], generation_config=generation,
                                 continuous_batching_config=warm, progress_bar=False)
    except UnsupportedModelError as error:
        raise WarmUpFailed(f"a warm-up request failed: {UNSUPPORTED_PREFIX}{error}") from None
    failed = [output.error for output in outputs.values() if output.error]
    if failed:
        raise WarmUpFailed(f"a warm-up request failed: {failed[0]}")
    return time.perf_counter() - start if compiles else None


def commit_cache_before_serving(manager: ContinuousBatchingManager) -> None:
    """`--commit-cache`: commits the resident KV cache (`ContinuousBatchingManager.commit_cache`) and says how much
    and how long it took."""
    start = time.perf_counter()
    blocks = manager.commit_cache()
    if blocks:
        cache = manager.engine.cache
        gib = blocks * cache.spec.bytes_per_block(cache.block_size, cache.shape[0]) / 2**30
        print(f"contbatch serve: committed {blocks} KV cache blocks ({gib:.2f} GiB) in "
              f"{time.perf_counter() - start:.1f} s (--no-commit-cache: as first written)", file=sys.stderr,
              flush=True)


def _serve(args: argparse.Namespace) -> int:
    """Run `contbatch serve` until the server shuts down (the engine is stopped on the way out); return 0. Raises
    `WarmUpFailed` before listening when the warm-up requests fail."""
    import uvicorn

    from contbatch.data.embedded import load_model_and_tokenizer
    from contbatch.entrypoints.openai.app import create_app
    from contbatch.telemetry import Telemetry

    model, tokenizer = load_model_and_tokenizer(args.model, model_dtype(args))
    config = serve_config(args, model.device)
    seconds = warm_up_before_serving(model, tokenizer, config)
    if seconds is not None:
        print(f"contbatch serve: compiled the forward in {seconds:.1f} s (--no-compile: eager)", file=sys.stderr,
              flush=True)
    name = args.served_model_name or (Path(args.model).stem if args.model else "SmolLM2-135M-Instruct")
    # queue_timeout=0: with --max-queue-size, a full queue answers 503 at once instead of blocking the event loop.
    telemetry = Telemetry.default(args.otlp_traces_endpoint, args.detailed_traces)
    manager = ContinuousBatchingManager(model, model.generation_config, config, queue_timeout=0.0,
                                        tokenizer=tokenizer, telemetry=telemetry)
    if args.commit_cache:
        commit_cache_before_serving(manager)
    manager.start()
    try:
        app = create_app(manager, tokenizer, name, args.api_key, args.max_body_bytes, args.tool_call_parser)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        manager.stop()
    return 0
