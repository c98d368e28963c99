"""contbatch's CPU kernels (paged decode attention, the write of new K/V rows into the cache, greedy argmax),
compiled on first use with torch's C++ extension builder.

Building needs a C++ compiler and ninja; the result is cached by torch (`TORCH_EXTENSIONS_DIR`, by default
under ~/.cache), so only the first process on a machine pays the ~20 s build. Where the build fails, or with
`CONTBATCH_CPU_KERNELS=0`, attention falls back to PyTorch's SDPA on gathered K/V and the cache is written with
`index_copy_` (same results, slower).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"

DecodeKernel = Callable[..., torch.Tensor]


def paged_decode_kernel() -> DecodeKernel | None:
    """The compiled `paged_decode_attention(query, key_cache, value_cache, slots, lengths, first, scale, softcap)`,
    or None when it is disabled or cannot be built (the reason is logged once)."""
    module = kernel_module()
    return None if module is None else module.paged_decode_attention


def kv_row_writer() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """The compiled `write_rows(cache, rows, slots)`: cache [heads, slots, dim] contiguous, rows [heads, tokens,
    dim] of the cache's dtype with a contiguous last dim, slots [tokens] int64; stores `rows[:, t]` at
    `cache[:, slots[t]]` as `cache.index_copy_(1, slots, rows)` does (no read of the lines it overwrites). None
    when the kernels are disabled or cannot be built."""
    module = kernel_module()
    return None if module is None else module.write_rows


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for [N, vocab] logits: through the kernels' `row_argmax` (one vectorised pass for the
    maximum, one for its first index) for contiguous float32 CPU logits when the kernels are built, else
    `torch.argmax`, which takes several times as long over a decode step's logits."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1]:
        module = kernel_module()
        if module is not None:
            return module.row_argmax(logits.contiguous())
    return logits.argmax(dim=-1)


@functools.cache
def kernel_module() -> Any:
    """The built extension (`paged_decode_attention`, `write_rows`, `row_argmax`, and `parallel_threads()`: how
    many threads its `at::parallel_for` runs on), or None when disabled or not buildable."""
    if os.environ.get("CONTBATCH_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        # -march=native: the build is only valid on this kind of CPU, so its flags are part of the name.
        openmp = _openmp_flags()
        digest = hashlib.sha256(_SOURCE.read_bytes() + _cpu_flags().encode() + " ".join(openmp).encode())
        module = load(
            name=f"contbatch_paged_decode_{digest.hexdigest()[:12]}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", *openmp],
            extra_ldflags=openmp,
            verbose=False,
        )
    except Exception as error:  # no compiler, no ninja, no headers: the SDPA path still works
        logger.warning("contbatch: CPU decode kernel unavailable (%s); using SDPA", error)
        return None
    return module


def _openmp_flags() -> list[str]:
    """`-fopenmp` where ATen parallelises with OpenMP: `at::parallel_for` is inline there, and without the flag
    its `#pragma omp parallel` is dropped and the kernel runs on one thread. The extension then binds to the
    OpenMP runtime torch already loaded (same soname), so there is one thread pool."""
    return ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""
