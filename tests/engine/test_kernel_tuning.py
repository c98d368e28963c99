"""The CPU kernels' per-machine tuning (`kernel_tuning`): the attention kernel computes the same at either prefetch
level, the level is measured once and kept beside the build, and `CONTBATCH_ATTENTION_PREFETCH` overrides it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from contbatch.engine import kernel_tuning
from contbatch.engine.cpu_kernels import build_directory, extension_name, kernel_module
from contbatch.engine.kernel_tuning import PREFETCH_ENV, TUNING_FILE, measure_attention_prefetch, tune

BLOCK = 16


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The built kernels, their prefetch level restored after the test; `CONTBATCH_ATTENTION_PREFETCH` unset."""
    built = kernel_module()
    if built is None:
        pytest.skip("the CPU kernels are not built")
    monkeypatch.delenv(PREFETCH_ENV, raising=False)
    level = built.attention_prefetch()
    yield built
    built.set_attention_prefetch(level)


@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(3, 3, 64), (1, 5, 40), (2, 2, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_levels_compute_the_same(module: Any, kv_heads: int, group: int, dim: int, dtype: torch.dtype) -> None:
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


def test_the_measurement_times_both_levels(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both levels timed over a cache of the size asked for (small here), the module left at level 1."""
    monkeypatch.setattr(kernel_tuning, "_cache_bytes", lambda: 8 << 20)
    module.set_attention_prefetch(2)
    seconds = measure_attention_prefetch(module, rounds=2)
    assert set(seconds) == {1, 2} and all(value > 0 for value in seconds.values())
    assert module.attention_prefetch() == 1


def test_the_measured_cache_outgrows_the_cpu_caches() -> None:
    """Four times the largest cache sysfs reports (sizes like "32768K"), within 256 and 512 MiB."""
    sizes = [path.read_text().strip() for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
    largest = max((int(size[:-1]) << {"K": 10, "M": 20}[size[-1]] for size in sizes if size[-1:] in "KM"),
                  default=0)
    assert kernel_tuning._cache_bytes() == min(max(4 * largest, 256 << 20), 512 << 20)


def test_the_faster_level_is_stored_and_reused(module: Any, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """No stored level: the faster measured one is set and stored; the next call takes the stored one without
    measuring; an unreadable file, or one without a valid level, is measured again and rewritten."""
    measured: list[dict[int, float]] = []

    def measure(built: Any) -> dict[int, float]:
        measured.append({1: 2.0, 2: 1.0} if len(measured) == 0 else {1: 1.0, 2: 3.0})
        return measured[-1]

    monkeypatch.setattr(kernel_tuning, "measure_attention_prefetch", measure)
    assert tune(module, tmp_path) == 2 and module.attention_prefetch() == 2
    stored = json.loads((tmp_path / TUNING_FILE).read_text())
    assert stored["attention_prefetch"] == 2 and stored["seconds"] == {"l1": 2.0, "l2": 1.0}
    assert tune(module, tmp_path) == 2 and len(measured) == 1
    for broken in ("{not json", json.dumps({"attention_prefetch": 7}), json.dumps([1, 2])):
        (tmp_path / TUNING_FILE).write_text(broken)
        assert tune(module, tmp_path) == 1 and module.attention_prefetch() == 1
        assert json.loads((tmp_path / TUNING_FILE).read_text())["attention_prefetch"] == 1
    assert len(measured) == 4


def test_a_level_stored_while_waiting_for_the_lock_is_taken(module: Any, monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    """Another process stores its measurement between this one's first look and its lock: this one takes it
    instead of measuring again."""
    looked: list[int | None] = []
    stored_level = kernel_tuning._stored_level

    def look(directory: Path) -> int | None:
        if not looked:
            (directory / TUNING_FILE).write_text(json.dumps({"attention_prefetch": 2}))
            looked.append(None)
            return None
        looked.append(stored_level(directory))
        return looked[-1]

    def measure(built: Any) -> dict[int, float]:
        raise AssertionError("measured although a level was stored")

    monkeypatch.setattr(kernel_tuning, "_stored_level", look)
    monkeypatch.setattr(kernel_tuning, "measure_attention_prefetch", measure)
    assert tune(module, tmp_path) == 2 and looked == [None, 2]
    assert (tmp_path / "tuning.flock").exists()


def test_the_setting_overrides_the_measurement(module: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """"l1" / "l2" (any case) set the level without measuring or storing; "auto" measures; anything else is an
    error naming the value."""
    monkeypatch.setattr(kernel_tuning, "measure_attention_prefetch", lambda built: {1: 1.0, 2: 2.0})
    for setting, level in (("l2", 2), (" L1 ", 1), ("L2", 2)):
        monkeypatch.setenv(PREFETCH_ENV, setting)
        assert tune(module, tmp_path) == level and module.attention_prefetch() == level
    assert not (tmp_path / TUNING_FILE).exists()
    monkeypatch.setenv(PREFETCH_ENV, "auto")
    assert tune(module, tmp_path) == 1 and (tmp_path / TUNING_FILE).exists()
    monkeypatch.setenv(PREFETCH_ENV, "l3")
    with pytest.raises(ValueError, match="CONTBATCH_ATTENTION_PREFETCH='l3'"):
        tune(module, tmp_path)


def test_an_unwritable_directory_only_loses_the_cache(module: Any, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setattr(kernel_tuning, "measure_attention_prefetch", lambda built: {1: 2.0, 2: 1.0})
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert tune(module, blocked / "build") == 2


def test_the_loaded_kernels_run_at_the_machines_level() -> None:
    """The process's kernels took the level stored beside their build (measured when the build had none)."""
    if os.environ.get(PREFETCH_ENV, "auto").strip().lower() != "auto":
        pytest.skip(f"{PREFETCH_ENV} sets the level")
    module = kernel_module()
    if module is None:
        pytest.skip("the CPU kernels are not built")
    stored = json.loads((build_directory(extension_name()) / TUNING_FILE).read_text())
    assert module.attention_prefetch() == stored["attention_prefetch"]
