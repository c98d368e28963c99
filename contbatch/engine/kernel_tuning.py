"""Choices of the CPU kernels that depend on the machine more than on its instruction set: measured once per built
extension and kept beside the build.

Two kernels prefetch what they read next into L1 (`prefetcht0`) or into L2 (`prefetcht1`), a level set for the
whole process (`KNOBS`):
- the paged attention kernel (`csrc/decode_attention.cpp`), each key and value row some positions before it reads
  it: `set_attention_prefetch(1 | 2)`. On an AVX-512 Zen 4, L2 read 128 requests' cache at 26-32 GB/s against
  17-20 with L1 (its AVX2 build likewise); on the Zen 3 of the early sessions L2 was the slower, and the Zen 5 ran
  near its memory's rate with L1;
- the panel product (`csrc/panel_gemm.cpp`), a task's next panels while its current ones compute:
  `set_panel_prefetch(1 | 2)`. On the Zen 4's AVX-512 build L2 made 30 layers' products 1.25-1.45x faster at 8-32
  rows; its AVX2 build measured either way by row count (docs/performance.md, "a forty-eighth session" and "a
  forty-ninth session").
A prefetch changes no arithmetic, so outputs do not depend on these choices.

`tune(module, directory)` sets each level: its variable (`CONTBATCH_ATTENTION_PREFETCH`, `CONTBATCH_PANEL_PREFETCH`:
"l1" or "l2") where set, else the level stored in `directory`'s `tuning.json` (the extension's build directory: one
per CPU kind and build target), else the faster of its measurement (about 0.3 s each), then stored there;
processes that load a new build together measure one at a time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PREFETCH_ENV = "CONTBATCH_ATTENTION_PREFETCH"
PANEL_PREFETCH_ENV = "CONTBATCH_PANEL_PREFETCH"
TUNING_FILE = "tuning.json"
_LEVELS = {"l1": 1, "l2": 2}
_KV_HEADS, _GROUP, _DIM, _REQUESTS, _CONTEXT = 2, 3, 64, 64, 256
_ROWS, _IN_FEATURES, _OUT_FEATURES = 32, 576, 1536
_MIN_BYTES, _MAX_BYTES = 256 << 20, 512 << 20


@dataclass(frozen=True)
class Knob:
    """One per-machine choice: its name in the tuning file, the variable that forces it, the module's setter, its
    measurement (seconds at each level), and whether it applies to a build (`module` -> bool)."""

    name: str
    env: str
    setter: str
    measure: Callable[[Any], dict[int, float]]
    applies: Callable[[Any], bool]


KNOBS = (
    Knob("attention_prefetch", PREFETCH_ENV, "set_attention_prefetch",
         lambda module: measure_attention_prefetch(module), lambda module: True),
    Knob("panel_prefetch", PANEL_PREFETCH_ENV, "set_panel_prefetch",
         lambda module: measure_panel_prefetch(module), lambda module: bool(module.has_panel_gemm())),
)


def tune(module: Any, directory: Path) -> dict[str, int]:
    """Set each knob's level of `module` (the built kernels) for this process, by the rule of the module's
    docstring; return them by name.

    Raises:
        ValueError: a knob's variable is set to something other than "l1", "l2" or "auto".
    """
    knobs = [knob for knob in KNOBS if knob.applies(module)]
    levels = {knob.name: level for knob in knobs if (level := _forced_level(knob.env)) is not None}
    if any(knob.name not in levels for knob in knobs):
        levels = _stored_levels(directory) | levels
    missing = [knob for knob in knobs if knob.name not in levels]
    if missing:
        with _exclusive(directory):
            levels = _stored_levels(directory) | levels
            levels |= _measure_and_store(module, directory, [knob for knob in missing if knob.name not in levels])
    for knob in knobs:
        getattr(module, knob.setter)(levels[knob.name])
    return {knob.name: levels[knob.name] for knob in knobs}


def _measure_and_store(module: Any, directory: Path, knobs: list[Knob]) -> dict[str, int]:
    measured: dict[str, int] = {}
    seconds: dict[str, dict[int, float]] = {}
    for knob in knobs:
        seconds[knob.name] = knob.measure(module)
        measured[knob.name] = min(seconds[knob.name], key=lambda level: seconds[knob.name][level])
        logger.info("contbatch: %s into L%d (%s)", knob.name, measured[knob.name],
                    ", ".join(f"L{key} {value * 1e3:.1f} ms" for key, value in sorted(seconds[knob.name].items())))
    if knobs:
        _store(directory, measured, seconds)
    return measured


def _forced_level(env: str) -> int | None:
    setting = os.environ.get(env, "auto").strip().lower()
    if setting == "auto":
        return None
    if setting not in _LEVELS:
        raise ValueError(f"{env}={os.environ[env]!r}: expected 'l1', 'l2' or 'auto'")
    return _LEVELS[setting]


def _stored_record(directory: Path) -> dict[str, Any]:
    """The tuning file's record; empty when there is none, or it is unreadable or not a JSON object."""
    try:
        record = json.loads((directory / TUNING_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _stored_levels(directory: Path) -> dict[str, int]:
    """The valid levels in `directory`'s tuning file, by knob name."""
    record = _stored_record(directory)
    return {knob.name: record[knob.name] for knob in KNOBS if record.get(knob.name) in _LEVELS.values()}


def _store(directory: Path, levels: dict[str, int], seconds: dict[str, dict[int, float]]) -> None:
    """Add `levels` and their timings to the tuning file, written whole (a temporary file renamed over it: a
    concurrent reader sees the old or the new); a directory that cannot be written only loses the cache."""
    record = _stored_record(directory)
    record |= levels
    timings = record.get("seconds")
    measured = {name: {f"l{key}": value for key, value in values.items()} for name, values in seconds.items()}
    record["seconds"] = (timings if isinstance(timings, dict) else {}) | measured
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as handle:
            json.dump(record, handle)
        os.replace(handle.name, directory / TUNING_FILE)
    except OSError as error:
        logger.warning("contbatch: could not store the kernel tuning in %s (%s)", directory, error)


@contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """An `flock` on `directory`'s tuning lock while the block runs, so that processes loading a new build together
    measure one at a time (the later ones then find the stored levels) instead of disturbing each other's
    timings; no lock where the directory cannot be written."""
    import fcntl  # POSIX, as the kernels' build lock

    with ExitStack() as stack:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fcntl.flock(stack.enter_context(open(directory / "tuning.flock", "w")), fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def _alternated(set_level: Callable[[int], None], one_pass: Callable[[], object], rounds: int) -> dict[int, float]:
    """The least seconds of `one_pass` at each level, after one untimed pass each (which also commits the data's
    pages), the levels alternated over `rounds` rounds; leaves level 1 set."""
    times: dict[int, list[float]] = {level: [] for level in _LEVELS.values()}
    for level in times:
        set_level(level)
        one_pass()
    for _ in range(rounds):
        for level, measured in times.items():
            set_level(level)
            start = time.perf_counter()
            one_pass()
            measured.append(time.perf_counter() - start)
    set_level(1)
    return {level: min(measured) for level, measured in times.items()}


def measure_attention_prefetch(module: Any, rounds: int = 7) -> dict[int, float]:
    """Seconds of one pass of `module.paged_decode_attention` over a float32 cache and a bfloat16 one, each larger
    than this CPU's caches (`_cache_bytes`: 64 requests x 256 positions a layer, as many layers as it takes), at
    each level (`_alternated`): the kernel reads the two through different code (bfloat16 pairs and AMX tiles where
    the CPU has them), and the faster level for one need not be the faster for the other."""
    query = torch.ones(_REQUESTS, _KV_HEADS * _GROUP, _DIM)
    slots = torch.arange(_REQUESTS * _CONTEXT).view(_REQUESTS, _CONTEXT)
    lengths, first = torch.full((_REQUESTS,), _CONTEXT), torch.zeros(_REQUESTS, dtype=torch.long)
    passes = []
    for dtype in (torch.float32, torch.bfloat16):
        per_layer = 2 * _KV_HEADS * _REQUESTS * _CONTEXT * _DIM * dtype.itemsize
        keys = torch.zeros(math.ceil(_cache_bytes() / per_layer), _KV_HEADS, _REQUESTS * _CONTEXT, _DIM, dtype=dtype)
        passes.append((query.to(dtype), keys, torch.zeros_like(keys)))

    def one_pass() -> None:
        for rows, keys, values in passes:
            for layer in range(keys.shape[0]):
                module.paged_decode_attention(rows, keys[layer], values[layer], slots, lengths, first, _DIM**-0.5,
                                              0.0, 1)

    return _alternated(module.set_attention_prefetch, one_pass, rounds)


def measure_panel_prefetch(module: Any, rounds: int = 7) -> dict[int, float]:
    """Seconds of one pass of `module.panel_linear` at 32 rows (a serving step's) over distinct float32 weights of
    1,536 x 576 whose panels outgrow this CPU's caches (`_cache_bytes`), at each level (`_alternated`)."""
    per_weight = _OUT_FEATURES * _IN_FEATURES * 4
    panels = torch.zeros(math.ceil(_cache_bytes() / per_weight), _OUT_FEATURES // 16, _IN_FEATURES, 16)
    rows = torch.ones(_ROWS, _IN_FEATURES)

    def one_pass() -> None:
        for weight in panels:
            module.panel_linear(rows, weight, _OUT_FEATURES, None)

    return _alternated(module.set_panel_prefetch, one_pass, rounds)


def _cache_bytes() -> int:
    """Four times the size of this CPU's largest cache as sysfs reports it, within 256 and 512 MiB (256 MiB where
    it reports none): on a Zen 4 (32 MiB of L3) a 64 MiB cache, partly served from L3, hid most of the attention
    levels' difference (1.1x, one round of six the other way round), 256 MiB showed it (1.3-1.4x)."""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            largest = max(largest, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return min(max(4 * largest, _MIN_BYTES), _MAX_BYTES)
