"""The machine a benchmark ran on, as lines under its tables: a number from these benches means something only
beside the CPU (or GPU) it came from, the instruction sets that CPU has and lacks, the software versions, and the
kernels contbatch built there."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import transformers

from contbatch.engine.cpu_kernels import describe_build, kernel_module
from contbatch.engine.malloc_tuning import describe_malloc

ISA_FLAGS = {
    "x86_64": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx_vnni",
               "amx_tile", "amx_bf16", "amx_int8"),
    "aarch64": ("asimd", "sve", "sve2", "bf16", "i8mm", "sme"),
}
"""By architecture, the `/proc/cpuinfo` flags that decide which of contbatch's and its peers' kernels run: each is
named as present or absent."""


@dataclass(frozen=True)
class CpuInfo:
    """The first processor of `/proc/cpuinfo`: its name (x86's `model name`; Arm's implementer and part), its
    x86 `cpu family` and `model` (None on Arm), and its flags (x86's `flags`, Arm's `Features`)."""

    name: str
    family: str | None
    model: str | None
    flags: frozenset[str]

    @classmethod
    def read(cls, path: str = "/proc/cpuinfo") -> CpuInfo:
        """The CPU of `path`; an unnamed CPU without flags where the file is missing (macOS)."""
        fields: dict[str, str] = {}
        try:
            with open(path) as lines:
                for line in lines:
                    if not line.strip():
                        if fields:
                            break
                        continue
                    key, _, value = line.partition(":")
                    fields.setdefault(key.strip(), value.strip())
        except OSError:
            pass
        name = fields.get("model name") or " ".join(
            f"{key} {fields[key]}" for key in ("CPU implementer", "CPU part") if key in fields) or platform.processor()
        flags = fields.get("flags", fields.get("Features", ""))
        return cls(name or "unknown CPU", fields.get("cpu family"), fields.get("model"), frozenset(flags.split()))


def describe_machine(cpu: CpuInfo | None = None) -> list[str]:
    """The machine lines of a benchmark's output: the CPU with its architecture, family and model, cores and torch
    threads; which of `ISA_FLAGS` it has and lacks, and ATen's vector ISA; torch's, transformers' and contbatch's
    versions; the GPU where torch sees one; contbatch's CPU kernels (`describe_build`) and its malloc
    (`describe_malloc`)."""
    cpu = cpu or CpuInfo.read()
    machine = platform.machine()
    where = ", ".join([machine] + [f"{key} {value}" for key, value in (("cpu family", cpu.family),
                                                                       ("model", cpu.model)) if value is not None])
    lines = [f"machine: {cpu.name} ({where}); {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"]
    known = ISA_FLAGS.get(machine, ())
    if known:
        has = " ".join(flag for flag in known if flag in cpu.flags) or "none"
        lacks = " ".join(flag for flag in known if flag not in cpu.flags) or "none"
        lines.append(f"CPU flags: has {has}; lacks {lacks}; ATen's vector ISA "
                     f"{torch.backends.cpu.get_cpu_capability()}")
    lines.append(f"software: torch {torch.__version__}, transformers {transformers.__version__}, contbatch "
                 f"{contbatch_version()}")
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        lines.append(f"GPU: {torch.cuda.get_device_name(index)} (compute capability "
                     f"{'.'.join(map(str, torch.cuda.get_device_capability(index)))}), CUDA {torch.version.cuda}")
    lines.append(describe_build())
    lines.append(describe_malloc())
    return lines


def load_kernels() -> None:
    """Builds or loads contbatch's CPU kernels, as a bench starts: a build their sources or the paths of those made
    necessary (about a minute on 2 cores) is then never inside a timed pass, as the peers' loads and compiles are
    not."""
    kernel_module()


@functools.cache
def contbatch_version() -> str:
    """The installed version, and the commit of the checkout it runs from where it runs from one ("+" when its
    tracked files have changes), as read at the first call: a bench reads it as it starts (`contbatch bench`), so
    that a commit made while it runs does not name the code it ran."""
    try:
        installed = version("contbatch")
    except PackageNotFoundError:
        installed = "(not installed)"
    package = Path(__file__).resolve().parent.parent
    try:
        top, commit = _git(package, "rev-parse", "--show-toplevel", "HEAD").split()
        if Path(top).resolve() / "contbatch" != package:  # an installed copy inside some other repository
            return installed
        changed = _git(package, "status", "--porcelain", "--untracked-files=no")
    except (OSError, ValueError, subprocess.SubprocessError):
        return installed
    return f"{installed} (commit {commit[:7]}{'+' if changed else ''})"


def _git(directory: Path, *arguments: str) -> str:
    return subprocess.run(["git", "-C", str(directory), *arguments], capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()
