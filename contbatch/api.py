"""The spec's entry points: `generate_batch` and the `ContinuousMixin` that adds it to a model."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch.engine.config import ContinuousBatchingConfig
from contbatch.engine.model_support import raise_if_unsupported
from contbatch.engine.structured import StructuredOutput
from contbatch.frontend.output_processor import RequestIds
from contbatch.manager import ContinuousBatchingManager
from contbatch.outputs import GenerationOutput, RequestStatus
from contbatch.telemetry import Telemetry

_MANAGER_ATTRIBUTE = "_contbatch_manager"


def generate_batch(
    model: PreTrainedModel,
    inputs: Sequence[Sequence[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    record_timestamps: bool = False,
    progress_bar: bool = True,
    persistent_manager: bool = False,
    tokenizer: PreTrainedTokenizerBase | None = None,
    structured_output: StructuredOutput | Sequence[StructuredOutput | None] | None = None,
    telemetry: Telemetry | None = None,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generates for every prompt of `inputs` (lists of token ids) with continuous batching.

    Returns `{request_id: GenerationOutput}` with ids "req_0", "req_1", ... in input order; with
    `generation_config.num_return_sequences = n > 1`, prompt i gives "req_i_0" ... "req_i_<n-1>" (n samples
    sharing the prompt's KV blocks). A bad prompt does not raise: its output comes back FAILED with `error` set,
    and the other requests complete. A model contbatch cannot compute exactly raises `UnsupportedModelError` (as
    its first output arrives, failed by it: every output would be). `kwargs` may hold
    `max_new_tokens` and any `ContinuousBatchingConfig` field (which override `continuous_batching_config`);
    config fields carried by `generation_config` (as in transformers' older examples) are honoured when no
    `continuous_batching_config` is given. With `return_logprobs=True`, `generation_config.logprobs_mode`
    ("raw", the default, or "processed": the distribution tokens were drawn from, see `SamplingParams`) chooses
    which log-probabilities the outputs carry. `generation_config.prompt_logprobs = k` (an extra attribute, k in
    0..20; None, the default, is off) fills every output's `prompt_logprobs`: the log-probability of each prompt
    token after the first given the tokens before it, plus the k most likely tokens there (for scoring
    continuations, as lm-eval's loglikelihood does: see `contbatch.loglikelihood`, and
    `GenerationOutput.prompt_logprobs`); such prompts are computed in full, never taken from the prefix cache.
    Runs on a `ContinuousBatchingManager`; with
    `persistent_manager=True` the manager (and its cache) stays attached to the model as `model._contbatch_manager`
    and is reused by the next call with the same configuration; its `sleep()` gives the cache's memory back until
    that call (e.g. while an RL trainer trains). Either way the model gets its own attention implementation back before
    this returns. `structured_output` constrains every prompt's output (one `StructuredOutput`) or each prompt's
    (a sequence with one entry, or None, per prompt) and needs the model's `tokenizer`; an invalid grammar fails
    its prompt's outputs like any bad prompt. `telemetry` sends a span per request and the metrics to its
    OpenTelemetry providers (default `Telemetry.default()`: the application's global providers or the `OTEL_*`
    environment, else off); each request's span is parented on the caller's current span.
    """
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    unknown = set(kwargs) - set(ContinuousBatchingConfig.field_names())
    if unknown:
        raise ValueError(f"generate_batch got unknown keyword argument(s) {sorted(unknown)}")
    generation_config = generation_config or model.generation_config
    sources = (kwargs,) if continuous_batching_config else (generation_config, kwargs)
    config = ContinuousBatchingConfig.from_sources(continuous_batching_config, *sources)
    constraints = _per_prompt(structured_output, len(inputs))
    telemetry = telemetry if telemetry is not None else Telemetry.default()
    manager = _manager_for(model, generation_config, config, tokenizer, telemetry)
    manager.start()
    try:
        return _run(manager, inputs, max_new_tokens, record_timestamps, progress_bar, constraints)
    finally:
        manager.stop(keep_for_next_session=persistent_manager)
        if persistent_manager:
            setattr(model, _MANAGER_ATTRIBUTE, manager)


def _per_prompt(structured_output: StructuredOutput | Sequence[StructuredOutput | None] | None,
                count: int) -> list[StructuredOutput | None]:
    if structured_output is None or isinstance(structured_output, StructuredOutput):
        return [structured_output] * count
    constraints = list(structured_output)
    if len(constraints) != count:
        raise ValueError(f"structured_output has {len(constraints)} entries for {count} prompts")
    return constraints


def _manager_for(model: PreTrainedModel, generation_config: GenerationConfig, config: ContinuousBatchingConfig,
                 tokenizer: PreTrainedTokenizerBase | None, telemetry: Telemetry) -> ContinuousBatchingManager:
    manager: ContinuousBatchingManager | None = getattr(model, _MANAGER_ATTRIBUTE, None)
    if manager is not None:
        delattr(model, _MANAGER_ATTRIBUTE)
        if (manager.config == config and manager.generation_config == generation_config
                and manager.tokenizer is tokenizer and manager.telemetry_config == telemetry):
            return manager
        manager.stop()
    return ContinuousBatchingManager(model, generation_config, config, tokenizer=tokenizer, telemetry=telemetry)


