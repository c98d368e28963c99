"""`WeightsFingerprint`: tells whether a model's weights changed, so that stale KV is never reused."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class WeightsFingerprint:
    """Per parameter: its storage address, its in-place version counter, and the exact sum of its elements' bit
    patterns (as integers).

    What it detects:
      - replacing a parameter or its `.data` (a new storage), optimizer steps, `load_state_dict`, any in-place op
        on the parameter (the version counter);
      - a write through `.data`, `.detach()`, NumPy or any other alias that bypasses the version counter, to any
        number of elements, unless the writes leave the integer sum of the parameter's bit patterns unchanged.
        A write to a single element always changes it, so it is always detected.

    What it can miss: several elements of one parameter changed at once through an alias in a way that keeps
    that sum (e.g. two elements swapped). Call `mark_weights_updated()` after such writes, or simply after every
    weight update (RL trainers do): it is exact and free.
    """

    entries: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> WeightsFingerprint:
        parameters = list(model.parameters())
        with torch.no_grad():
            sums = torch.stack([_bit_sum(p) for p in parameters]).tolist() if parameters else []
        return cls(tuple((p.data_ptr(), p._version, total) for p, total in zip(parameters, sums, strict=True)))

    def matches(self, model: torch.nn.Module) -> bool:
        return self == WeightsFingerprint.of(model)


def _bit_sum(parameter: torch.Tensor) -> torch.Tensor:
    """The sum, as int64 on CPU, of the parameter's elements read as integers of their own width (exact: a
    parameter of under 2^31 elements of at most 32 bits cannot overflow it)."""
    data = parameter.detach()
    return data.view(_BITS[data.element_size()]).sum(dtype=torch.int64).cpu()
