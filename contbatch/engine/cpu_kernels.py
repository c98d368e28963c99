"""contbatch's CPU kernels (paged decode attention, the write of new K/V rows into the cache, greedy argmax, the
linear layers' product over panel-packed weights, the head screen's quantisation and candidates), compiled on first
use with torch's C++ extension builder.

Building needs a C++ compiler and ninja; the result is cached by torch (`TORCH_EXTENSIONS_DIR`, by default
under ~/.cache), so only the first process on a machine pays the build (about 70 s on 2 cores: the kernels' files
include ATen's tensor headers alone, only `bindings.cpp` pybind11's). Where the build fails, or with
`CONTBATCH_CPU_KERNELS=0`, attention falls back to PyTorch's SDPA on gathered K/V and the cache is written with
`index_copy_` (same results, slower), and the linear layers take oneDNN (`packed_weights`).

The build targets this machine's CPU (`-march=native`: AVX2, AVX-512 and AVX512-BF16 paths where it has them).
`CONTBATCH_CPU_ARCH` names another `-march` target instead, for a build that runs on a family of CPUs, or to
check a narrower instruction set's paths on a wider CPU: `x86-64-v3` (AVX2 + FMA, no AVX-512), `x86-64-v4`
(AVX-512 without BF16 or VNNI), `x86-64` (none of them: every kernel's scalar path or fallback).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from contbatch.engine.cpu_features import cpu_has_amx, cpuinfo_line, mkl_is_fast
from contbatch.engine.kernel_tuning import tune
from contbatch.engine.mkl_products import ENV as MKL_ENV

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(sorted(_CSRC.glob("*.cpp")))
_HEADERS = tuple(sorted(_CSRC.glob("*.h")))
PANEL = 16
AMX_BLOCK = 64
ARCH_ENV = "CONTBATCH_CPU_ARCH"

DecodeKernel = Callable[..., torch.Tensor]
_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def paged_decode_kernel() -> DecodeKernel | None:
    """The compiled `paged_decode_attention(query, key_cache, value_cache, slots, lengths, first, scale, softcap,
    queries_per_request, row_requests=None)`: query rows [B * queries_per_request, heads, dim] (any strides but the
    last's), row r attending to positions [first[r], lengths[r]) of its request's slots [B, L] (decode: one query
    per request; prefill: a chunk's causal rows); with `row_requests` ([R] int64) row r is request
    row_requests[r]'s, in any order (a ragged batch: a whole step in one call). Query and cache both float32 or
    both bfloat16, float32 arithmetic.
    None when it is disabled or cannot be built (the reason is logged once)."""
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
    maximum, one for its first index) for float32, bfloat16 or float16 CPU logits when the kernels are built
    (bfloat16 read as it is, float16 widened to float32 first, both exactly), else `torch.argmax`, which takes
    several times as long over a decode step's logits (about 5x in bfloat16). Reading bfloat16 directly skips a
    float32 copy of the logits (25 MB at 128 rows, about 0.4 ms a step)."""
    if logits.device.type == "cpu" and logits.dtype in _ARGMAX_DTYPES and logits.dim() == 2 and logits.shape[1]:
        module = kernel_module()
        if module is not None:
            read = logits if logits.dtype in (torch.float32, torch.bfloat16) else logits.float()
            return module.row_argmax(read.contiguous())
    return logits.argmax(dim=-1)


@functools.cache
def kernel_module() -> Any:
    """The built extension (`paged_decode_attention`, `write_rows`, `row_argmax`, `panel_linear`, `rms_norm`,
    `silu_mul`, `rope`, `screen_quantize`, `screen_tokens`, `has_vnni()`, `draw_rows`, and `parallel_threads()`:
    how many threads its `at::parallel_for` runs on), or None when disabled or not buildable. The prefetch levels
    of its attention kernel and panel product are set for this machine on load (`kernel_tuning.tune`).

    Raises:
        ValueError: `CONTBATCH_ATTENTION_PREFETCH` or `CONTBATCH_PANEL_PREFETCH` has a value other than "l1", "l2"
            or "auto"."""
    if os.environ.get("CONTBATCH_CPU_KERNELS", "1") == "0":
        return None
    name = extension_name()
    try:
        openmp = _openmp_flags()
        module = load_extension(name, _SOURCES, extra_cflags=["-O3", f"-march={target_arch()}", *openmp],
                                extra_ldflags=openmp)
    except Exception as error:  # no compiler, no ninja, no headers: the SDPA path still works
        logger.warning("contbatch: CPU decode kernel unavailable (%s); using SDPA", error)
        return None
    tune(module, build_directory(name))
    return module


def extension_name() -> str:
    """The kernels' extension name: a digest of their sources, this machine's architecture and CPU flags (x86's
    `flags`, Arm's `Features`) and the build's target and OpenMP flags (`-march=native` makes a build valid only on
    this kind of CPU, and a home directory may be shared by machines of several kinds)."""
    sources = b"".join(source.read_bytes() for source in (*_SOURCES, *_HEADERS))
    machine = " ".join([platform.machine(), _cpu_flags(), target_arch(), *_openmp_flags()])
    digest = hashlib.sha256(sources + machine.encode())
    return f"contbatch_paged_decode_{digest.hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    """Where extension `name` is built and cached: torch's place for a CPU build (`TORCH_EXTENSIONS_DIR`, by default
    ~/.cache/torch_extensions/py<version>_cpu/<name>)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    return Path(root) / name


def load_extension(name: str, sources: Sequence[Path], **flags: Any) -> Any:
    """torch's `load` of extension `name`, one process at a time through an `flock` on the build directory, which
    the system releases when its holder dies. torch's own lock is a file that every loading process creates and
    removes, and waits on while it exists: one left by a process killed while loading (a Ray replica killed during
    start-up) made every later process wait forever. Under the flock no other contbatch process is inside `load`,
    so such a file is stale and is removed."""
    import fcntl  # POSIX: where it is missing, so is the kernels' build (`kernel_module` falls back)

    from torch.utils.cpp_extension import load

    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "contbatch.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        return load(name=name, sources=[str(source) for source in sources], build_directory=str(directory),
                    verbose=False, **flags)


