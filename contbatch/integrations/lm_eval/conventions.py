"""lm-evaluation-harness's conventions for requests, as its `hf` backend applies them, in plain functions:
context truncation, rolling windows and generation settings. Nothing here runs a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "seed")
PROCESSOR_KEYS = ("repetition_penalty", "min_new_tokens")

TokenPair = tuple[list[int], list[int]]


def truncate_pair(context: Sequence[int], continuation: Sequence[int], max_length: int) -> TokenPair:
    """The (context, continuation) actually scored for a loglikelihood request, as `HFLM._loglikelihood_tokens`
    does it: the model reads at most `max_length` tokens, so context + continuation keeps its last
    `max_length + 1` tokens (the last token is only scored, never read) and the context loses its leftmost ones.

    Raises:
        ValueError: an empty context or continuation, or a continuation longer than `max_length` (lm-eval's
            `hf` backend asserts the same).
    """
    if not context or not continuation:
        raise ValueError(f"loglikelihood needs a non-empty context and continuation, got {len(context)} and "
                         f"{len(continuation)} tokens")
    if len(continuation) > max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens does not fit max_length={max_length}")
    whole = [*context, *continuation][-(max_length + 1):]
    return whole[:-len(continuation)], whole[-len(continuation):]


def rolling_windows(tokens: Sequence[int], prefix_token_id: int, max_length: int) -> list[TokenPair]:
    """The disjoint (context, continuation) windows that score every token of `tokens` once, each with as much
    context as fits `max_length` (lm-eval's `get_rolling_token_windows` with `context_len=1`, as `HFLM`
    calls it); the first token is scored after `prefix_token_id`. Empty `tokens` give no window."""
    windows = get_rolling_token_windows(token_list=list(tokens), prefix_token=prefix_token_id,
                                        max_seq_len=max_length, context_len=1)
    return [make_disjoint_window(window) for window in windows]


@dataclass(frozen=True)
class GenerationSettings:
    """One `generate_until` request's settings, normalized as lm-eval normalizes them.

    Attributes:
        max_new_tokens: the request's `max_gen_toks` (or an alias: `max_new_tokens`, `max_tokens`, ...).
        until: the stop sequences, the end-of-text string last unless the task listed it.
        sampling: `add_request` keyword arguments: `do_sample`, `repetition_penalty` and `min_new_tokens` as
            given (`generate` applies them greedy or not), and when sampling `temperature`, `top_k`, `top_p`,
            `min_p` and `seed` as given.
    """

    max_new_tokens: int
    until: list[str]
    sampling: dict[str, Any] = field(default_factory=dict)


def generation_settings(gen_kwargs: dict[str, Any], eos: str | None, default_max_gen_toks: int) -> GenerationSettings:
    """The settings of a `generate_until` request from its lm-eval `gen_kwargs` (`normalize_gen_kwargs`, then
    `handle_stop_sequences` with the end-of-text string `eos`, as `HFLM.generate_until` does).

    Raises:
        ValueError: `gen_kwargs` is not a dict, or holds keys contbatch has no equivalent for (named), or
            `max_gen_toks` is negative.
    """
    if not isinstance(gen_kwargs, dict):
        raise ValueError(f"generate_until expects a dict of generation kwargs, got {type(gen_kwargs).__name__}")
    kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks))
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_new_tokens = int(kwargs.pop("max_gen_toks"))
    unknown = sorted(set(kwargs) - set(SAMPLING_KEYS) - set(PROCESSOR_KEYS))
    if unknown:
        raise ValueError(f"generation kwargs {unknown} are not supported by the contbatch backend (supported: "
                         f"until, max_gen_toks and its aliases, {', '.join(SAMPLING_KEYS + PROCESSOR_KEYS)})")
    if max_new_tokens < 0:
        raise ValueError(f"max_gen_toks must be >= 0, got {max_new_tokens}")
    do_sample = bool(kwargs.pop("do_sample"))
    sampling: dict[str, Any] = {"do_sample": do_sample}
    sampling.update({key: kwargs.pop(key) for key in PROCESSOR_KEYS if kwargs.get(key) is not None})
    if do_sample:
        sampling.update({key: value for key, value in kwargs.items() if value is not None})
    return GenerationSettings(max_new_tokens, [stop for stop in until if stop], sampling)


def truncate_context(tokens: Sequence[int], max_new_tokens: int, max_length: int) -> list[int]:
    """The prompt of a `generate_until` request: the context's last `max_length - max_new_tokens` tokens, so that
    prompt and generation fit `max_length` (`HFLM.generate_until`'s left truncation).

    Raises:
        ValueError: `max_new_tokens` leaves no room for the context.
    """
    room = max_length - max_new_tokens
    if room <= 0:
        raise ValueError(f"max_gen_toks={max_new_tokens} must be less than max_length={max_length}")
    return list(tokens)[-room:]
