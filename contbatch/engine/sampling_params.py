"""Per-request sampling parameters, derived from a `GenerationConfig` plus per-request overrides."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

from transformers import GenerationConfig

from contbatch.engine.generation_config import as_ids, config_fields, max_new_tokens_for, min_new_tokens_for
from contbatch.engine.structured import StructuredOutput

OVERRIDABLE = ("do_sample", "temperature", "top_k", "top_p", "min_p", "max_new_tokens", "min_tokens", "eos_token_ids",
               "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "logit_bias", "bad_words_ids", "suppress_tokens", "structured_output", "num_beams", "length_penalty",
               "early_stopping", "num_return_sequences", "seed", "logprobs", "top_logprobs", "logprobs_mode",
               "prompt_logprobs", "prompt_logprobs_start")
_ALIASES = {"eos_token_id": "eos_token_ids", "min_new_tokens": "min_tokens"}
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
        min_p: sampling keeps only tokens whose probability is at least min_p times the most likely one's
            (after top-k and top-p, as `generate`'s `MinPLogitsWarper`); 0 keeps all.
        min_tokens: until this many tokens are generated, the stop tokens (`stop_ids`) have probability 0
            (`generate`'s `min_new_tokens`; `min_length` resolves to it).
        eos_token_ids: generating any of these finishes the request with reason "stop" (the token is kept),
            unless `ignore_eos`.
        stop_token_ids: more tokens that finish the request with reason "stop" (kept), even with `ignore_eos`.
        ignore_eos: EOS tokens do not finish the request (vLLM's `ignore_eos`).
        repetition_penalty: `generate`'s: the logit of every token in the prompt or generated so far is divided
            by it when positive, multiplied when negative; 1.0 is off.
        presence_penalty / frequency_penalty: OpenAI's, in [-2, 2]: the logit of each token generated so far
            (not the prompt) is lowered by presence_penalty once and by frequency_penalty per occurrence.
        logit_bias: OpenAI's (token id, bias in [-100, 100]) pairs, added to the logits.
        sequence_bias: `generate`'s: (token sequence, bias) pairs; a one-token key biases that token, a longer
            one biases its last token when the sequence so far ends with the others.
        bad_words_ids: `generate`'s: token sequences that may never be generated (a one-token sequence that is
            an EOS id is ignored, as `generate` does).
        suppress_tokens: tokens that are never generated.
        structured_output: a grammar the output must follow (JSON schema, any JSON object, regex or a choice of
            strings: see `StructuredOutput`); a dict of its fields is accepted. Tokens the grammar does not allow
            next have probability 0, and the request stops (reason "stop") once the grammar is complete and
            nothing else may follow. Needs the engine's tokenizer.
        num_beams: > 1 runs beam search (`generate`'s, greedy): the request becomes a group of num_beams beams
            sharing their common prefix's blocks, and its outputs are the `num_return_sequences` best finished
            hypotheses with their `sequence_score`. `length_penalty` and `early_stopping` (True, False or
            "never") are `generate`'s. Beam search does not sample and does not report logprobs.
        seed: when set, the request samples from its own generator seeded with it, so its tokens do not
            depend on the rest of the batch.
        logprobs: record the log-probability of each chosen token, under the distribution `logprobs_mode` names.
        top_logprobs: also record the `top_logprobs` most likely tokens at each step under that distribution,
            with their log-probabilities (0 to MAX_TOP_LOGPROBS; implies `logprobs`).
        logprobs_mode: which distribution logprobs are taken from. "raw" (OpenAI's meaning): log_softmax of the
            model's logits, before temperature, top-k and top-p. "processed": log_softmax of the scores the token
            was drawn from (logits / temperature, then top-k and top-p, removed tokens at -inf), what RL importance
            ratios need. Logits processors (penalties, biases, banned tokens) count as processing; a greedy
            request (do_sample=False) ignores temperature, top-k and top-p, so without processors its processed
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
    min_p: float = 0.0
    max_new_tokens: int = 20
    min_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    structured_output: StructuredOutput | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: str = "raw"
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        _check_int("top_k", self.top_k, minimum=0)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if self.do_sample and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0 when sampling, got {self.temperature!r}")
        _check_range("top_p", self.top_p, 0, 1, low_open=True)
        _check_range("min_p", self.min_p, 0, 1)
        _check_range("presence_penalty", self.presence_penalty, -2, 2)
        _check_range("frequency_penalty", self.frequency_penalty, -2, 2)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("eos_token_ids", "stop_token_ids", "suppress_tokens"):
            for token_id in getattr(self, name):
                _check_int(name, token_id, minimum=0)
        _check_biases(self.logit_bias, self.sequence_bias, self.bad_words_ids)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput, got {self.structured_output!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        self._check_logprobs()
        self._check_beams()

    def _check_beams(self) -> None:
        _check_int("num_beams", self.num_beams, minimum=1)
        _check_int("num_return_sequences", self.num_return_sequences, minimum=1)
        _check_number("length_penalty", self.length_penalty)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.num_beams == 1:
            return
        refused = [name for name, on in (("do_sample=True (beam sampling)", self.do_sample),
                                          ("logprobs", self.wants_logprobs),
                                          ("prompt_logprobs", self.prompt_logprobs is not None),
                                          ("structured_output", self.structured_output is not None)) if on]
        if self.max_new_tokens == 0:
            refused.append("max_new_tokens=0")
        if refused:
            raise ValueError(f"num_beams={self.num_beams}: beam search does not support {', '.join(refused)}")
        if self.num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences ({self.num_return_sequences}) must be at most num_beams "
                             f"({self.num_beams})")

    def _check_logprobs(self) -> None:
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
        """Whether this request's logprobs come from the processed scores (the "processed" mode)."""
        return self.logprobs_mode == "processed"

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that finish the request with reason "stop": `stop_token_ids`, and `eos_token_ids` unless
        `ignore_eos`."""
        return frozenset(self.stop_token_ids) | frozenset(() if self.ignore_eos else self.eos_token_ids)

    @functools.cached_property
    def uses_processors(self) -> bool:
        """Whether any logits processor applies to this request (penalties, biases, banned or suppressed tokens,
        a minimum length): requests without any keep their logits untouched."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias or self.sequence_bias or self.bad_words_ids or self.suppress_tokens
                    or self.min_tokens)

    @property
    def token_id_fields(self) -> dict[str, tuple[int, ...]]:
        """Every token id the parameters name, by field, for checking them against the vocabulary."""
        return {
            "eos_token_ids": self.eos_token_ids, "stop_token_ids": self.stop_token_ids,
            "suppress_tokens": self.suppress_tokens, "logit_bias": tuple(t for t, _ in self.logit_bias),
            "sequence_bias": tuple(t for key, _ in self.sequence_bias for t in key),
            "bad_words_ids": tuple(t for seq in self.bad_words_ids for t in seq),
        }

    @classmethod
    def from_generation_config(cls, config: GenerationConfig | None, num_prompt_tokens: int | None = None,
                               max_positions: int | None = None, **overrides: Any) -> SamplingParams:
        """The parameters of a request under `config` (best resolved first with `resolve_generation_config`, as
        the engine does): its sampling fields and logits processors (see `config_fields`), its lengths as
        `generate` resolves them for a prompt of `num_prompt_tokens` (when None, `max_new_tokens` or 20 and
        `min_new_tokens` or 0), then the non-None `overrides` (keys among `OVERRIDABLE`; aliases:
        `eos_token_id` for `eos_token_ids`, one id or several; `min_new_tokens` for `min_tokens`; `logit_bias`
        may be a dict {token id: bias}). Raises ValueError naming an unknown key or a bad value."""
        base = cls()
        given = _normalise(overrides)
        if config is not None:
            lengths: dict[str, Any] = {"max_new_tokens": config.max_new_tokens or base.max_new_tokens,
                                       "min_tokens": config.min_new_tokens or 0}
            if num_prompt_tokens is not None:
                lengths = {"min_tokens": min_new_tokens_for(config, num_prompt_tokens),
                           "max_new_tokens": given["max_new_tokens"] if "max_new_tokens" in given
                           else max_new_tokens_for(config, num_prompt_tokens, max_positions)}
            base = replace(base, **config_fields(config), **lengths)
        if given.get("temperature", 1.0) != 1.0 or given.get("top_p", 1.0) != 1.0 or given.get("top_k", 0):
            given.setdefault("do_sample", True)
        return replace(base, **given)


