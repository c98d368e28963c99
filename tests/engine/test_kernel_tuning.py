"""The CPU kernels' per-machine tuning (`kernel_tuning`): the attention kernel and the panel product compute the same
at either prefetch level, the levels are measured once and kept beside the build, and their variables override
them."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from contbatch.engine import kernel_tuning
from contbatch.engine.cpu_kernels import build_directory, extension_name, kernel_module, pack_panels, pair_panels
from contbatch.engine.kernel_tuning import (
    PANEL_PREFETCH_ENV,
    PREFETCH_ENV,
    TUNING_FILE,
    measure_attention_prefetch,
    measure_panel_prefetch,
    tune,
)

BLOCK = 16
ENVS = (PREFETCH_ENV, PANEL_PREFETCH_ENV)


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The built kernels (with the panel product), their levels restored after the test; the variables unset."""
    built = kernel_module()
    if built is None or not built.has_panel_gemm():
        pytest.skip("the CPU kernels (with the panel product) are not built")
    for env in ENVS:
        monkeypatch.delenv(env, raising=False)
    levels = built.attention_prefetch(), built.panel_prefetch()
    yield built
    built.set_attention_prefetch(levels[0])
    built.set_panel_prefetch(levels[1])


def _fake_measurements(monkeypatch: pytest.MonkeyPatch, attention: dict[int, float],
                       panels: dict[int, float]) -> list[str]:
    """Replace both measurements by fixed timings; returns the list of the measurements made, by name."""
    made: list[str] = []

    def measuring(name: str, seconds: dict[int, float]) -> Any:
        return lambda built: made.append(name) or seconds

    monkeypatch.setattr(kernel_tuning, "measure_attention_prefetch", measuring("attention", attention))
    monkeypatch.setattr(kernel_tuning, "measure_panel_prefetch", measuring("panels", panels))
    return made


