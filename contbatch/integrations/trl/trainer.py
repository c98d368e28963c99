"""`ContbatchGRPOTrainer`: TRL's `GRPOTrainer` generating with contbatch on the live training model.

No second copy of the weights and no weight sync: the engine runs the very model object the trainer optimises (its
attention function hands every non-contbatch forward back to the model's own implementation, so training is
unchanged). One engine serves the whole run; after each optimizer step the engine is told the weights changed, so
no KV computed under the old policy is reused and outputs carry the new `weights_version`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from transformers import PreTrainedModel
from trl import GRPOConfig, GRPOTrainer

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, GenerationOutput, RequestStatus
from contbatch.integrations.trl.shared_prompt import shared_prompt_logps
from contbatch.training import supports_shared_prompt

GENERATION_KWARGS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "min_tokens", "eos_token_id", "seed")


class ContbatchGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` (same arguments) whose single-turn generation runs on contbatch.

    Keyword-only additions:
        contbatch_config: the engine's settings (default: a cache of at most half the free memory).
        release_kv_between_steps: free the KV cache after each generation phase (`ContinuousBatchingManager.sleep`)
            so that the training step has the memory; the next generation takes it back (default True: on CPU too
            the cache's written pages are resident, and giving them back costs milliseconds per step).
        shared_prompt_forward: compute each distinct prompt once in the policy's forward and backward, its keys
            and values read by all of its completions, instead of once per completion (default True; see
            `shared_prompt`). Same log-probabilities and gradients to rounding. It applies to the policy (attached
            to contbatch from the first generation on, a PEFT policy with its adapters disabled included) in
            text-only, single-process runs whose attention is "sdpa" or "eager", without an MoE auxiliary loss or
            reentrant activation checkpointing; other forwards (a separate reference model) run TRL's own.

    Each call generates every distinct prompt once with `n` = its number of copies (TRL repeats each prompt
    `num_generations` times), so a prompt's prefill is computed once and its samples share its KV blocks. It returns
    the completion ids and, per token, the log-probability of the distribution the token was sampled from
    (temperature, top-k and top-p applied: contbatch's "processed" logprobs), which TRL stores as
    `sampling_per_token_logps` for its off-policy mask. Multimodal models, `use_vllm`,
    `use_transformers_continuous_batching`, prompt-learning PEFT adapters and `generation_kwargs` keys outside
    `GENERATION_KWARGS` are refused at construction with a ValueError naming them. `min_p` and
    `repetition_penalty` apply as in TRL's `generate` path (the processed logprobs then include them).
    """

    def __init__(self, *args: Any, contbatch_config: ContinuousBatchingConfig | None = None,
                 release_kv_between_steps: bool = True, shared_prompt_forward: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _check_supported(self)
        self.contbatch_config = contbatch_config or ContinuousBatchingConfig(max_memory_percent=0.5)
        self.release_kv_between_steps = release_kv_between_steps
        self.shared_prompt_forward = shared_prompt_forward
        self.contbatch_manager: ContinuousBatchingManager | None = None
        self._contbatch_step: int | None = None
        self._calls = itertools.count()

    def _generate_single_turn(self, prompt_ids: list[list[int]], images: Any, multimodal_fields: dict[str, Any],
                              num_generations: int, has_tool_images: bool = False
                              ) -> tuple[list[list[int]], list[list[float]]]:
        """TRL's generation hook: one completion per entry of `prompt_ids` (in order) and the processed logprob
        of each completion token. A prompt contbatch refuses raises ValueError, a request failing in the engine
        RuntimeError, both naming the request; the call's other requests are then cancelled."""
        if images is not None or multimodal_fields or has_tool_images:
            raise ValueError("ContbatchGRPOTrainer generates text only: got images or multimodal fields")
        manager = self._manager()
        if self._contbatch_step is not None and self._contbatch_step != self.state.global_step:
            manager.mark_weights_updated()
        self._contbatch_step = self.state.global_step
        with _eval_mode(manager.model):
            outputs = self._run(manager, prompt_ids)
        if self.release_kv_between_steps:
            manager.sleep()
        logprobs = [list(cast(list[float], output.logprobs)) for output in outputs]
        return [output.generated_tokens for output in outputs], logprobs

    def _run(self, manager: ContinuousBatchingManager, prompt_ids: Sequence[Sequence[int]]) -> list[GenerationOutput]:
        """Generates for every prompt, each distinct prompt once with n samples; outputs in prompt order."""
        copies: dict[tuple[int, ...], list[int]] = {}
        for index, ids in enumerate(prompt_ids):
            copies.setdefault(tuple(ids), []).append(index)
        sample_of: dict[str, int] = {}
        call = next(self._calls)
        try:
            for number, (ids, indices) in enumerate(copies.items()):
                request_id = manager.add_request(list(ids), request_id=f"grpo-{call}-{number}", n=len(indices),
                                                 max_new_tokens=self.max_completion_length, **self._sampling())
                samples = [request_id] if len(indices) == 1 else [f"{request_id}_{j}" for j in range(len(indices))]
                sample_of.update(zip(samples, indices, strict=True))
            return _collect(manager, sample_of)
        except BaseException:
            for request_id in sample_of:
                manager.cancel_request(request_id)
            raise

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **model_inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """TRL's per-token logprobs, entropies and aux loss of the completion columns; with the shared-prompt
        forward where it applies (`shared_prompt_forward`), else TRL's."""
        if self._shares_prompts(model, compute_aux_loss, model_inputs):
            with self.accelerator.autocast():
                shared = shared_prompt_logps(model, input_ids, attention_mask, logits_to_keep, batch_size)
            if shared is not None:
                logps, entropies = shared
                return logps, entropies if compute_entropy else None, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss, **model_inputs)

    def _shares_prompts(self, model: Any, compute_aux_loss: bool, model_inputs: dict[str, Any]) -> bool:
        if not self.shared_prompt_forward or compute_aux_loss or self.accelerator.num_processes != 1:
            return False
        if any(value is not None for value in model_inputs.values()):
            return False
        checkpointing = cast("dict[str, Any] | None", self.args.gradient_checkpointing_kwargs)
        if self.args.gradient_checkpointing and checkpointing is not None and checkpointing.get("use_reentrant", True):
            return False
        unwrapped = self.accelerator.unwrap_model(model)
        return supports_shared_prompt(unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped)

    def _sampling(self) -> dict[str, Any]:
        """The per-request sampling settings: TRL's, then `args.generation_kwargs` (keys in `GENERATION_KWARGS`)."""
        sampling = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or 0,
                    "min_p": self.min_p or 0.0, "repetition_penalty": self.repetition_penalty,
                    "eos_token_id": list(self.eos_token_ids)}
        sampling.update(_generation_kwargs(self))
        return {**sampling, "logprobs": True, "logprobs_mode": "processed"}

    def _manager(self) -> ContinuousBatchingManager:
        """The run's one manager, started on the unwrapped training model at the first generation."""
        if self.contbatch_manager is None:
            model = _generating_model(self.accelerator.unwrap_model(self.model_wrapped))
            self.contbatch_manager = ContinuousBatchingManager(model, None, self.contbatch_config)
            self.contbatch_manager.start()
        return self.contbatch_manager

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, then the engine is stopped and its cache freed (the model gets its attention back)."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self.close_contbatch()

    def close_contbatch(self) -> None:
        """Stops the engine and frees its cache (idempotent); a later generation starts a new one."""
        if self.contbatch_manager is not None:
            self.contbatch_manager.stop()
            self.contbatch_manager = None
            self._contbatch_step = None


