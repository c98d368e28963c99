"""Committing a CPU cache's resident memory ahead of its first writes: which pages, which blocks, and what stays."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch

from contbatch.engine.kv_cache import RESIDENT_GIB_ENV, KVCacheSpec, PagedKVCache
from tests.helpers import make_engine, random_prompts, reference_generate, run_engine, tiny_model

CPU = torch.device("cpu")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def release_free_heap() -> None:
    """Gives the heap's free pages back to the kernel (glibc's `malloc_trim`; elsewhere nothing). A CPU engine tunes
    malloc to keep freed memory (`malloc_tuning`), so a large block an earlier test freed in this process would
    otherwise serve the next allocation with its pages resident already."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def test_commit_sets_one_element_a_page_of_the_given_blocks_and_nothing_else() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    cache = PagedKVCache(spec, num_blocks=40, block_size=16, device=CPU)
    cache._storage.fill_(7.0)
    cache.commit(2, 9)
    planes = cache._storage.view(-1, cache.shape[-2] * cache.shape[-1])
    block_elements = cache.block_size * spec.head_dim
    inside = planes[:, 2 * block_elements: 9 * block_elements]
    assert (inside == 0).sum(dim=1).tolist() == [7 * block_elements * 4 // mmap.PAGESIZE] * planes.shape[0]
    assert bool((planes[:, : 2 * block_elements] == 7).all()) and bool((planes[:, 9 * block_elements:] == 7).all())
    cache.commit(38, 99)  # clamped to the pool's blocks: the scratch block past them is left alone
    assert bool((planes[:, 40 * block_elements:] == 7).all())
    assert int((planes[:, 38 * block_elements: 40 * block_elements] == 0).sum()) > 0


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set size (Linux)")
def test_commit_makes_the_blocks_memory_resident() -> None:
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    release_free_heap()
    cache = PagedKVCache(spec, num_blocks=4096, block_size=16, device=CPU)
    committed = 1024 * spec.bytes_per_block(16, 4)
    before = resident_bytes()
    cache.commit(0, 1024)
    assert resident_bytes() - before >= 0.9 * committed, f"{committed} bytes committed"


def test_the_engine_commits_its_untouched_resident_blocks_and_its_outputs_stay_generates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama", "cpu")
    with make_engine(model, block_size=4, num_blocks=8) as probe:
        block_bytes = probe.cache.spec.bytes_per_block(4, probe.cache.shape[0])
    monkeypatch.setenv(RESIDENT_GIB_ENV, str(20 * block_bytes / 2**30))
    prompts = random_prompts([9, 13], seed=5)
    with make_engine(model, block_size=4, num_blocks=64) as engine:
        assert engine.block_pool.touch_limit == 20
        engine.add_request(prompts[0], "first", max_new_tokens=6)
        run_engine(engine)
        touched = engine.block_pool.num_touched
        assert touched > 0
        assert engine.commit_cache() == 20 - touched, "only the blocks never handed out, up to the limit"
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, f"after-{index}", max_new_tokens=6)
        finished = run_engine(engine)
        assert finished["after-0"].num_cached_tokens > 0, "the cached prefix survived the commit"
        for index, prompt in enumerate(prompts):
            assert finished[f"after-{index}"].generated_tokens == reference_generate(model, prompt, 6)
        engine.block_pool.check_integrity()
        engine.sleep()
        assert engine.commit_cache() == 0, "asleep: no storage to commit"
