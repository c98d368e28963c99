"""`WeightsFingerprint`: tells whether a model's weights changed, so that stale KV is never reused."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class WeightsFingerprint:
    """Per parameter: its storage address, its in-place version counter, and the sum of its elements' bit
    patterns read as integers (modulo 2^32; about 20 ms for 135M parameters on a CPU core).

    What it detects:
      - replacing a parameter or its `.data` (a new storage), optimizer steps, `load_state_dict`, any in-place op
        on the parameter (the version counter);
      - a write through `.data`, `.detach()`, NumPy or any other alias that bypasses the version counter, to any
        number of elements, unless the writes leave that sum unchanged.
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
    """The sum of the parameter's elements read as integers of their own width, modulo 2^32 (or 2^64 for 8-byte
    elements), as a CPU tensor. Exact for what it must catch: changing one element moves the sum by a nonzero
    amount smaller than the modulus."""
    data = parameter.detach()
    bits = data.view(_BITS[data.element_size()])
    return bits.sum(dtype=torch.int64 if data.element_size() == 8 else torch.int32).to(torch.int64).cpu()