def _run(manager: ContinuousBatchingManager, inputs: Sequence[Sequence[int]], max_new_tokens: int | None,
         record_timestamps: bool, progress_bar: bool,
         constraints: list[StructuredOutput | None]) -> dict[str, GenerationOutput]:
    n = manager.generation_config.num_return_sequences or 1
    prompt_ids = [RequestIds.numbered(index) for index in range(len(inputs))]
    request_ids = [rid for prompt_id in prompt_ids for rid in RequestIds.samples(prompt_id, n)]
    outputs: dict[str, GenerationOutput] = {}
    with tqdm(total=len(request_ids), desc="generate_batch", unit="req", disable=not progress_bar) as bar:
        for prompt_id, prompt, constraint in zip(prompt_ids, inputs, constraints, strict=True):
            try:
                manager.add_request(prompt, prompt_id, max_new_tokens, record_timestamps=record_timestamps, n=n,
                                    structured_output=constraint)
            except ValueError as error:
                for request_id in RequestIds.samples(prompt_id, n):
                    outputs[request_id] = _failed_output(request_id, prompt, str(error))
                    bar.update(1)
        start, generated = time.perf_counter(), 0
        while len(outputs) < len(request_ids):
            output = manager.get_result(timeout=1.0)
            if output is None:
                continue
            raise_if_unsupported(output.error)
            outputs[output.request_id] = output
            generated += len(output.generated_tokens)
            bar.update(1)
            bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}", refresh=False)
    return {request_id: outputs[request_id] for request_id in request_ids}


def _failed_output(request_id: str, prompt: Any, error: str) -> GenerationOutput:
    prompt_ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
    if isinstance(prompt, torch.Tensor):
        prompt_ids = prompt.tolist()
    return GenerationOutput(request_id, prompt_ids=prompt_ids, status=RequestStatus.FAILED,
                            finish_reason="error", error=error, created_time=time.time())


def init_continuous_batching(model: PreTrainedModel, generation_config: GenerationConfig | None = None,
                             continuous_batching_config: ContinuousBatchingConfig | None = None,
                             telemetry: Telemetry | None = None) -> ContinuousBatchingManager:
    """A manager for `model`, not started yet (`telemetry`: see `EngineClient`)."""
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config, telemetry=telemetry)


@contextmanager
def continuous_batching_context_manager(
    model: PreTrainedModel, generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
) -> Iterator[ContinuousBatchingManager]:
    """A started manager for the `with` block; stopped (unfinished requests cancelled) when the block exits."""
    manager = init_continuous_batching(model, generation_config, continuous_batching_config)
    manager.start()
    try:
        yield manager
    finally:
        manager.stop()


class ContinuousMixin:
    """Adds `generate_batch` to a transformers model class: `class MyModel(ContinuousMixin, LlamaForCausalLM)`.

    For an already-loaded stock model use `contbatch.add_continuous_batching(model)`, or simply call
    `contbatch.generate_batch(model, ...)`.
    """

    def generate_batch(
        self,
        inputs: Sequence[Sequence[int]],
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        record_timestamps: bool = False,
        progress_bar: bool = True,
        persistent_manager: bool = False,
        **kwargs: Any,
    ) -> dict[str, GenerationOutput]:
        """contbatch's `generate_batch` on this model; see `contbatch.generate_batch`."""
        return generate_batch(self, inputs, generation_config, continuous_batching_config,  # type: ignore[arg-type]
                              record_timestamps, progress_bar, persistent_manager, **kwargs)

    def init_continuous_batching(self, generation_config: GenerationConfig | None = None,
                                 continuous_batching_config: ContinuousBatchingConfig | None = None
                                 ) -> ContinuousBatchingManager:
        """A `ContinuousBatchingManager` for this model, not started yet."""
        return init_continuous_batching(self, generation_config, continuous_batching_config)  # type: ignore[arg-type]

    def continuous_batching_context_manager(
        self, generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
    ) -> AbstractContextManager[ContinuousBatchingManager]:
        """A started manager for a `with` block, stopped when it exits."""
        return continuous_batching_context_manager(self, generation_config,  # type: ignore[arg-type]
                                                   continuous_batching_config)


def add_continuous_batching(model: PreTrainedModel) -> PreTrainedModel:
    """Makes `model.generate_batch(...)` run on contbatch, for a model that is already loaded.

    The instance's class becomes a subclass of its own class with `ContinuousMixin` first in the method
    resolution order; nothing in transformers is patched, and other instances are untouched. Returns `model`.
    """
    cls = type(model)
    if not issubclass(cls, ContinuousMixin):
        model.__class__ = type(cls.__name__, (ContinuousMixin, cls), {"__module__": cls.__module__})
    return model
