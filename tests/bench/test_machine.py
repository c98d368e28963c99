"""The machine lines under every benchmark's tables (`contbatch.bench.machine`)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from contbatch.bench import machine
from contbatch.bench.machine import CpuInfo, describe_machine
from contbatch.cli import bench as bench_cli
from contbatch.cli import main
from contbatch.data.embedded import embedded_model_dir
from contbatch.engine import cpu_features, cpu_kernels, malloc_tuning
from contbatch.engine.malloc_tuning import describe_malloc

_X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni

processor\t: 1
model name\t: another CPU
flags\t\t: fpu
"""

_ARM = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes sve bf16 i8mm
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


def test_the_first_processor_of_x86_and_arm_cpuinfo(tmp_path: Path) -> None:
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text(_X86)
    arm.write_text(_ARM)
    assert CpuInfo.read(str(x86)) == CpuInfo("AMD EPYC 9R14 96-Core Processor", "25", "17", frozenset(
        ["fpu", "sse2", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"]))
    assert CpuInfo.read(str(arm)) == CpuInfo("CPU implementer 0x41 CPU part 0xd40", None, None,
                                             frozenset(["fp", "asimd", "evtstrm", "aes", "sve", "bf16", "i8mm"]))
    assert CpuInfo.read(str(tmp_path / "missing")).flags == frozenset()


def test_the_lines_name_the_flags_the_cpu_has_and_lacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text(_X86)
    arm.write_text(_ARM)
    monkeypatch.setattr(machine.platform, "machine", lambda: "x86_64")
    lines = describe_machine(CpuInfo.read(str(x86)))
    assert lines[0].startswith("machine: AMD EPYC 9R14 96-Core Processor (x86_64, cpu family 25, model 17); ")
    assert lines[1].startswith("CPU flags: has avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni; "
                               "lacks avx_vnni amx_tile amx_bf16 amx_int8; ATen's vector ISA ")
    assert lines[2].startswith(f"software: torch {torch.__version__}, transformers ")
    assert lines[-2:] == [cpu_kernels.describe_build(), describe_malloc()]
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    lines = describe_machine(CpuInfo.read(str(arm)))
    assert lines[0].startswith("machine: CPU implementer 0x41 CPU part 0xd40 (aarch64); ")
    assert lines[1].startswith("CPU flags: has asimd sve bf16 i8mm; lacks sve2 sme; ")


def test_the_kernels_line_reads_the_build_and_never_starts_one(monkeypatch: pytest.MonkeyPatch) -> None:
    module = cpu_kernels.kernel_module()
    if module is None:
        pytest.skip("the CPU kernels are not built here")
    line = cpu_kernels.describe_build()
    assert f"-march={cpu_kernels.target_arch()}; " in line
    assert f"prefetch attention L{module.attention_prefetch()}" in line
    assert ("panel product AVX-512" in line) == cpu_kernels.wide_panels()
    assert ("bfloat16 layers AMX blocks" in line) == (cpu_features.cpu_has_amx() and cpu_kernels.amx_panels())
    assert ("bfloat16 products oneDNN's (AMX)" in line) == (cpu_features.cpu_has_amx() and not cpu_kernels.amx_panels())
    assert ("bfloat16 attention scores AMX tiles" in line) == (module.attention_bfloat16_scores() == "tiles")
    assert ("MKL's above" in line) == (cpu_kernels.wide_panels() and cpu_features.mkl_is_fast())
    assert ("MKL's packed copies" in line) == ("MKL's above" in line)
    monkeypatch.setenv("CONTBATCH_MKL_PACKED", "0")
    assert "MKL's packed copies" not in cpu_kernels.describe_build()

    @functools.cache
    def never_loaded() -> None:
        raise AssertionError("describe_build started a build")

    monkeypatch.setattr(cpu_kernels, "kernel_module", never_loaded)
    monkeypatch.setattr(cpu_kernels, "extension_name", lambda: "contbatch_paged_decode_never_built")
    assert cpu_kernels.describe_build() == "contbatch's CPU kernels: not built"


def test_contbatch_bench_writes_the_machine_under_its_table(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    table = tmp_path / "table.md"
    assert main(["bench", "--engines", "contbatch", "--model", str(directory), "--num-prompts", "2",
                 "--max-new-tokens", "4", "--no-warm-pass", "--output", str(table)]) == 0
    text = table.read_text()
    assert text.index("| contbatch |") < text.index("\nmachine: ") < text.index("\nsoftware: torch ")
    assert text.rstrip().endswith(f"{cpu_kernels.describe_build()}\n{describe_malloc()}")


def test_the_malloc_line_says_whether_engines_tune_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc_tuning.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert describe_malloc().startswith("malloc: glibc's, tuned by contbatch (mmap threshold 32 MiB")
    monkeypatch.setenv("CONTBATCH_MALLOC_TUNING", "0")
    assert describe_malloc() == "malloc: the C library's defaults (CONTBATCH_MALLOC_TUNING=0)"
    monkeypatch.delenv("CONTBATCH_MALLOC_TUNING")
    monkeypatch.setenv("LD_PRELOAD", "/opt/venv/lib/libiomp5.so:/usr/lib/libtcmalloc_minimal.so.4")
    assert describe_malloc() == "malloc: libtcmalloc_minimal.so.4 (LD_PRELOAD), which glibc's settings do not reach"
    monkeypatch.setattr(malloc_tuning.platform, "libc_ver", lambda: ("", ""))
    assert describe_malloc() == "malloc: the C library's defaults (not glibc)"


def test_the_commit_named_is_the_one_read_when_the_bench_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit made while a bench runs must not name the code it ran: the version is read once, at the start."""
    package = Path(machine.__file__).resolve().parent.parent
    heads = iter(["1111111aaaa", "2222222bbbb"])

    def git(directory: Path, *arguments: str) -> str:
        return f"{package.parent} {next(heads)}" if arguments[0] == "rev-parse" else ""

    monkeypatch.setattr(machine, "_git", git)
    machine.contbatch_version.cache_clear()
    try:
        assert machine.contbatch_version().endswith("(commit 1111111)")
        assert "(commit 1111111)" in describe_machine()[2], "read again after the start"
    finally:
        machine.contbatch_version.cache_clear()


def test_the_bench_loads_the_kernels_before_any_workload_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel build (a minute when the sources or their paths changed) must not fall inside a timed pass: the
    workload starts only after the kernels are loaded."""
    calls: list[str] = []
    monkeypatch.setattr(machine, "load_kernels", lambda: calls.append("kernels"))
    monkeypatch.setattr(bench_cli, "_run_bench", lambda args: calls.append("workload") or 0)
    monkeypatch.setattr(bench_cli, "_note_machine", lambda output: None)
    assert main(["bench", "--engines", "contbatch"]) == 0
    assert calls == ["kernels", "workload"]
