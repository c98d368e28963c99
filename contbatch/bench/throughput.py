"""Peer engines and the result table of the throughput benchmark.

Every runner takes the same workload (token-id prompts, `max_new_tokens` each, greedy or sampled alike: `Decoding`),
does a short untimed warm-up, then times the whole workload with `time.perf_counter()` and returns a `BenchResult`. With
`warm_pass`, contbatch's warm-up is the whole workload instead, on the engine the timed pass reuses (its prefix cache
emptied between): the timed pass then measures a warm engine, as a long job or a server runs most of the time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, GenerationMixin, PreTrainedModel

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, Telemetry
from contbatch.api import generate_batch
from contbatch.bench.decoding import GREEDY, Decoding

EosTokenId = int | Sequence[int] | None

# transformers' generate_batch pages SDPA itself: 5.23 warns that the "paged|" prefix its docs spell is no longer
# needed except for eager (and will go), and runs "paged|sdpa" as plain "sdpa" (same tokens, checked).
CB_ATTN_IMPLEMENTATION = "sdpa"

_WARMUP_PROMPTS = 2
_WARMUP_NEW_TOKENS = 4
_MANAGER = "_contbatch_manager"


@dataclass
class BenchResult:
    """The outcome of running one workload through one engine.

    Attributes:
        engine: the engine's display name.
        wall_s: seconds of wall-clock time for the whole workload (warm-up excluded); > 0.
        generated_tokens: tokens generated, summed over requests, each request's first EOS included.
        prompt_tokens: prompt tokens, summed over requests.
        outputs: per prompt, in input order, the generated ids (the first EOS included), for engines that report
            them (all of this module's, and vLLM); None otherwise. Used to count agreeing outputs, not shown in
            the table.
        cached_prompt_tokens: prompt tokens taken from the prefix cache instead of computed (contbatch reports
            them; None for the other engines).
    """

    engine: str
    wall_s: float
    generated_tokens: int
    prompt_tokens: int
    outputs: list[list[int]] | None = field(default=None, repr=False, compare=False)
    cached_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.wall_s <= 0:
            raise ValueError(f"wall_s must be > 0, got {self.wall_s}")
        if self.generated_tokens < 0 or self.prompt_tokens < 0:
            raise ValueError("token counts must be >= 0")

    @property
    def generated_tok_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated_tokens / self.wall_s

    @property
    def processed_tok_s(self) -> float:
        """Prompt plus generated tokens per second of wall time."""
        return (self.prompt_tokens + self.generated_tokens) / self.wall_s


def _eos_set(eos_token_id: EosTokenId) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(token) for token in eos_token_id}


def _first_eos(eos_token_id: EosTokenId) -> int | None:
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    return int(eos[0]) if eos else None


def pad_or_first_eos(pad_token_id: int | None, eos_token_id: EosTokenId) -> int:
    """`pad_token_id`, else the first EOS id: what `generate`'s padded batches pad with. ValueError when the model
    has neither."""
    pad = pad_token_id if pad_token_id is not None else _first_eos(eos_token_id)
    if pad is None:
        raise ValueError("generate pads its batches: the model has neither a pad nor an EOS token id")
    return pad


def run_contbatch(
    model: PreTrainedModel,
    inputs: list[list[int]],
    max_new_tokens: int,
    eos_token_id: EosTokenId,
    config: ContinuousBatchingConfig | None = None,
    telemetry: Telemetry | None = None,
    warm_pass: bool = False,
    decoding: Decoding = GREEDY,
) -> BenchResult:
    """Run the workload through contbatch's `generate_batch` (`decoding`), reporting to `telemetry` (None: its
    default). Without `warm_pass` the untimed warm-up is short and the timed call makes a new engine (its KV
    cache's pages are first written, and committed, in the timed call); with it the warm-up is a whole untimed
    pass on a persistent manager, whose prefix cache is emptied before the timed pass runs on it (the same blocks
    are written again, nothing computed is reused). The manager is stopped before this returns."""
    generation_config = decoding.generation_config(max_new_tokens, eos_token_id, model.generation_config.pad_token_id)
    warmup, warmup_tokens = (inputs, max_new_tokens) if warm_pass else (inputs[:_WARMUP_PROMPTS], _WARMUP_NEW_TOKENS)
    try:
        generate_batch(model, warmup, generation_config, config, progress_bar=False, max_new_tokens=warmup_tokens,
                       telemetry=telemetry, persistent_manager=warm_pass)
        if warm_pass:
            cast(ContinuousBatchingManager, model.__dict__[_MANAGER]).reset_prefix_cache()
        start = time.perf_counter()
        outputs = generate_batch(model, inputs, generation_config, config, progress_bar=False, telemetry=telemetry,
                                 persistent_manager=warm_pass)
        wall = time.perf_counter() - start
    finally:
        manager = model.__dict__.pop(_MANAGER, None)
        if manager is not None:
            manager.stop()
    failed = [output.error for output in outputs.values() if output.error is not None]
    if failed:
        raise RuntimeError(f"contbatch failed {len(failed)} requests, first: {failed[0]}")
    return BenchResult(
        engine="contbatch (compiled)" if _compiles(model, config) else "contbatch",
        wall_s=wall,
        generated_tokens=sum(len(output.generated_tokens) for output in outputs.values()),
        prompt_tokens=sum(len(ids) for ids in inputs),
        outputs=[list(outputs[f"req_{i}"].generated_tokens) for i in range(len(inputs))],
        cached_prompt_tokens=sum(output.num_cached_tokens for output in outputs.values()),
    )


def _compiles(model: PreTrainedModel, config: ContinuousBatchingConfig | None) -> bool:
    from contbatch.engine.compile import engine_compile_paths

    return bool(engine_compile_paths(config or ContinuousBatchingConfig(), model.generation_config))


def compile_seconds(model: PreTrainedModel) -> dict[str, float]:
    """Seconds of the first call of each compiled path of `model` (compilation included), as recorded by the
    compiled forwards contbatch engines share on it; empty when nothing was compiled."""
    from contbatch.engine.compile import SHARED_ATTRIBUTE

    seconds: dict[str, float] = {}
    for compiled in model.__dict__.get(SHARED_ATTRIBUTE, {}).values():
        seconds.update(compiled.compile_seconds)
    return seconds


def run_transformers_generate_batch(
    model_dir_or_model: str | Path | PreTrainedModel,
    inputs: list[list[int]],
    max_new_tokens: int,
    eos_token_id: EosTokenId,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    decoding: Decoding = GREEDY,
) -> BenchResult:
    """Run the workload through transformers' own continuous batching (`model.generate_batch`, `decoding`).

    A path is loaded as a separate model instance in `dtype` on `device` (those of the engine it is compared
    with) with attention implementation `CB_ATTN_IMPLEMENTATION`; a model instance is used as is (generate_batch
    switches eager attention to "paged|eager" itself). `generate_batch` runs in its default continuous-batching
    configuration; each call builds (and frees) its own paged cache, whose set-up (~3 s on a CPU) is part of the
    timed call.

    Raises:
        RuntimeError: a request failed or is missing from generate_batch's results (it logs, not raises).
    """
    model: PreTrainedModel
    if isinstance(model_dir_or_model, str | Path):
        model = AutoModelForCausalLM.from_pretrained(
            model_dir_or_model, dtype=dtype, attn_implementation=CB_ATTN_IMPLEMENTATION, local_files_only=True
        )
        cast(torch.nn.Module, model).to(device)
    else:
        model = model_dir_or_model
    model.eval()
    pad = model.generation_config.pad_token_id
    pad_token_id = pad if pad is not None else _first_eos(eos_token_id)
    # No torch.inference_mode() here: generate_batch decodes in a worker thread, which does not inherit the
    # caller's inference mode, and fails writing to the inference tensors the caller's thread allocated
    # ("Inplace update to inference tensor outside InferenceMode"). generate_batch runs under no_grad itself.
    warmup = decoding.generation_config(_WARMUP_NEW_TOKENS, eos_token_id, pad_token_id)
    _generate_batch_outputs(model, inputs[:_WARMUP_PROMPTS], warmup)
    start = time.perf_counter()
    outputs = _generate_batch_outputs(model, inputs, decoding.generation_config(max_new_tokens, eos_token_id,
                                                                                pad_token_id))
    wall = time.perf_counter() - start
    return BenchResult(
        engine="transformers generate_batch (continuous)",
        wall_s=wall,
        generated_tokens=sum(map(len, outputs)),
        prompt_tokens=sum(len(ids) for ids in inputs),
        outputs=outputs,
    )


def _generate_batch_outputs(model: PreTrainedModel, inputs: list[list[int]],
                            config: GenerationConfig) -> list[list[int]]:
    """Run `model.generate_batch` and return each prompt's generated tokens in input order (its request ids,
    `req_<n>`, are numbered in input order), checking every request finished."""
    outputs = cast(GenerationMixin, model).generate_batch(inputs=inputs, generation_config=config)
    failed = [rid for rid, out in outputs.items() if out.error is not None]
    if failed or len(outputs) != len(inputs):
        raise RuntimeError(
            f"generate_batch returned {len(outputs)} results for {len(inputs)} requests; failed: {failed[:5]}"
        )
    ordered = sorted(outputs.items(), key=lambda item: int(item[0].rsplit("_", 1)[-1]))
    return [[int(token) for token in output.generated_tokens] for _, output in ordered]


def run_static_generate(
    model: PreTrainedModel,
    inputs: list[list[int]],
    max_new_tokens: int,
    eos_token_id: EosTokenId,
    pad_token_id: int | None,
    batch_size: int = 32,
    decoding: Decoding = GREEDY,
) -> BenchResult:
    """Run the workload through static-batch `model.generate`: left-padded batches of `batch_size` prompts
    in input order, `decoding`, padded with `pad_token_id` (None: the first EOS id).

    Each row's generated tokens are counted up to and including its first EOS (the padding a finished row
    receives while the rest of its batch decodes is not counted).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    pad_token_id = pad_or_first_eos(pad_token_id, eos_token_id)
    model.eval()
    config = decoding.generation_config(max_new_tokens, eos_token_id, pad_token_id)
    warmup_config = decoding.generation_config(_WARMUP_NEW_TOKENS, eos_token_id, pad_token_id)
    eos = _eos_set(eos_token_id)
    with torch.inference_mode():
        static_batch(model, inputs[:_WARMUP_PROMPTS], warmup_config, pad_token_id, eos)
        start = time.perf_counter()
        outputs = [
            row
            for i in range(0, len(inputs), batch_size)
            for row in static_batch(model, inputs[i : i + batch_size], config, pad_token_id, eos)
        ]
        wall = time.perf_counter() - start
    return BenchResult(
        engine=f"transformers generate (static, batch {batch_size})",
        wall_s=wall,
        generated_tokens=sum(map(len, outputs)),
        prompt_tokens=sum(len(ids) for ids in inputs),
        outputs=outputs,
    )


