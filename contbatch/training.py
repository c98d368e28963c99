"""Training forwards that compute a prompt once for many continuations, on a model contbatch is attached to.

RL trainers score several completions of each prompt (GRPO: `num_generations`) with a forward and backward over
every prompt + completion row, so each prompt is computed once per completion. With `SharedPrompt`, the prompt runs
once, its keys and values (with their autograd history) are recorded per layer, and the completions run as a batch
of their own whose attention reads the prompt's keys and values in front of theirs. Log-probabilities and gradients
are those of the repeated forward, to floating-point rounding. Activation checkpointing (non-reentrant, as
transformers enables it by default) works.

It runs through contbatch's attention function, so the model must be attached (a manager or engine built on it is
alive) and its own attention must be "sdpa" or "eager": check with `supports_shared_prompt`.

    shared = SharedPrompt.record(model, prompt_ids[:-1])
    out = model(input_ids=continuations, **shared.continuation_kwargs(continuations.size(1)))

where each row of `continuations` starts with the prompt's last token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import PretrainedConfig

from contbatch.engine.attention import ATTENTION_NAME, own_attention, supports_shared_prefix
from contbatch.engine.shared_prefix import SHARED_PREFIX_KWARG, SharedPrefix


def supports_shared_prompt(model: torch.nn.Module) -> bool:
    """Whether `SharedPrompt` forwards can run on `model` now (the transformers model, not a PEFT wrapper)."""
    return supports_shared_prefix(model)


@dataclass(frozen=True)
class SharedPrompt:
    """One prompt's recorded keys and values, for the forwards of its continuations."""

    prefix: SharedPrefix

    @classmethod
    def record(cls, model: torch.nn.Module, prompt_ids: torch.Tensor, **forward_kwargs: Any) -> SharedPrompt:
        """Runs `model` (a transformers causal LM, possibly PEFT-wrapped) over `prompt_ids` [length] and records
        each layer's keys and values; `forward_kwargs` go to that forward. An empty prompt records nothing.

        Raises:
            ValueError: `model` is not attached to contbatch, or its own attention is neither "sdpa" nor "eager"
                (its forwards would ignore the record).
        """
        base: torch.nn.Module = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
        if not supports_shared_prefix(base):
            config = cast(PretrainedConfig, base.config)
            if config._attn_implementation != ATTENTION_NAME:
                raise ValueError(f"SharedPrompt needs a model contbatch is attached to (a manager or engine built on "
                                 f"it is alive); this one runs {config._attn_implementation!r} attention")
            raise ValueError(f"SharedPrompt needs the model's own attention to be 'sdpa' or 'eager', not "
                             f"{own_attention(config)!r}")
        prefix = SharedPrefix(int(prompt_ids.numel()), recording=True)
        if prefix.length:
            model(input_ids=prompt_ids.reshape(1, -1), use_cache=False, logits_to_keep=1,
                  **{SHARED_PREFIX_KWARG: prefix}, **forward_kwargs)
        return cls(prefix)

    def continuation_kwargs(self, num_tokens: int, device: torch.device | None = None) -> dict[str, Any]:
        """Keyword arguments for a forward over continuation rows of `num_tokens` tokens: their positions (after
        the prompt) and the record to attend over."""
        positions = torch.arange(self.prefix.length, self.prefix.length + num_tokens, device=device).unsqueeze(0)
        if not self.prefix.length:
            return {"position_ids": positions}
        return {"position_ids": positions, SHARED_PREFIX_KWARG: self.prefix.reader()}
