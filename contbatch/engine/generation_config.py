"""`generate`'s rules for a `GenerationConfig`: unset fields come from the model's generation config, then from
transformers' global defaults; lengths resolve per prompt; fields contbatch cannot honour are refused by name."""

from __future__ import annotations

import copy
from typing import Any

from transformers import GenerationConfig

UNSUPPORTED_IF_SET: dict[str, tuple[object, ...]] = {
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "no_repeat_ngram_size": (None, 0),
    "guidance_scale": (None, 1, 1.0),
    "watermarking_config": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
    "begin_suppress_tokens": (None,),
    "remove_invalid_values": (None, False),
    "constraints": (None,),
    "force_words_ids": (None,),
    "max_time": (None,),
    "stop_strings": (None,),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
    "num_beam_groups": (None, 1),
    "diversity_penalty": (None, 0.0),
    "token_healing": (None, False),
}
"""Fields contbatch does not implement, with the values that leave `generate`'s output unchanged. A resolved
config holding another value is refused (ValueError naming the field): silently ignoring it would break the
promise of `generate`'s tokens. Fields that change only what `generate` returns (scores, dicts), its caching or
its assistant model are not listed: they do not change the tokens."""


def resolve_generation_config(config: GenerationConfig | None, model_config: GenerationConfig) -> GenerationConfig:
    """The config `generate(generation_config=config)` runs with: a copy of `config` (an empty one when None)
    whose unset (None) fields are taken from `model_config` (custom entries such as `logprobs_mode` included),
    then from transformers' global defaults, exactly as `generate` merges them, except `max_length`, which stays
    None when neither config sets it: `generate` then generates 20 new tokens whatever the prompt's length, up
    to the model's positions (see `max_new_tokens_for`). Validation warnings and errors are transformers' own.
    `config is model_config` is allowed."""
    resolved = copy.deepcopy(config) if config is not None else GenerationConfig()
    resolved.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    defaults = dict(GenerationConfig._get_default_generation_params())
    defaults.pop("max_length")
    resolved.update(**defaults, defaults_only=True)
    return resolved


def check_supported(config: GenerationConfig) -> None:
    """Raises ValueError naming the first field of `config` that contbatch would have to ignore (see
    `UNSUPPORTED_IF_SET`)."""
    for name, neutral in UNSUPPORTED_IF_SET.items():
        value = getattr(config, name, None)
        if not any(value is v or (v is not None and value == v) for v in neutral):
            raise ValueError(f"generation config field {name}={value!r} is not supported by contbatch; unset it")


def max_new_tokens_for(config: GenerationConfig, num_prompt_tokens: int, max_positions: int | None) -> int:
    """How many tokens `generate` would generate at most for a prompt of `num_prompt_tokens`: `max_new_tokens`
    when set; else `max_length` minus the prompt (ValueError, as `generate` raises, when the prompt already
    reaches it); else 20, capped by the model's positions."""
    if config.max_new_tokens is not None:
        return int(config.max_new_tokens)
    if config.max_length is not None:
        if num_prompt_tokens >= config.max_length:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens but max_length is {config.max_length}: "
                             f"raise max_length or, better, set max_new_tokens")
        return int(config.max_length) - num_prompt_tokens
    default_length = GenerationConfig._get_default_generation_params()["max_length"]
    limit = default_length + num_prompt_tokens
    if max_positions is not None:
        limit = min(limit, max_positions)
    if num_prompt_tokens >= limit:
        raise ValueError(f"the prompt has {num_prompt_tokens} tokens, as many as the model's {max_positions} "
                         f"positions: nothing can be generated")
    return limit - num_prompt_tokens


def min_new_tokens_for(config: GenerationConfig, num_prompt_tokens: int) -> int:
    """How many new tokens must come before a stop token may: `min_new_tokens` when set (which `generate` also
    turns into `min_length`), else what `min_length` (counting the prompt) leaves."""
    if config.min_new_tokens is not None:
        return int(config.min_new_tokens)
    return max(0, int(config.min_length or 0) - num_prompt_tokens)


def config_fields(config: GenerationConfig) -> dict[str, Any]:
    """The `SamplingParams` fields a resolved config sets (lengths apart, which depend on the prompt): the
    sampling fields and, since `generate` applies them in greedy mode too, the logits processors."""
    bias = config.sequence_bias or {}
    sequence_bias = bias if isinstance(bias, dict) else {tuple(key): value for key, value in bias}
    return {
        "do_sample": bool(config.do_sample),
        "temperature": 1.0 if config.temperature is None else config.temperature,
        "top_k": config.top_k or 0,
        "top_p": 1.0 if config.top_p is None else config.top_p,
        "min_p": config.min_p or 0.0,
        "repetition_penalty": 1.0 if config.repetition_penalty is None else config.repetition_penalty,
        "eos_token_ids": as_ids(config.eos_token_id),
        "bad_words_ids": tuple(tuple(seq) for seq in config.bad_words_ids or ()),
        "suppress_tokens": tuple(config.suppress_tokens or ()),
        "sequence_bias": tuple((tuple(key), float(value)) for key, value in sequence_bias.items()),
        "num_beams": config.num_beams or 1,
        "length_penalty": 1.0 if config.length_penalty is None else config.length_penalty,
        "early_stopping": bool(config.early_stopping) if config.early_stopping != "never" else "never",
        "logprobs_mode": getattr(config, "logprobs_mode", None) or "raw",
        "prompt_logprobs": getattr(config, "prompt_logprobs", None),
    }


def as_ids(value: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """One id, a sequence of ids or None, as a tuple."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)
