"""Choices of the CPU kernels that depend on the machine more than on its instruction set: measured once per built
extension and kept beside the build.

The paged attention kernel (`csrc/decode_attention.cpp`) prefetches each key and value row some positions before it
reads it, into L1 (`prefetcht0`) or into L2 (`prefetcht1`): `set_attention_prefetch(1 | 2)`, for the whole
process. Which streams the cache faster depends on the CPU. On an AVX-512 Zen 4, L2 read 128 requests' cache at
26-32 GB/s against 17-20 GB/s with L1 (its AVX2 build likewise); on the Zen 3 of the early sessions L2 was the
slower, and the Zen 5 ran near its memory's rate with L1 (docs/performance.md, "a forty-ninth session"). A
prefetch changes no arithmetic, so outputs do not depend on the choice.

`tune(module, directory)` sets the level: `CONTBATCH_ATTENTION_PREFETCH` ("l1" or "l2") where set, else the level
stored in `directory`'s `tuning.json` (the extension's build directory: one per CPU kind and build target), else
the faster of `measure_attention_prefetch` (about 0.3 s), which is then stored there; processes that load a new
build together measure one at a time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PREFETCH_ENV = "CONTBATCH_ATTENTION_PREFETCH"
TUNING_FILE = "tuning.json"
_LEVELS = {"l1": 1, "l2": 2}
_KV_HEADS, _GROUP, _DIM, _REQUESTS, _CONTEXT = 2, 3, 64, 64, 256
_MIN_BYTES, _MAX_BYTES = 256 << 20, 512 << 20


def tune(module: Any, directory: Path) -> int:
    """Set the attention kernel's prefetch level of `module` (the built kernels) for this process, by the rule of
    the module's docstring; return it.

    Raises:
        ValueError: `CONTBATCH_ATTENTION_PREFETCH` is set to something other than "l1", "l2" or "auto".
    """
    level = _forced_level() or _stored_level(directory)
    if level is None:
        with _exclusive(directory):
            level = _stored_level(directory) or _measure_and_store(module, directory)
    module.set_attention_prefetch(level)
    return level


def _measure_and_store(module: Any, directory: Path) -> int:
    seconds = measure_attention_prefetch(module)
    level = min(seconds, key=lambda candidate: seconds[candidate])
    _store(directory, level, seconds)
    logger.info("contbatch: attention prefetch into L%d (%s)", level,
                ", ".join(f"L{key} {value * 1e3:.1f} ms" for key, value in sorted(seconds.items())))
    return level


@contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """An `flock` on `directory`'s tuning lock while the block runs, so that processes loading a new build together
    measure one at a time (the later ones then find the stored level) instead of disturbing each other's timings;
    no lock where the directory cannot be written."""
    import fcntl  # POSIX, as the kernels' build lock

    with ExitStack() as stack:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fcntl.flock(stack.enter_context(open(directory / "tuning.flock", "w")), fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def _forced_level() -> int | None:
    setting = os.environ.get(PREFETCH_ENV, "auto").strip().lower()
    if setting == "auto":
        return None
    if setting not in _LEVELS:
        raise ValueError(f"{PREFETCH_ENV}={os.environ[PREFETCH_ENV]!r}: expected 'l1', 'l2' or 'auto'")
    return _LEVELS[setting]


def _stored_level(directory: Path) -> int | None:
    """The level in `directory`'s tuning file; None when there is none, or it is unreadable or holds no level."""
    try:
        level = json.loads((directory / TUNING_FILE).read_text()).get("attention_prefetch")
    except (OSError, ValueError, AttributeError):
        return None
    return level if level in _LEVELS.values() else None


def _store(directory: Path, level: int, seconds: dict[int, float]) -> None:
    """Write the tuning file whole (a temporary file renamed over it: a concurrent reader sees the old or the new);
    a directory that cannot be written only loses the cache."""
    record = {"attention_prefetch": level, "seconds": {f"l{key}": value for key, value in seconds.items()}}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as handle:
            json.dump(record, handle)
        os.replace(handle.name, directory / TUNING_FILE)
    except OSError as error:
        logger.warning("contbatch: could not store the kernel tuning in %s (%s)", directory, error)


def measure_attention_prefetch(module: Any, rounds: int = 7) -> dict[int, float]:
    """The least seconds of one pass of `module.paged_decode_attention` over a float32 cache larger than this
    CPU's last-level cache (`_cache_bytes`: 64 requests x 256 positions a layer, as many layers as it takes), at
    each prefetch level, the levels alternated over `rounds` rounds after one untimed pass each (which also
    commits the cache's pages). Leaves the module at level 1."""
    per_layer = 2 * _KV_HEADS * _REQUESTS * _CONTEXT * _DIM * 4
    layers = math.ceil(_cache_bytes() / per_layer)
    keys = torch.zeros(layers, _KV_HEADS, _REQUESTS * _CONTEXT, _DIM)
    values = torch.zeros_like(keys)
    query = torch.ones(_REQUESTS, _KV_HEADS * _GROUP, _DIM)
    slots = torch.arange(_REQUESTS * _CONTEXT).view(_REQUESTS, _CONTEXT)
    lengths, first = torch.full((_REQUESTS,), _CONTEXT), torch.zeros(_REQUESTS, dtype=torch.long)

    def one_pass(level: int) -> float:
        module.set_attention_prefetch(level)
        start = time.perf_counter()
        for layer in range(layers):
            module.paged_decode_attention(query, keys[layer], values[layer], slots, lengths, first, _DIM**-0.5, 0.0, 1)
        return time.perf_counter() - start

    times: dict[int, list[float]] = {level: [] for level in _LEVELS.values()}
    for level in times:
        one_pass(level)
    for _ in range(rounds):
        for level, measured in times.items():
            measured.append(one_pass(level))
    module.set_attention_prefetch(1)
    return {level: min(measured) for level, measured in times.items()}


def _cache_bytes() -> int:
    """Four times the size of this CPU's largest cache as sysfs reports it, within 256 and 512 MiB (256 MiB where
    it reports none): on a Zen 4 (32 MiB of L3) a 64 MiB cache, partly served from L3, hid most of the levels'
    difference (1.1x, one round of six the other way round), 256 MiB showed it (1.3-1.4x)."""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            largest = max(largest, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return min(max(4 * largest, _MIN_BYTES), _MAX_BYTES)