DrawRows = Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]


def row_draw_kernel() -> DrawRows | None:
    """The compiled `draw_rows(scores, uniforms) -> [tokens, log_norm]`: for [M, V] float32 contiguous CPU scores
    and [M] float64 uniforms, the token each row draws from softmax over its whole row by the sampler's inverse
    transform (`Sampler._inverse_transform`: blocks of 1,024 tokens summed in float32, running sums in float64),
    and each row's logsumexp; two passes over the scores, no intermediate tensor. None without AVX2 or when the
    kernels are not built."""
    module = kernel_module()
    if module is None or not module.has_draw_rows():
        return None
    return cast(DrawRows, module.draw_rows)


PanelLinear = Callable[[torch.Tensor, torch.Tensor, int, "torch.Tensor | None"], torch.Tensor]


@functools.cache
def panel_gemm() -> PanelLinear | None:
    """The compiled `panel_linear(x, panels, out_features, bias)`: `F.linear(x, weight, bias)` for x [M, K]
    contiguous, float32 or bfloat16, and `panels = pack_panels(weight)` of x's dtype: one float32 FMA chain over k
    per output (bfloat16 operands widened exactly, the result rounded to bfloat16 once), so a row's result does not
    depend on the other rows. None without AVX2 + FMA, when the kernels are not built, or with
    `CONTBATCH_PANEL_GEMM=0`."""
    module = kernel_module()
    if module is None or os.environ.get("CONTBATCH_PANEL_GEMM", "1") == "0" or not module.has_panel_gemm():
        return None
    return module.panel_linear


@functools.cache
def wide_panels() -> bool:
    """Whether `panel_gemm()` is there and runs float32 panels two at a time in AVX-512 registers: on a Zen 5,
    1.1-1.3x oneDNN's prepacked product at 16-128 rows and as fast at 512 (docs/performance.md, "a
    twenty-first session")."""
    module = kernel_module()
    return panel_gemm() is not None and module is not None and bool(module.has_wide_panels())


