"""glibc malloc kept from handing a step's memory back to the kernel, for engines that compute on the CPU.

A decode step allocates and frees hundreds of tensors of 0.1-10 MB (a layer's activations, its attention output).
With glibc's defaults, blocks above the mmap threshold (128 KiB, raised as large blocks are freed) are mapped and
unmapped one by one, and the free memory at the top of the heap is trimmed back as soon as it passes twice that
threshold; the next step's tensors then fault their pages in again, and a page fault under a hypervisor costs
microseconds. On a 2-core Intel Xeon (AMX) the bfloat16 128-prompt GSM8K run's steps took 16.8-17.0 s instead of
19.3 s with the settings below, and 18.4 s instead of 19.6 s later on the same host, its products and its attention
both faster (docs/performance.md, "a fifty-eighth session"). vLLM's CPU backend preloads tcmalloc where its
package bundles one (the PyPI wheel of vLLM 0.32 does not, and with Debian's tcmalloc preloaded its run measured
the same).

`tune_malloc` sets, once a process, an mmap threshold of 32 MiB (glibc's largest), a top pad of 256 MiB (taken
from the kernel at a time, and kept when the heap is trimmed) and a trim threshold of 1 GiB. Memory the process
freed then stays with the process, up to its heap's high-water mark: that run's peak resident memory was 1.87 GB
tuned and 1.94 GB untuned. `CONTBATCH_MALLOC_TUNING=0` leaves malloc as it is; so does a C library other than
glibc.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from pathlib import Path

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
"""`mallopt` parameters, from glibc's malloc.h."""
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TOP_PAD, 256 << 20), (M_TRIM_THRESHOLD, 1 << 30))
"""What `tune_malloc` sets, in this order."""
ENV = "CONTBATCH_MALLOC_TUNING"
_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
"""Allocators a process may preload in glibc malloc's place."""


def _untuned_because() -> str | None:
    """Why `tune_malloc` leaves malloc alone in this process ("CONTBATCH_MALLOC_TUNING=0", "not glibc"), or None."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    return None if platform.libc_ver()[0] == "glibc" else "not glibc"


@functools.cache
def tune_malloc() -> bool:
    """Sets glibc malloc's `SETTINGS` for this process, once; later calls return the first call's result. True
    where every setting was accepted; False where `CONTBATCH_MALLOC_TUNING=0`, the C library is not glibc, or
    `mallopt` refused one (logged)."""
    if _untuned_because() is not None:
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    refused = [param for param, value in SETTINGS if mallopt(param, value) != 1]
    if refused:
        logger.warning("glibc mallopt refused parameters %s; malloc keeps its defaults for them", refused)
    return not refused


def describe_malloc() -> str:
    """One line for a benchmark's notes: whether a CPU engine in this process tunes malloc (`tune_malloc`), and to
    what, or which allocator `LD_PRELOAD` put in glibc's place."""
    reason = _untuned_because()
    if reason is not None:
        return f"malloc: the C library's defaults ({reason})"
    preloaded = [Path(entry).name for entry in os.environ.get("LD_PRELOAD", "").split(":")
                 if any(name in Path(entry).name for name in _ALLOCATORS)]
    if preloaded:
        return f"malloc: {preloaded[0]} (LD_PRELOAD), which glibc's settings do not reach"
    return "malloc: glibc's, tuned by contbatch (mmap threshold 32 MiB, top pad 256 MiB, trim threshold 1 GiB)"