def static_batch(
    model: PreTrainedModel, batch: list[list[int]], config: GenerationConfig, pad_token_id: int, eos: set[int]
) -> list[list[int]]:
    """Generate for one left-padded batch; returns each row's generated tokens up to and including its first EOS
    (see `count_until_eos`)."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    device = model.device
    out = cast(Any, model).generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config
    )
    return [row[:count_until_eos(row[None], eos)].tolist() for row in out[:, width:].cpu()]


def count_until_eos(new_tokens: torch.Tensor, eos: set[int]) -> int:
    """Count the tokens of each row of `new_tokens` [rows x steps] up to and including its first EOS
    (the whole row when it has none), summed over rows."""
    if new_tokens.numel() == 0:
        return 0
    steps = new_tokens.shape[1]
    if not eos:
        return new_tokens.shape[0] * steps
    is_eos = torch.isin(new_tokens, torch.tensor(sorted(eos), dtype=new_tokens.dtype))
    has_eos = is_eos.any(dim=1)
    first = is_eos.to(torch.int8).argmax(dim=1)
    per_row = torch.where(has_eos, first + 1, torch.full_like(first, steps))
    return int(per_row.sum())


def measure_gemm_gflops(seconds: float = 2.0) -> float:
    """Measure this machine's float32 matmul rate in GFLOP/s, on the current torch thread settings: the faster of
    `torch.matmul` (MKL) and, where oneDNN is available, its product over a prepacked weight (which contbatch's
    packed layers use), each timed for about `seconds / 2` after a short warm-up.

    The shape is [512 x 576] @ [576 x 1536] (a SmolLM2-135M MLP projection over a 512-token chunk).
    """
    m, k, n = 512, 576, 1536
    a = torch.randn(m, k, dtype=torch.float32)
    b = torch.randn(k, n, dtype=torch.float32)
    c = torch.empty(m, n, dtype=torch.float32)
    products: list[Callable[[], object]] = [lambda: torch.matmul(a, b, out=c)]
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    return max(_gflops(product, 2.0 * m * k * n, seconds / len(products)) for product in products)


def _gflops(product: Callable[[], object], flop: float, seconds: float) -> float:
    with torch.inference_mode():
        for _ in range(5):
            product()
        iterations = 0
        start = time.perf_counter()
        elapsed = 0.0
        while elapsed < seconds:
            product()
            iterations += 1
            elapsed = time.perf_counter() - start
    return flop * iterations / elapsed / 1e9


def format_table(results: list[BenchResult], reference: str, gemm_gflops: float | None, num_params: int) -> str:
    """Render the results as a markdown table plus a line relating the reference engine to the GEMM rate.

    Columns: engine | wall s | generated tokens | generated tok/s | processed tok/s | ratio, where ratio is
    the engine's generated tok/s divided by the `reference` engine's. The closing line gives the measured
    float32 GEMM rate, the processed-token rate it allows at 2 * `num_params` FLOP per token, and the share of
    that rate the reference engine's processed tok/s reaches; with `gemm_gflops` None (a model off the CPU, whose
    rate the CPU's probe does not bound) there is no such line.

    Raises:
        ValueError: no result is named `reference`.
    """
    ref = next((r for r in results if r.engine == reference), None)
    if ref is None:
        names = ", ".join(r.engine for r in results)
        raise ValueError(f"reference engine {reference!r} is not among the results ({names})")
    lines = [
        "| engine | wall s | generated tokens | generated tok/s | processed tok/s | ratio to reference |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = r.generated_tok_s / ref.generated_tok_s if ref.generated_tok_s > 0 else float("nan")
        lines.append(
            f"| {r.engine} | {r.wall_s:.2f} | {r.generated_tokens} | {r.generated_tok_s:.1f} "
            f"| {r.processed_tok_s:.1f} | {ratio:.2f}x |"
        )
    if gemm_gflops is None:
        return "\n".join(lines)
    allowed = gemm_gflops * 1e9 / (2.0 * num_params)
    share = ref.processed_tok_s / allowed if allowed > 0 else float("nan")
    lines.append("")
    lines.append(
        f"Measured float32 GEMM rate: {gemm_gflops:.1f} GFLOP/s, which allows {allowed:.0f} processed tok/s "
        f"at 2 x {num_params / 1e6:.1f}M FLOP per token; {reference} reaches {share:.1%} of it "
        f"({ref.processed_tok_s:.1f} processed tok/s)."
    )
    return "\n".join(lines)
