"""The spec's entry points: `generate_batch` and the `ContinuousMixin` that adds it to a model."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel

from contbatch.config import ContinuousBatchingConfig
from contbatch.engine.engine import LLMEngine
from contbatch.outputs import GenerationOutput, RequestStatus

_ENGINE_ATTRIBUTE = "_contbatch_engine"


def generate_batch(
    model: PreTrainedModel,
    inputs: Sequence[Sequence[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    record_timestamps: bool = False,
    progress_bar: bool = True,
    persistent_manager: bool = False,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generates for every prompt of `inputs` (lists of token ids) with continuous batching.

    Returns `{request_id: GenerationOutput}` with ids "req_0", "req_1", ... in input order. A bad prompt does not
    raise: its output comes back FAILED with `error` set, and the other requests complete. `kwargs` may hold
    `max_new_tokens` and any `ContinuousBatchingConfig` field (which override `continuous_batching_config`);
    config fields carried by `generation_config` (as in transformers' older examples) are honoured when no
    `continuous_batching_config` is given. With `persistent_manager=True` the engine (and its cache) stays
    attached to the model and is reused by the next call with the same configuration. Either way the model gets
    its own attention implementation back before this returns.
    """
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    unknown = set(kwargs) - set(ContinuousBatchingConfig.field_names())
    if unknown:
        raise ValueError(f"generate_batch got unknown keyword argument(s) {sorted(unknown)}")
    generation_config = generation_config or model.generation_config
    sources = (kwargs,) if continuous_batching_config else (generation_config, kwargs)
    config = ContinuousBatchingConfig.from_sources(continuous_batching_config, *sources)
    engine = _engine_for(model, generation_config, config)
    try:
        return _run(engine, inputs, max_new_tokens, record_timestamps, progress_bar)
    finally:
        engine.close()
        if persistent_manager:
            setattr(model, _ENGINE_ATTRIBUTE, engine)


def _engine_for(model: PreTrainedModel, generation_config: GenerationConfig,
                config: ContinuousBatchingConfig) -> LLMEngine:
    engine: LLMEngine | None = getattr(model, _ENGINE_ATTRIBUTE, None)
    if engine is not None:
        delattr(model, _ENGINE_ATTRIBUTE)
        if engine.config == config and engine.generation_config == generation_config:
            engine.model_runner.attach()
            return engine
        engine.close()
    return LLMEngine(model, generation_config, config)


def _run(engine: LLMEngine, inputs: Sequence[Sequence[int]], max_new_tokens: int | None,
         record_timestamps: bool, progress_bar: bool) -> dict[str, GenerationOutput]:
    request_ids = [f"req_{index}" for index in range(len(inputs))]
    outputs: dict[str, GenerationOutput] = {}
    for request_id, prompt in zip(request_ids, inputs, strict=True):
        try:
            engine.add_request(prompt, request_id, max_new_tokens, record_timestamps)
        except ValueError as error:
            outputs[request_id] = _failed_output(request_id, prompt, str(error))
    start, generated = time.perf_counter(), 0
    with tqdm(total=len(request_ids), desc="generate_batch", unit="req", disable=not progress_bar) as bar:
        bar.update(len(outputs))
        while engine.has_unfinished_requests():
            produced = engine.step()
            generated += sum(request.status != RequestStatus.FAILED for request in produced)
            for request in produced:
                if request.is_finished:
                    outputs[request.request_id] = request.to_output()
                    bar.update(1)
            bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}", refresh=False)
    engine.check_integrity()
    return {request_id: outputs[request_id] for request_id in request_ids}


def _failed_output(request_id: str, prompt: Any, error: str) -> GenerationOutput:
    prompt_ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
    if isinstance(prompt, torch.Tensor):
        prompt_ids = prompt.tolist()
    return GenerationOutput(request_id, prompt_ids=prompt_ids, status=RequestStatus.FAILED,
                            finish_reason="error", error=error, created_time=time.time())


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


def add_continuous_batching(model: PreTrainedModel) -> PreTrainedModel:
    """Makes `model.generate_batch(...)` run on contbatch, for a model that is already loaded.

    The instance's class becomes a subclass of its own class with `ContinuousMixin` first in the method
    resolution order; nothing in transformers is patched, and other instances are untouched. Returns `model`.
    """
    cls = type(model)
    if not issubclass(cls, ContinuousMixin):
        model.__class__ = type(cls.__name__, (ContinuousMixin, cls), {"__module__": cls.__module__})
    return model
