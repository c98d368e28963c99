"""`Decoding`: how every engine of the throughput benchmark decodes, greedy or sampled."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig


@dataclass(frozen=True)
class Decoding:
    """Greedy (`temperature` 0, the default), or sampled from the distribution tempered by `temperature`, cut to
    its `top_k` most likely tokens (0: no cut) and then to its `top_p` nucleus (1.0: none), as `generate`'s
    warpers and vLLM's sampler both do. Sampled outputs differ between engines by design (each draws from its
    own random stream): only their speed compares.

    Raises:
        ValueError: a field out of range (temperature < 0 or not finite, top_p outside (0, 1], top_k < 0).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        """"greedy", or the sampling settings, e.g. "sampled (temperature=0.7, top_p=0.9, top_k=50)"."""
        if self.is_greedy:
            return "greedy"
        return f"sampled (temperature={self.temperature:g}, top_p={self.top_p:g}, top_k={self.top_k})"

    def generation_config(self, max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                          pad_token_id: int | None) -> GenerationConfig:
        """`generate`'s configuration of this decoding, stopping at the first of `eos_token_id`."""
        eos = eos_token_id if isinstance(eos_token_id, int) or eos_token_id is None else list(eos_token_id)
        return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad_token_id,
                                **self.generate_kwargs())

    def generate_kwargs(self) -> dict[str, Any]:
        """The sampling fields of `generate`'s configuration (top_k set even at 0: unset, generate cuts to 50)."""
        if self.is_greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


GREEDY = Decoding()


def decoding_of(args: argparse.Namespace) -> Decoding:
    """The decoding `contbatch bench`'s `--temperature`, `--top-p` and `--top-k` ask for (greedy without them).

    Raises:
        ValueError: a flag out of range (see `Decoding`).
    """
    return Decoding(args.temperature, args.top_p, args.top_k)