def _normalise(overrides: dict[str, Any]) -> dict[str, Any]:
    """The non-None overrides under their field names, in their field types; ValueError for an unknown key."""
    for alias, name in _ALIASES.items():
        if alias in overrides:
            overrides[name] = overrides.pop(alias)
    unknown = set(overrides) - set(OVERRIDABLE)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {sorted(unknown)}; known: {list(OVERRIDABLE)}")
    given = {key: value for key, value in overrides.items() if value is not None}
    for name in ("eos_token_ids", "stop_token_ids", "suppress_tokens"):
        if name in given:
            given[name] = as_ids(given[name])
    if "logit_bias" in given:
        given["logit_bias"] = _as_bias(given["logit_bias"])
    if isinstance(given.get("structured_output"), dict):
        try:
            given["structured_output"] = StructuredOutput(**given["structured_output"])
        except TypeError as error:
            raise ValueError(f"structured_output: {error}") from None
    if "bad_words_ids" in given:
        given["bad_words_ids"] = tuple(tuple(seq) for seq in given["bad_words_ids"])
    return given


def _as_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` ({token id, as an int or a decimal string: bias}) as sorted (id, bias) pairs."""
    items = value.items() if isinstance(value, dict) else value
    pairs = []
    for token, bias in items:
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        _check_int("logit_bias token id", token, minimum=0)
        pairs.append((token, bias))
    return tuple(sorted(pairs))


def _check_biases(logit_bias: tuple[tuple[int, float], ...],
                  sequence_bias: tuple[tuple[tuple[int, ...], float], ...],
                  bad_words_ids: tuple[tuple[int, ...], ...]) -> None:
    for _, bias in logit_bias:
        _check_range("logit_bias value", bias, -100, 100)
    for key, bias in sequence_bias:
        if not key:
            raise ValueError("sequence_bias keys must be non-empty token sequences")
        _check_number("sequence_bias value", bias)
    for sequence in bad_words_ids:
        if not sequence:
            raise ValueError("bad_words_ids must hold non-empty token sequences")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")


def _check_range(name: str, value: object, low: int | float, high: int | float, low_open: bool = False) -> None:
    _check_number(name, value)
    assert isinstance(value, (int, float))
    if not (low < value <= high if low_open else low <= value <= high):
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
