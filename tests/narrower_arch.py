"""Prints the `-march` target one instruction set narrower than this machine's (`CONTBATCH_CPU_ARCH`), so that
`make test` also runs the CPU kernels' paths its native build does not take: `x86-64-v3` (AVX2 + FMA) on an
AVX-512 machine, `x86-64` (no AVX2) on an AVX2 one; nothing on a CPU without AVX2 or not x86 (the native build
then takes the narrowest paths already)."""

from __future__ import annotations

from contbatch.engine.cpu_kernels import _cpu_flags


def narrower_arch(flags: set[str]) -> str:
    """The target for a CPU with these `/proc/cpuinfo` flags ("" for none)."""
    if "avx512f" in flags:
        return "x86-64-v3"
    return "x86-64" if {"avx2", "fma"} <= flags else ""


if __name__ == "__main__":
    print(narrower_arch(set(_cpu_flags().partition(":")[2].split())))