@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(3, 3, 64), (1, 5, 40), (2, 2, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_attention_levels_compute_the_same(module: Any, kv_heads: int, group: int, dim: int,
                                                dtype: torch.dtype) -> None:
    """Decode rows over scattered blocks, on the 16-lane (where built), 8-lane and scalar paths: bit for bit the
    same output at either level; a level other than 1 or 2 is refused, naming it."""
    generator = torch.Generator().manual_seed(dim)
    keys = torch.randn(kv_heads, 64 * BLOCK, dim, generator=generator).to(dtype)
    values = torch.randn(kv_heads, 64 * BLOCK, dim, generator=generator).to(dtype)
    tables = torch.stack([torch.randperm(64, generator=generator)[:12] for _ in range(6)])
    positions = torch.arange(12 * BLOCK)
    slots = (tables[:, positions // BLOCK] * BLOCK + positions % BLOCK).contiguous()
    lengths, first = torch.tensor([1, 17, 40, 100, 150, 192]), torch.tensor([0, 0, 5, 0, 90, 0])
    query = torch.randn(6, kv_heads * group, dim, generator=generator).to(dtype)
    outputs = []
    for level in (1, 2):
        module.set_attention_prefetch(level)
        assert module.attention_prefetch() == level
        outputs.append(module.paged_decode_attention(query, keys, values, slots, lengths, first, dim**-0.5, 0.0, 1))
    assert torch.equal(outputs[0], outputs[1])
    with pytest.raises(RuntimeError, match="got 3"):
        module.set_attention_prefetch(3)


@pytest.mark.parametrize("rows", [1, 7, 32, 130])
@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_panel_levels_compute_the_same(module: Any, rows: int, pairs: bool, dtype: torch.dtype) -> None:
    """Products over several tasks' panels (float32; bfloat16 widened, and in k pairs where built), with a bias:
    bit for bit the same at either level; a level other than 1 or 2 is refused, naming it."""
    if pairs and (dtype != torch.bfloat16 or not pair_panels()):
        pytest.skip("k pairs: bfloat16 on a build with AVX512-BF16")
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 300, generator=generator).to(dtype)
    x, bias = torch.randn(rows, 300, generator=generator).to(dtype), torch.randn(200, generator=generator).to(dtype)
    panels = pack_panels(weight, pairs=pairs) if dtype == torch.bfloat16 else pack_panels(weight)
    outputs = []
    for level in (1, 2):
        module.set_panel_prefetch(level)
        assert module.panel_prefetch() == level
        outputs.append(module.panel_linear(x, panels, 200, bias))
    assert torch.equal(outputs[0], outputs[1])
    with pytest.raises(RuntimeError, match="got 0"):
        module.set_panel_prefetch(0)


def test_the_measurements_time_both_levels(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both levels timed over data of the size asked for (small here), the module left at level 1."""
    monkeypatch.setattr(kernel_tuning, "_cache_bytes", lambda: 8 << 20)
    module.set_attention_prefetch(2)
    module.set_panel_prefetch(2)
    for seconds in (measure_attention_prefetch(module, rounds=2), measure_panel_prefetch(module, rounds=2)):
        assert set(seconds) == {1, 2} and all(value > 0 for value in seconds.values())
    assert module.attention_prefetch() == module.panel_prefetch() == 1


def test_the_measured_data_outgrow_the_cpu_caches() -> None:
    """Four times the largest cache sysfs reports (sizes like "32768K"), within 256 and 512 MiB."""
    sizes = [path.read_text().strip() for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
    largest = max((int(size[:-1]) << {"K": 10, "M": 20}[size[-1]] for size in sizes if size[-1:] in "KM"),
                  default=0)
    assert kernel_tuning._cache_bytes() == min(max(4 * largest, 256 << 20), 512 << 20)


def test_the_faster_levels_are_stored_and_reused(module: Any, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """No stored levels: the faster measured ones are set and stored with their timings; the next call takes the
    stored ones without measuring; an unreadable file, or one without valid levels, is measured again and
    rewritten; a file with one valid level has only the other measured."""
    made = _fake_measurements(monkeypatch, {1: 2.0, 2: 1.0}, {1: 1.0, 2: 3.0})
    assert tune(module, tmp_path) == {"attention_prefetch": 2, "panel_prefetch": 1}
    assert (module.attention_prefetch(), module.panel_prefetch()) == (2, 1)
    stored = json.loads((tmp_path / TUNING_FILE).read_text())
    assert stored["attention_prefetch"] == 2 and stored["panel_prefetch"] == 1
    assert stored["seconds"] == {"attention_prefetch": {"l1": 2.0, "l2": 1.0},
                                 "panel_prefetch": {"l1": 1.0, "l2": 3.0}}
    assert tune(module, tmp_path) == {"attention_prefetch": 2, "panel_prefetch": 1} and len(made) == 2
    for broken in ("{not json", json.dumps({"attention_prefetch": 7, "panel_prefetch": "l2"}), json.dumps([1, 2])):
        (tmp_path / TUNING_FILE).write_text(broken)
        assert tune(module, tmp_path) == {"attention_prefetch": 2, "panel_prefetch": 1}
        assert json.loads((tmp_path / TUNING_FILE).read_text())["panel_prefetch"] == 1
    assert len(made) == 8
    (tmp_path / TUNING_FILE).write_text(json.dumps({"attention_prefetch": 1}))
    assert tune(module, tmp_path) == {"attention_prefetch": 1, "panel_prefetch": 1} and made[8:] == ["panels"]
    assert json.loads((tmp_path / TUNING_FILE).read_text())["attention_prefetch"] == 1


def test_levels_stored_while_waiting_for_the_lock_are_taken(module: Any, monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    """Another process stores its measurements between this one's first look and its lock: this one takes them
    instead of measuring again."""
    looked: list[dict[str, int]] = []
    stored_levels = kernel_tuning._stored_levels

    def look(directory: Path) -> dict[str, int]:
        if not looked:
            (directory / TUNING_FILE).write_text(json.dumps({"attention_prefetch": 2, "panel_prefetch": 2}))
            looked.append({})
            return {}
        looked.append(stored_levels(directory))
        return looked[-1]

    made = _fake_measurements(monkeypatch, {1: 1.0, 2: 2.0}, {1: 1.0, 2: 2.0})
    monkeypatch.setattr(kernel_tuning, "_stored_levels", look)
    assert tune(module, tmp_path) == {"attention_prefetch": 2, "panel_prefetch": 2} and not made
    assert len(looked) == 2 and (tmp_path / "tuning.flock").exists()


def test_the_variables_override_the_measurements(module: Any, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """"l1" / "l2" (any case) set a level without measuring or storing it; "auto" measures; anything else is an
    error naming the variable and the value."""
    made = _fake_measurements(monkeypatch, {1: 1.0, 2: 2.0}, {1: 2.0, 2: 1.0})
    for attention, panels, expected in (("l2", "L1", (2, 1)), (" L1 ", "l2", (1, 2))):
        monkeypatch.setenv(PREFETCH_ENV, attention)
        monkeypatch.setenv(PANEL_PREFETCH_ENV, panels)
        assert tune(module, tmp_path) == dict(zip(("attention_prefetch", "panel_prefetch"), expected, strict=True))
        assert (module.attention_prefetch(), module.panel_prefetch()) == expected
    assert not made and not (tmp_path / TUNING_FILE).exists()
    monkeypatch.setenv(PANEL_PREFETCH_ENV, "auto")
    assert tune(module, tmp_path) == {"attention_prefetch": 1, "panel_prefetch": 2} and made == ["panels"]
    assert set(json.loads((tmp_path / TUNING_FILE).read_text())) == {"panel_prefetch", "seconds"}
    monkeypatch.setenv(PREFETCH_ENV, "l3")
    with pytest.raises(ValueError, match="CONTBATCH_ATTENTION_PREFETCH='l3'"):
        tune(module, tmp_path)


def test_an_unwritable_directory_only_loses_the_cache(module: Any, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    _fake_measurements(monkeypatch, {1: 2.0, 2: 1.0}, {1: 2.0, 2: 1.0})
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert tune(module, blocked / "build") == {"attention_prefetch": 2, "panel_prefetch": 2}


def test_the_loaded_kernels_run_at_the_machines_levels() -> None:
    """The process's kernels took the levels stored beside their build (measured when the build had none)."""
    if any(os.environ.get(env, "auto").strip().lower() != "auto" for env in ENVS):
        pytest.skip("a variable sets a level")
    module = kernel_module()
    if module is None or not module.has_panel_gemm():
        pytest.skip("the CPU kernels (with the panel product) are not built")
    stored = json.loads((build_directory(extension_name()) / TUNING_FILE).read_text())
    assert (module.attention_prefetch(), module.panel_prefetch()) == (stored["attention_prefetch"],
                                                                      stored["panel_prefetch"])
