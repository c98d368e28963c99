"""A reused per-thread buffer for the output head's products on CPU.

The head's output is [rows, vocab]: in float32, 78 MB for 128 rows of a 151,936-token vocabulary (Qwen2) and 100
MB for 512 rows of the embedded model's 49,152 (a prompt-logprobs step). Above 32 MiB, glibc's largest mmap
threshold on 64-bit, every allocation is a fresh mapping, and the first write to each of its pages faults: 19,000
faults a step for the first, which made decode steps of a Qwen2-0.5B-shaped model 5% slower (docs/performance.md,
"a thirty-second session"). A product that large goes instead into this thread's buffer, which the next one on
the thread overwrites.

Two users of the "head" slot: the head screen's int8 product, consumed inside the screen (`buffer`), and the head's
logits, which may go there only inside `reusing_logits` (the engine's eager steps, whose logits `sample` consumes
before the thread's next forward: `logits_buffer`). Prompt logprobs' `log_softmax` blocks, each consumed before
the next, take the "log_softmax" slot, since the logits they read may be in the "head" one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

REUSED_OUTPUT_BYTES = 32 << 20
"""glibc's largest mmap threshold on 64-bit: an allocation above it is always a fresh mapping."""
_local = threading.local()
_ABSENT = object()


def buffer(rows: int, cols: int, dtype: torch.dtype = torch.float32, slot: str = "head") -> torch.Tensor | None:
    """This thread's [rows, cols] buffer of `dtype` in `slot` (uninitialised, contiguous) when that is larger than
    `REUSED_OUTPUT_BYTES`, else None. The next `buffer` of the slot on the thread (`logits_buffer` is the "head"
    slot's) may overwrite it; another slot's never does."""
    nbytes = rows * cols * dtype.itemsize
    if nbytes <= REUSED_OUTPUT_BYTES:
        return None
    storages: dict[str, torch.Tensor] = _local.__dict__.setdefault("storages", {})
    storage = storages.get(slot)
    if storage is None or storage.numel() < nbytes:
        storage = storages[slot] = torch.empty(nbytes, dtype=torch.uint8)
    return storage[:nbytes].view(dtype).view(rows, cols)


@contextmanager
def thread_value(local: threading.local, name: str, value: object) -> Iterator[None]:
    """Within the block, `local.name` is `value` on this thread; afterwards what it was (its absence included)."""
    previous = getattr(local, name, _ABSENT)
    setattr(local, name, value)
    try:
        yield
    finally:
        if previous is _ABSENT:
            delattr(local, name)
        else:
            setattr(local, name, previous)


def reusing_logits(enabled: bool = True) -> AbstractContextManager[None]:
    """Within the block (when `enabled`), the head's logits on this thread may go into its buffer
    (`logits_buffer`): the caller consumes them before the thread's next forward and keeps no reference."""
    return thread_value(_local, "logits", enabled)


def logits_buffer(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
    """`buffer(rows, cols, dtype)` inside `reusing_logits`, else None."""
    return buffer(rows, cols, dtype) if getattr(_local, "logits", False) else None
