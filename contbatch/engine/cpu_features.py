"""What the CPU offers the products of contbatch's forwards: the instruction sets ATen and oneDNN run, and whose
MKL build runs fast (`packed_weights` picks each layer's product from them)."""

from __future__ import annotations

import functools

import torch


def cpuinfo_line(names: tuple[str, ...], cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first line of `cpuinfo` whose key ("key : value") is one of `names`, as it stands; "" where the file has
    none or is missing (macOS)."""
    try:
        with open(cpuinfo) as lines:
            return next((line for line in lines if line.split(":")[0].strip() in names), "")
    except OSError:
        return ""


@functools.cache
def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """x86's `vendor_id` in `cpuinfo` ("GenuineIntel", "AuthenticAMD"); "" where it names none (Arm, macOS)."""
    return cpuinfo_line(("vendor_id",), cpuinfo).partition(":")[2].strip()


@functools.cache
def cpu_has_avx512() -> bool:
    """Whether ATen (and so oneDNN) runs AVX-512 code on this CPU: there oneDNN's float32 product over a prepacked
    weight runs at about twice the panel kernel's AVX2 rate at every row count, and MKL's `F.linear` well below
    both on AMD CPUs (docs/performance.md, "a sixteenth session")."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def mkl_is_fast() -> bool:
    """Whether MKL's float32 `F.linear` takes its fast paths: on an Intel CPU. On a Xeon with AVX-512 it ran 1.1-1.2x
    the panel kernel at 512-2048 rows (as fast at 256) and 1.05-1.1x oneDNN over the plain weight; on AMD EPYCs
    2-3x below oneDNN (docs/performance.md, "a fifty-seventh session")."""
    return cpu_vendor() == "GenuineIntel"


@functools.cache
def cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles (oneDNN's bfloat16 products use them)."""
    is_supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_supported()) if is_supported is not None else False


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether oneDNN has bfloat16 arithmetic on this CPU (AVX512-BF16, AMX), where torch's bfloat16 products are
    fast."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
