"""Per-request sampling parameters, derived from a `GenerationConfig` plus per-request overrides."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from transformers import GenerationConfig

_OVERRIDABLE = ("do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "eos_token_ids", "seed", "logprobs",
                "top_logprobs", "logprobs_mode", "prompt_logprobs", "prompt_logprobs_start")
MAX_TOP_LOGPROBS = 20
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its next tokens and when it stops.

    Attributes:
        do_sample: False means greedy (argmax); temperature, top_k and top_p are then ignored.
        temperature: logits are divided by it before sampling; > 0.
        top_k: keep only the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p; 1.0 keeps all.
        max_new_tokens: the request finishes with reason "length" after this many generated tokens; >= 0.
            0 scores the prompt without generating: the request computes its prompt (all of it but the last
            token, whose logits nothing needs), reports its prompt logprobs if it asks, and finishes.
        eos_token_ids: generating any of these finishes the request with reason "stop" (the token is kept).
        seed: when set, the request samples from its own generator seeded with it, so its tokens do not
            depend on the rest of the batch.
        logprobs: record the log-probability of each chosen token, under the distribution `logprobs_mode` names.
        top_logprobs: also record the `top_logprobs` most likely tokens at each step under that distribution,
            with their log-probabilities (0 to MAX_TOP_LOGPROBS; implies `logprobs`).
        logprobs_mode: which distribution logprobs are taken from. "raw" (OpenAI's meaning): log_softmax of the
            model's logits, before temperature, top-k and top-p. "processed": log_softmax of the scores the token
            was drawn from (logits / temperature, then top-k and top-p, removed tokens at -inf), what RL importance
            ratios need. A greedy request (do_sample=False) ignores temperature, top-k and top-p, so its processed
            logprobs are its raw ones.
        prompt_logprobs: None (the default) computes no prompt logprobs. An int k in 0..MAX_TOP_LOGPROBS reports,
            for every prompt token after the first, its log-probability given the tokens before it (log_softmax
            of the raw logits at the previous position: no temperature, top-k or top-p, whatever
            `logprobs_mode` says) and, when k > 0, the k most likely tokens there (vLLM's `prompt_logprobs`).
            A cached prefix has no logits, so such a request takes from the prefix cache only the tokens before
            the position that scores its first entry still to compute (see `prompt_logprobs_start`); the blocks
            it computes are cached for others.
        prompt_logprobs_start: with `prompt_logprobs`, the prompt index of the first token to score: the
            entries of the tokens before it are None and cost nothing, and the request may take those tokens
            but the last from the prefix cache (scoring a continuation after a shared context computes the
            context once). 0 (the default) scores every token after the first; must be less than the prompt's
            length.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 20
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: str = "raw"
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        _check_int("top_k", self.top_k, minimum=0)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if self.do_sample and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0 when sampling, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for token_id in self.eos_token_ids:
            _check_int("eos_token_id", token_id, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        _check_int("top_logprobs", self.top_logprobs, minimum=0)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
            if self.prompt_logprobs > MAX_TOP_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be None or at most {MAX_TOP_LOGPROBS}, got "
                                 f"{self.prompt_logprobs}")
        _check_int("prompt_logprobs_start", self.prompt_logprobs_start, minimum=0)
        if self.prompt_logprobs_start and self.prompt_logprobs is None:
            raise ValueError(f"prompt_logprobs_start={self.prompt_logprobs_start} needs prompt_logprobs (None)")
        if not isinstance(self.logprobs_mode, str) or self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def processed_logprobs(self) -> bool:
        """Whether this request's logprobs come from the processed scores: "processed" mode and sampling."""
        return self.do_sample and self.logprobs_mode == "processed"

    @classmethod
    def from_generation_config(cls, config: GenerationConfig | None, **overrides: Any) -> SamplingParams:
        """Reads do_sample, temperature, top_k, top_p, max_new_tokens, eos_token_id and (when set, as extra
        attributes: `GenerationConfig(logprobs_mode="processed", prompt_logprobs=0)`) logprobs_mode and
        prompt_logprobs from `config`, then applies
        the non-None `overrides` (keys among SamplingParams' fields; `eos_token_id` is accepted for
        `eos_token_ids` and may be one id or a list). Raises ValueError naming an unknown key or a bad value."""
        base = cls()
        if config is not None:
            base = replace(
                base,
                do_sample=bool(config.do_sample),
                temperature=1.0 if config.temperature is None else config.temperature,
                top_k=config.top_k or 0,
                top_p=1.0 if config.top_p is None else config.top_p,
                max_new_tokens=base.max_new_tokens if config.max_new_tokens is None else config.max_new_tokens,
                eos_token_ids=_as_ids(config.eos_token_id),
                logprobs_mode=_config_mode(config, base.logprobs_mode),
                prompt_logprobs=getattr(config, "prompt_logprobs", None),
            )
        if "eos_token_id" in overrides:
            overrides["eos_token_ids"] = overrides.pop("eos_token_id")
        unknown = set(overrides) - set(_OVERRIDABLE)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {sorted(unknown)}; known: {list(_OVERRIDABLE)}")
        given = {key: value for key, value in overrides.items() if value is not None}
        if "eos_token_ids" in given:
            given["eos_token_ids"] = _as_ids(given["eos_token_ids"])
        if given.get("temperature", 1.0) != 1.0 or given.get("top_p", 1.0) != 1.0 or given.get("top_k", 0):
            given.setdefault("do_sample", True)
        return replace(base, **given)


def _config_mode(config: GenerationConfig, default: str) -> str:
    mode = getattr(config, "logprobs_mode", None)
    return default if mode is None else mode


def _as_ids(value: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
