"""glibc malloc tuned for the engine: a 24 MB block comes from the heap and stays with the process once freed,
where glibc's defaults map it and unmap it; `CONTBATCH_MALLOC_TUNING=0` leaves the defaults; a CPU engine tunes."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from contbatch.engine import engine as engine_module
from tests.helpers import make_engine, tiny_model

_LIBC, _VERSION = platform.libc_ver()
pytestmark = pytest.mark.skipif(_LIBC != "glibc" or tuple(map(int, _VERSION.split(".")[:2])) < (2, 33),
                                reason="mallopt is glibc's, mallinfo2 glibc 2.33's")

_PROBE = """
import ctypes, json
from contbatch.engine.malloc_tuning import tune_malloc
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
tuned = tune_malloc()
mapped = libc.mallinfo2().hblks
block = libc.malloc(24 << 20)
mapped = libc.mallinfo2().hblks - mapped
libc.free(block)
print(json.dumps({"tuned": tuned, "mapped": mapped, "free_in_heap": libc.mallinfo2().fordblks}))
"""


def probe(setting: str | None) -> dict[str, int]:
    """What `_PROBE` reports in a fresh interpreter, with `CONTBATCH_MALLOC_TUNING` set to `setting` (or unset)."""
    env = {key: value for key, value in os.environ.items() if key != "CONTBATCH_MALLOC_TUNING"}
    if setting is not None:
        env["CONTBATCH_MALLOC_TUNING"] = setting
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tuned_malloc_keeps_a_step_sized_block_in_the_heap() -> None:
    tuned = probe(None)
    assert tuned["tuned"] is True
    assert tuned["mapped"] == 0
    assert tuned["free_in_heap"] >= 24 << 20


def test_opting_out_leaves_glibcs_defaults() -> None:
    untuned = probe("0")
    assert untuned["tuned"] is False
    assert untuned["mapped"] == 1


def test_a_cpu_engine_tunes_malloc(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(engine_module, "tune_malloc", lambda: calls.append(True) or True)
    make_engine(tiny_model("llama", "cpu"), num_blocks=16).close()
    assert calls == [True]