def _collect(manager: ContinuousBatchingManager, sample_of: dict[str, int]) -> list[GenerationOutput]:
    """The final output of every request of `sample_of`, placed at its index; raises RuntimeError naming a request
    that failed or was cancelled (a cut-short completion must not be trained on)."""
    outputs: list[GenerationOutput | None] = [None] * len(sample_of)
    for request_id, index in sample_of.items():
        output = manager.get_result(request_id)
        if output is None:
            raise RuntimeError("contbatch stopped before every completion was generated")
        if output.status == RequestStatus.FAILED:
            raise RuntimeError(f"contbatch failed request {request_id!r}: {output.error}")
        if output.status != RequestStatus.FINISHED:
            raise RuntimeError(f"contbatch request {request_id!r} ended {output.status.name} before its completion")
        outputs[index] = output
    return [output for output in outputs if output is not None]


def _check_supported(trainer: GRPOTrainer) -> None:
    refused = [name for name in ("use_vllm", "use_transformers_continuous_batching") if getattr(trainer, name)]
    refused += [f"generation_kwargs[{key!r}]" for key in _generation_kwargs(trainer)
                if key not in GENERATION_KWARGS]
    if getattr(trainer, "_is_vlm", False):
        refused.append("a multimodal model")
    if refused:
        raise ValueError(f"ContbatchGRPOTrainer does not support {', '.join(refused)}: it generates with contbatch")
    _generating_model(trainer.accelerator.unwrap_model(trainer.model))


def _generation_kwargs(trainer: GRPOTrainer) -> dict[str, Any]:
    """`args.generation_kwargs` of TRL's `GRPOConfig`, {} when unset (a JSON string is a dict once it is parsed)."""
    return cast("dict[str, Any] | None", cast(GRPOConfig, trainer.args).generation_kwargs) or {}


def _generating_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model contbatch runs: the model itself, or a PEFT model's base model, into which LoRA-style
    adapters are injected (so active adapters apply). Prompt-learning adapters live outside it: refused."""
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        peft_model = cast(Any, model)
        adapter = peft_model.peft_config[peft_model.active_adapter]
        if adapter.is_prompt_learning:
            raise ValueError(f"ContbatchGRPOTrainer does not support prompt-learning PEFT adapters "
                             f"({adapter.peft_type}): their virtual tokens are not part of the model's forward")
        return peft_model.get_base_model()
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"ContbatchGRPOTrainer needs a transformers model, got {type(model).__name__}")
    return model


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Generation runs without dropout (and so without gradient checkpointing); the mode is restored after."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)
