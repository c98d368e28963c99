"""The OpenMP thread pools: a thread's pool given back ends its workers, and the engine keeps only its own pool
while it computes (the submitting thread gives its pool back; the engine thread gives its own back when idle)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.engine.openmp import loaded_runtimes, release_thread_pool
from tests.helpers import fresh_tiny_model, tiny_model

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or "OpenMP" not in torch.__config__.parallel_info()
    or not loaded_runtimes(), reason="counts the process's native threads (Linux) of torch's libgomp")


def native_threads() -> int:
    """The process's threads that Python did not start: OpenMP workers among them."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def parallel_region() -> None:
    """An elementwise op large enough for ATen to run it in an OpenMP parallel region (its grain is 32,768)."""
    torch.ones(1 << 20).mul_(2)


@pytest.fixture
def two_threads() -> Iterator[int]:
    """Torch on 2 threads in this test (make test's workers run 1), the calling thread's pool given back first;
    yields the native thread count then."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    assert release_thread_pool()
    try:
        yield native_threads()
    finally:
        release_thread_pool()
        torch.set_num_threads(threads)


def test_the_libgomp_torch_ships_is_found_first() -> None:
    own = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if not own:
        pytest.skip("this torch build does not ship its own libgomp")
    assert loaded_runtimes()[0] in own


def test_a_released_pool_ends_its_workers_and_the_next_region_makes_it_again(two_threads: int) -> None:
    parallel_region()
    assert native_threads() == two_threads + 1
    assert release_thread_pool()
    assert native_threads() == two_threads
    assert release_thread_pool()  # no pool: nothing to end
    assert native_threads() == two_threads
    parallel_region()
    assert native_threads() == two_threads + 1


def settles_at(count: int, timeout: float = 30.0) -> bool:
    """Whether the native thread count reaches `count` within `timeout` seconds (the engine thread releases
    its pools on its own, once idle)."""
    deadline = time.monotonic() + timeout
    while native_threads() != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def new_manager(model: PreTrainedModel, use_async_batching: bool) -> ContinuousBatchingManager:
    return ContinuousBatchingManager(model, GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=4),
                                     ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=64,
                                                              use_async_batching=use_async_batching))


def generate_four(manager: ContinuousBatchingManager) -> None:
    request_id = manager.add_request([1, 2, 3], max_new_tokens=4)
    while (output := manager.get_result(request_id, timeout=30)) is not None and not output.is_finished():
        pass
    assert output is not None and len(output.generated_tokens) == 4


def test_the_idle_engine_thread_and_a_submitting_thread_keep_no_pool(two_threads: int) -> None:
    """The engine thread's pool, made by a parallel op run there (the tiny model's own ops are too small to go
    parallel), ends once the engine is idle again; a thread's pool ends when it submits to the engine (a cancel of
    an unknown id: nothing for the engine to compute). Without either release the count stays one higher."""
    manager = new_manager(tiny_model("llama", "cpu"), use_async_batching=False)
    manager.start()
    try:
        assert manager._loop.call(lambda engine: (parallel_region(), native_threads())[1]) == two_threads + 1
        assert settles_at(two_threads)
        parallel_region()
        assert native_threads() == two_threads + 1
        manager.cancel_request("no-such-request")
        assert native_threads() == two_threads
        generate_four(manager)
    finally:
        manager.stop()


def test_async_batchings_forward_thread_keeps_no_pool_once_idle(two_threads: int) -> None:
    """With async batching on a CPU the forwards run on a thread of their own: its pool (made by a parallel op
    in each forward) ends once the engine is idle; without that release the count stays one higher."""
    model = fresh_tiny_model("llama", "cpu")
    forward_threads: set[int] = set()

    def in_forward(*_: object) -> None:
        forward_threads.add(threading.get_ident())
        parallel_region()

    manager = new_manager(model, use_async_batching=True)
    model.get_input_embeddings().register_forward_pre_hook(in_forward)  # the steps' forwards, not the cache's probe
    manager.start()
    try:
        generate_four(manager)
        assert forward_threads and threading.get_ident() not in forward_threads
        assert settles_at(two_threads)
        generate_four(manager)
        assert settles_at(two_threads)
    finally:
        manager.stop()
