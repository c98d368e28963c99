"""`LLMEngine.sleep()` / `wake()`: the KV cache's memory is given back between generation phases, outputs are the
same afterwards, and nothing cached before a sleep is reused."""

from __future__ import annotations

import copy
import gc
import os
import platform
import threading

import pytest
import torch

from contbatch.engine.kv_cache import KVCacheSpec, PagedKVCache, trim_host_heap
from tests.helpers import make_engine, random_prompts, reference_generate, run_engine, tiny_model

MiB = 1 << 20
# tiny llama: 2 layers x 2 KV heads x 16 dims x float32 x (K, V) = 512 bytes a token; 8192 x 64 tokens = 256 MiB
LARGE_CACHE = dict(block_size=64, num_blocks=8192)


def resident_bytes() -> int:
    """This process's resident memory (`/proc/self/statm`), after a full garbage collection."""
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_paged_cache_release_and_allocate_keep_shape_dtype_and_device() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, num_blocks=5, block_size=2, device=torch.device("cpu"))
    assert cache.is_allocated and cache.nbytes == 3 * 2 * 2 * (10 + 2) * 4 * 2  # 5 blocks of 2 slots + scratch
    cache.release()
    cache.release()
    assert not cache.is_allocated and cache.keys == [] and cache.values == [] and cache._storage.numel() == 0
    cache.allocate()
    storage = cache._storage
    cache.allocate()
    assert cache._storage is storage, "allocate is idempotent"
    assert storage.shape == (3, 2, 2, 12, 4) and storage.dtype == torch.bfloat16 and storage.device.type == "cpu"
    assert len(cache.keys) == len(cache.values) == 3
    assert all(key.data_ptr() == storage[layer, 0].data_ptr() for layer, key in enumerate(cache.keys))


def test_sleep_gives_the_cache_memory_back_and_a_new_request_takes_it_again() -> None:
    model = tiny_model("llama", "cpu")  # host memory, measured as resident pages
    prompt = random_prompts([20], seed=70)[0]
    with make_engine(model, **LARGE_CACHE) as engine:
        cache = engine.cache
        assert cache.nbytes >= 256 * MiB
        cache._storage.fill_(0)  # torch.empty: make every page resident before measuring
        awake = resident_bytes()
        engine.sleep()
        asleep = resident_bytes()
        print(f"RSS awake {awake / MiB:.0f} MiB, asleep {asleep / MiB:.0f} MiB, cache {cache.nbytes / MiB:.0f} MiB")
        assert awake - asleep >= 0.9 * cache.nbytes
        assert engine.is_sleeping and engine.stats().is_sleeping
        engine.sleep()
        engine.check_integrity()
        assert engine.block_pool.is_whole
        engine.add_request(prompt, "after", max_new_tokens=5)
        assert not engine.is_sleeping and not engine.stats().is_sleeping
        assert run_engine(engine)["after"].generated_tokens == reference_generate(model, prompt, 5)
        assert cache._storage.shape == cache.shape
        cache._storage.fill_(0)
        woken = resident_bytes()
        print(f"RSS after the request and a full touch {woken / MiB:.0f} MiB")
        assert woken - asleep >= 0.9 * cache.nbytes


@pytest.mark.parametrize("how", ["wake", "new request"])
def test_outputs_are_unchanged_after_sleep_and_nothing_cached_before_is_reused(how: str) -> None:
    model = tiny_model("llama")
    prompt = random_prompts([40], seed=71)[0]
    with make_engine(model, block_size=8, num_blocks=64) as engine:
        engine.add_request(prompt, "first", max_new_tokens=6)
        first = run_engine(engine)["first"]
        engine.add_request(prompt, "cached", max_new_tokens=6)
        cached = run_engine(engine)["cached"]
        assert cached.num_cached_tokens == 39 and cached.generated_tokens == first.generated_tokens
        engine.sleep()
        assert engine.block_pool.num_cached_blocks == 0
        if how == "wake":
            engine.wake()
            engine.wake()
            assert not engine.is_sleeping
            engine.cache._storage.fill_(float("nan"))  # whatever the new memory holds must never be read
        engine.add_request(prompt, "after", max_new_tokens=6)
        after = run_engine(engine)["after"]
        assert after.num_cached_tokens == 0
        assert after.generated_tokens == first.generated_tokens == reference_generate(model, prompt, 6)


def test_sleep_refuses_while_requests_are_unfinished_and_they_complete() -> None:
    """Synchronous steps, so that the first step returns the running request's first token."""
    model = tiny_model("llama")
    running, waiting = random_prompts([12, 9], seed=72)
    with make_engine(model, block_size=8, num_blocks=64, use_async_batching=False) as engine:
        engine.add_request(running, "running", max_new_tokens=6)
        (first,) = engine.step()
        engine.add_request(waiting, "waiting", max_new_tokens=4)
        with pytest.raises(RuntimeError, match="2 unfinished request"):
            engine.sleep()
        assert not engine.is_sleeping
        finished = run_engine(engine)
        assert [*first.new_token_ids, *finished["running"].generated_tokens] == reference_generate(model, running, 6)
        assert finished["waiting"].generated_tokens == reference_generate(model, waiting, 4)
        engine.sleep()
        assert engine.is_sleeping
        engine.check_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sleep_gives_gpu_memory_back_to_the_driver() -> None:
    """Even when the caching allocator holds a free segment larger than the cache (the cache, carved from it,
    would share it with the tensors allocated later, and the segment could never go back)."""
    model = copy.deepcopy(tiny_model("llama")).cuda()
    prompt = random_prompts([20], seed=73)[0]
    segment = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    del segment
    with make_engine(model, **LARGE_CACHE) as engine:
        live = torch.empty(2**24, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        free_awake, _ = torch.cuda.mem_get_info()
        engine.sleep()
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep - free_awake >= 0.9 * engine.cache.nbytes
        engine.add_request(prompt, "after", max_new_tokens=5)
        assert run_engine(engine)["after"].finish_reason == "length"
        free_woken, _ = torch.cuda.mem_get_info()
        assert free_asleep - free_woken >= 0.9 * engine.cache.nbytes
    assert live.numel() == 2**24


def test_trim_host_heap_gives_back_what_another_thread_freed() -> None:
    """The engine thread's freed heap memory stays in its glibc arena until trimmed (without the trim this
    process gives back nothing: measured); `sleep()` trims it."""
    if not os.path.exists("/proc/self/statm") or platform.libc_ver()[0] != "glibc":
        pytest.skip("needs Linux with glibc")
    kept: list[torch.Tensor] = []

    def fragment() -> None:
        chunks = [torch.ones(16 * 1024) for _ in range(4096)]  # 64 KiB each, below glibc's mmap threshold
        kept.extend(chunks[::64])

    thread = threading.Thread(target=fragment)
    thread.start()
    thread.join()
    before = resident_bytes()
    trim_host_heap()
    assert before - resident_bytes() >= 64 * 2**20
    assert len(kept) == 64
