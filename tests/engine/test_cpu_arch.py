"""The CPU kernels built for another instruction set (`CONTBATCH_CPU_ARCH`): `make test` reruns the kernels'
files with the target one set narrower than the machine's (`tests/narrower_arch.py`), and this file checks that
such a build really took that set's paths."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contbatch.engine import cpu_kernels
from tests.narrower_arch import narrower_arch


def test_target_arch_defaults_to_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_kernels.ARCH_ENV, raising=False)
    assert cpu_kernels.target_arch() == "native"
    monkeypatch.setenv(cpu_kernels.ARCH_ENV, " x86-64-v3 ")
    assert cpu_kernels.target_arch() == "x86-64-v3"


def test_the_narrower_target_of_each_cpu() -> None:
    assert narrower_arch({"avx2", "fma", "avx512f", "avx512_bf16"}) == "x86-64-v3"
    assert narrower_arch({"avx2", "fma"}) == "x86-64"
    assert narrower_arch({"sse4_2"}) == narrower_arch(set()) == ""


def test_the_build_takes_its_targets_paths() -> None:
    """Under `x86-64-v3`: the AVX2 panels, no AVX-512 or AVX512-BF16 ones, the AVX2 draw, no VNNI (so the head
    screen's 7-bit codes); under `x86-64`: neither the panel kernel nor the draw kernel, their callers' other paths
    instead."""
    arch = cpu_kernels.target_arch()
    module = cpu_kernels.kernel_module()
    if arch not in ("x86-64-v3", "x86-64") or module is None:
        pytest.skip(f"the kernels are built for {arch!r}")
    built = (cpu_kernels.panel_gemm() is not None, cpu_kernels.wide_panels(), cpu_kernels.pair_panels(),
             cpu_kernels.row_draw_kernel() is not None, bool(module.has_vnni()))
    assert built == ((True, False, False, True, False) if arch == "x86-64-v3" else (False,) * 5)


def test_a_lock_left_by_a_killed_loader_does_not_stop_the_next(tmp_path: Path) -> None:
    """torch's build lock file, left by a process killed while it loaded the kernels (a Ray replica killed during
    start-up), is removed by the next loader under contbatch's flock instead of being waited on forever."""
    assert cpu_kernels.kernel_module() is not None
    lock = cpu_kernels.build_directory(cpu_kernels.extension_name()) / "lock"
    lock.touch()
    os.utime(lock, (0, 0))  # stale: a lock another test process's loader holds meanwhile is a new file, of now
    done = subprocess.run([sys.executable, "-c", "from contbatch.engine.cpu_kernels import kernel_module\n"
                           "assert kernel_module() is not None"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert not lock.exists() or lock.stat().st_mtime > 0


_ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm sve bf16
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


def test_the_cpu_flags_line_of_x86_and_arm(tmp_path: Path) -> None:
    """The line that names the instruction-set extensions: x86's `flags`, Arm's `Features` (a Graviton 3's
    here); none on a system without /proc/cpuinfo."""
    arm, x86 = tmp_path / "arm", tmp_path / "x86"
    arm.write_text(_ARM_CPUINFO)
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma avx512f\nbugs\t\t: sysret\n")
    assert cpu_kernels._cpu_flags(str(arm)).partition(":")[2].split()[-2:] == ["sve", "bf16"]
    assert cpu_kernels._cpu_flags(str(x86)).partition(":")[2].split() == ["fpu", "avx2", "fma", "avx512f"]
    assert cpu_kernels._cpu_flags(str(tmp_path / "missing")) == ""


def test_a_build_is_named_for_its_cpu_and_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two machines that share a home directory (its build cache) get builds of different names when their CPU
    flags or their architectures differ: a `-march=native` build must not run on another kind of CPU."""
    names = set()
    for machine, flags in (("aarch64", "Features : fp asimd"), ("aarch64", "Features : fp asimd sve bf16"),
                           ("x86_64", "Features : fp asimd")):
        monkeypatch.setattr(cpu_kernels.platform, "machine", lambda machine=machine: machine)
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda flags=flags: flags)
        names.add(cpu_kernels.extension_name())
    assert len(names) == 3
