"""The OpenMP thread pools of the runtime torch computes with on a CPU, and how the engine keeps them out of its way.

An OpenMP runtime keeps a pool of worker threads for every thread that has run a parallel region, for as long as
that thread lives. GNU OpenMP (libgomp, torch's Linux wheels) lets its workers spin between parallel regions only
while all the process's pools together hold no more threads than the machine has CPUs; past that a worker sleeps
almost at once, and the next parallel region waits until it is woken (libgomp's "throttled" spin). A decode step
runs hundreds of short parallel regions, so a single idle pool elsewhere in the process, the one a user's main
thread keeps after one matrix product, made the engine thread's 128-prompt run 15-30% slower on 2 cores
(docs/performance.md, "a forty-third session").

contbatch computes on one thread, the engine thread, while the threads that hand it requests wait. So a thread
that hands the engine requests gives its own pool back (`EngineLoop.submit`), and the engine thread gives its pool
back when it goes idle, before the caller computes again (training between generations, say), and so does async
batching's forward thread (`LLMEngine.release_thread_pools`). A pool given back
is made again, in microseconds, by that thread's next parallel region; the results are the same either way.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1
"""`omp_pause_soft` of OpenMP 5.0's `omp_pause_resource_t`."""
_RUNTIME_NAME = "libgomp"
"""Only GNU OpenMP's pools are given back: its `omp_pause_resource_all` ends the calling thread's pool alone, where
Intel's and LLVM's runtimes pause process-wide (and their idle workers sleep after a block time instead)."""


def release_thread_pool() -> bool:
    """Ends the calling thread's OpenMP worker threads (OpenMP 5.0's `omp_pause_resource_all(omp_pause_soft)`
    in the libgomp torch loaded). Other threads' pools and parallel regions are not touched. Returns whether the
    runtime did so (or had nothing to end); False where torch does not parallelise with OpenMP, no libgomp with
    that function is loaded, or the caller is inside a parallel region. Costs about a microsecond when the
    thread holds no pool."""
    pause = _pause_function()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


@functools.cache
def _pause_function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    for path in loaded_runtimes():
        try:
            pause = ctypes.CDLL(str(path)).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    logger.info("no loaded libgomp has omp_pause_resource_all: idle OpenMP thread pools are kept")
    return None


def loaded_runtimes() -> list[Path]:
    """The GNU OpenMP runtimes mapped into this process (Linux's `/proc/self/maps`), torch's own first (its
    `lib` directory); empty where the map cannot be read."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return []
    paths = {Path(parts[5].strip()) for parts in fields if len(parts) == 6 and parts[5].startswith("/")}
    runtimes = [path for path in paths if path.name.startswith(_RUNTIME_NAME) and ".so" in path.name]
    torch_lib = Path(torch.__file__).parent / "lib"
    return sorted(runtimes, key=lambda path: (path.parent != torch_lib, str(path)))
