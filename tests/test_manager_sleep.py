"""`ContinuousBatchingManager.sleep()` / `wake()`: synchronous on the engine thread, refused while requests run,
direct when the thread is not running, and reachable from the persistent manager of `generate_batch`."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus, generate_batch
from contbatch.frontend.engine_loop import EngineCall, EngineLoop
from tests.helpers import random_prompts, reference_generate, tiny_model

GENERATION = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=6)
MiB = 1 << 20
LARGE_CACHE = dict(block_size=64, num_blocks=8192)  # 256 MiB for the tiny llama (see tests/engine/test_sleep.py)


def resident_bytes() -> int:
    """This process's resident memory (`/proc/self/statm`), after a full garbage collection."""
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def new_manager(**config: object) -> ContinuousBatchingManager:
    cb = ContinuousBatchingConfig(**{"block_size": 8, "num_blocks": 64, **config})  # type: ignore[arg-type]
    return ContinuousBatchingManager(tiny_model("llama"), GENERATION, cb)


def hold_engine_thread(loop: EngineLoop) -> threading.Event:
    """Holds the engine thread between two steps until the returned event is set, so that the commands queued
    meanwhile are taken in order afterwards."""
    release = threading.Event()
    loop.submit(EngineCall(lambda engine: release.wait(60)))
    return release


def wait_for_inbox(loop: EngineLoop, size: int) -> None:
    """Waits until `size` commands are queued (the engine thread is held, so none is taken meanwhile)."""
    deadline = time.monotonic() + 30
    while loop._inbox.qsize() < size:
        assert time.monotonic() < deadline, "the commands never reached the inbox"
        time.sleep(0.001)


def test_sleep_on_the_running_engine_thread_frees_memory_before_returning() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([20], seed=80)[0]
    manager = new_manager(**LARGE_CACHE)
    engine = manager.engine
    engine.cache._storage.fill_(0)  # torch.empty: make every page resident before measuring
    with manager:
        manager.add_request(prompt, "before", max_new_tokens=6)
        before = manager.get_result("before", timeout=60)
        assert before.generated_tokens == reference_generate(model, prompt, 6)
        awake = resident_bytes()
        manager.sleep()
        asleep = resident_bytes()
        print(f"manager RSS awake {awake / MiB:.0f} MiB, asleep {asleep / MiB:.0f} MiB, "
              f"cache {engine.cache.nbytes / MiB:.0f} MiB")
        assert awake - asleep >= 0.9 * engine.cache.nbytes
        assert engine.is_sleeping and manager.stats.is_sleeping and engine.block_pool.is_whole
        manager.sleep()
        manager.add_request(prompt, "after", max_new_tokens=6)
        after = manager.get_result("after", timeout=60)
        assert after.generated_tokens == before.generated_tokens and after.num_cached_tokens == 0
        assert not engine.is_sleeping and not manager.stats.is_sleeping
        manager.sleep()
        manager.wake()
        assert not engine.is_sleeping and engine.block_pool.is_whole
    engine.check_integrity()
    assert engine.block_pool.is_whole


def test_sleep_with_a_request_in_flight_raises_in_the_caller_and_the_request_completes() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([12], seed=81)[0]
    manager = new_manager()
    errors: list[BaseException] = []

    def sleep() -> None:
        try:
            manager.sleep()
        except RuntimeError as error:
            errors.append(error)

    with manager:
        release = hold_engine_thread(manager._loop)
        manager.add_request(prompt, "busy", max_new_tokens=6)
        sleeper = threading.Thread(target=sleep, daemon=True)
        sleeper.start()
        wait_for_inbox(manager._loop, 2)
        release.set()
        sleeper.join(60)
        assert not sleeper.is_alive()
        assert len(errors) == 1 and "1 unfinished request" in str(errors[0])
        output = manager.get_result("busy", timeout=60)
        assert output.status == RequestStatus.FINISHED
        assert output.generated_tokens == reference_generate(model, prompt, 6)
        engine = manager.engine
        assert manager.is_running() and not engine.is_sleeping
        manager.sleep()
        assert engine.is_sleeping and engine.block_pool.is_whole
    engine.check_integrity()


def test_a_call_left_behind_by_a_stopping_session_runs_on_the_kept_engine() -> None:
    """`sleep()` queued behind `stop()`: the session ends without running it, and it runs on the caller's
    thread once the engine thread is gone."""
    manager = new_manager()
    manager.start()
    release = hold_engine_thread(manager._loop)
    manager.stop(block=False, keep_for_next_session=True)
    sleeper = threading.Thread(target=manager.sleep, daemon=True)
    sleeper.start()
    wait_for_inbox(manager._loop, 2)
    release.set()
    sleeper.join(60)
    assert not sleeper.is_alive() and not manager.is_running()
    assert manager.engine.is_sleeping


def test_sleep_and_wake_without_a_running_thread_call_the_engine() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([10], seed=82)[0]
    manager = new_manager()
    manager.sleep()
    assert manager.engine.is_sleeping and manager.stats.is_sleeping
    manager.wake()
    assert not manager.engine.is_sleeping
    manager.sleep()
    with manager:
        manager.add_request(prompt, "a", max_new_tokens=4)
        assert manager.get_result("a", timeout=60).generated_tokens == reference_generate(model, prompt, 4)
    manager.stop()
    manager.sleep()  # released engine: nothing is held, nothing to do
    manager.wake()
    with pytest.raises(RuntimeError, match="keep_for_next_session"):
        _ = manager.engine


def test_persistent_manager_of_generate_batch_sleeps_between_calls() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([40], seed=83)[0]
    cb = ContinuousBatchingConfig(block_size=8, num_blocks=64)
    try:
        first = generate_batch(model, [prompt], GENERATION, cb, progress_bar=False, persistent_manager=True)["req_0"]
        manager = model._contbatch_manager
        manager.engine.add_request([1, 2, 3], "stray", max_new_tokens=1)
        with pytest.raises(RuntimeError, match="1 unfinished"):
            manager.sleep()
        manager.engine.cancel_request("stray")
        manager.sleep()
        assert manager.engine.is_sleeping and manager.engine.block_pool.is_whole
        again = generate_batch(model, [prompt], GENERATION, cb, progress_bar=False, persistent_manager=True)["req_0"]
        assert model._contbatch_manager is manager and not manager.engine.is_sleeping
        assert again.generated_tokens == first.generated_tokens == reference_generate(model, prompt, 6)
        assert again.num_cached_tokens == 0
        manager.engine.check_integrity()
    finally:
        if hasattr(model, "_contbatch_manager"):
            model._contbatch_manager.stop()
            del model._contbatch_manager