_BF16_LINE_ORDER = [column for j in range(PANEL // 2) for column in (j, j + PANEL // 2)]


@functools.cache
def pair_panels() -> bool:
    """Whether `panel_gemm()` is there and multiplies bfloat16 panels in k pairs with AVX512-BF16's dot product
    (`pack_panels`' layout for bfloat16 then): on a Zen 5, 1.15x oneDNN's bfloat16 product at 128 rows and
    1.3x at 16-64 (docs/performance.md, "a twenty-second session")."""
    module = kernel_module()
    return panel_gemm() is not None and module is not None and bool(module.has_pair_panels())


@functools.cache
def amx_panels() -> bool:
    """Whether `panel_gemm()` is there and takes bfloat16 weights in AMX blocks (`pack_amx_blocks`) through oneDNN's
    AMX micro-kernel (`amx_gemm.cpp`): the CPU has AMX and the build AVX512-BF16. On an AMX Xeon 1.3-1.6x oneDNN's
    prepacked product at decode sizes (docs/performance.md, "a sixtieth session")."""
    module = kernel_module()
    return (panel_gemm() is not None and module is not None and cpu_has_amx() and bool(module.has_amx_panels()))


def pack_amx_blocks(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 `weight` [N, K] (K even) as the blocks `panel_linear` multiplies on AMX, contiguous:
    [ceil(N / 64), K / 2, 128], block b holding output features 64b .. 64b + 63 (zeros past N), line j each
    feature's k = 2j and 2j + 1 side by side."""
    out_features, in_features = weight.shape
    if in_features % 2:
        raise ValueError(f"AMX blocks need an even number of input features, got {in_features}")
    weight = F.pad(weight, (0, 0, 0, -out_features % AMX_BLOCK))
    count, steps = weight.shape[0] // AMX_BLOCK, in_features // 2
    return weight.reshape(count, AMX_BLOCK, steps, 2).transpose(1, 2).reshape(count, steps, 2 * AMX_BLOCK).contiguous()


def pack_layer(weight: torch.Tensor) -> torch.Tensor:
    """A layer's weight in the layout `panel_linear` takes for it: AMX blocks for bfloat16 where `amx_panels()`,
    else `pack_panels`' panels."""
    return pack_amx_blocks(weight) if weight.dtype == torch.bfloat16 and amx_panels() else pack_panels(weight)


def pack_panels(weight: torch.Tensor, pairs: bool | None = None) -> torch.Tensor:
    """`weight` [N, K] as the panels `panel_linear` reads, contiguous, panel p holding output features 16p .. 16p +
    15 (zeros past N). float32: [ceil(N / 16), K, 16]. bfloat16 in k pairs (`pairs`, by default where
    `pair_panels()`): [ceil(N / 16), ceil(K / 2), 32], line j holding each feature's k = 2j and 2j + 1 side by side
    (a zero past an odd K). Other bfloat16: [ceil(N / 16), K, 16], each line's features in the order 0, 8, 1, 9,
    ..., 7, 15 (the kernel widens them to float32 with a shift and a mask)."""
    out_features, in_features = weight.shape
    weight = F.pad(weight, (0, 0, 0, -out_features % PANEL))
    if weight.dtype == torch.bfloat16 and (pair_panels() if pairs is None else pairs):
        count, steps = weight.shape[0] // PANEL, (in_features + 1) // 2
        weight = F.pad(weight, (0, in_features % 2))
        return weight.reshape(count, PANEL, steps, 2).transpose(1, 2).reshape(count, steps, 2 * PANEL).contiguous()
    panels = weight.reshape(weight.shape[0] // PANEL, PANEL, in_features).transpose(1, 2)
    if weight.dtype == torch.bfloat16:
        panels = panels[..., _BF16_LINE_ORDER]
    return panels.contiguous()


def target_arch() -> str:
    """The `-march` target of the build: `CONTBATCH_CPU_ARCH` (see the module's docstring), else "native"."""
    return os.environ.get(ARCH_ENV, "").strip() or "native"


def _openmp_flags() -> list[str]:
    """`-fopenmp` where ATen parallelises with OpenMP: `at::parallel_for` is inline there, and without the flag
    its `#pragma omp parallel` is dropped and the kernel runs on one thread. The extension then binds to the
    OpenMP runtime torch already loaded (same soname), so there is one thread pool."""
    return ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The line of `cpuinfo` that lists the CPU's instruction-set extensions, "name : ext ext ...": `flags` on x86,
    `Features` on Arm; "" where the file has none or is missing (macOS)."""
    return cpuinfo_line(("flags", "Features"), cpuinfo)


_SCORES = {"tiles": "AMX tiles", "pairs": "AVX512-BF16 pairs", "lanes": "float32 lanes", "scalar": "scalar"}


def describe_build() -> str:
    """The kernels' build on this machine in one line, for a benchmark's notes: its `-march` target, the
    instruction sets of the panel product (and where the products leave it: `packed_weights`), the head screen's,
    how attention computes a bfloat16 cache's scores, and the prefetch levels chosen here. Loads a build that
    exists on disk; never starts one (a process that has not loaded the kernels says so)."""
    name = extension_name()
    built = kernel_module.cache_info().currsize > 0 or (build_directory(name) / f"{name}.so").exists()
    module = kernel_module() if built else None
    if module is None:
        state = "off (CONTBATCH_CPU_KERNELS=0)" if os.environ.get("CONTBATCH_CPU_KERNELS", "1") == "0" else "not built"
        return f"contbatch's CPU kernels: {state}"
    mkl = (", float32 MKL's above LAYER_MAX_ROWS rows" + (", a full step's over MKL's packed copies"
                                                          if os.environ.get(MKL_ENV, "1") != "0" else "")
           if wide_panels() and mkl_is_fast() else "")
    panels = ("none" if panel_gemm() is None else ("AVX-512" if wide_panels() else "AVX2") + mkl
              + (", bfloat16 in pairs (AVX512-BF16)" if pair_panels() and not cpu_has_amx() else ""))
    if cpu_has_amx():
        panels += ("; bfloat16 layers AMX blocks (oneDNN's micro-kernel) up to AMX_MAX_ROWS rows, head oneDNN's"
                   if amx_panels() else "; bfloat16 products oneDNN's (AMX)")
    levels = f"attention L{module.attention_prefetch()}" + (
        f", panels L{module.panel_prefetch()}" if module.has_panel_gemm() else "")
    screen = ("8-bit codes (VNNI)" if module.has_vnni() else
              "7-bit codes" + (", contbatch's AVX2 product" if module.has_screen_product() else ""))
    scores = _SCORES[module.attention_bfloat16_scores()]
    return (f"contbatch's CPU kernels: -march={target_arch()}; panel product {panels}; head screen {screen}; "
            f"bfloat16 attention scores {scores}; prefetch {levels}")
