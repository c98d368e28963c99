"""ContinuousBatchingManager: threads, streaming, cancellation, fairness, queue bounds and failures."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from contbatch import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    GenerationOutput,
    RequestStatus,
    continuous_batching_context_manager,
)
from tests.helpers import make_engine, random_prompts, reference_generate, run_engine, run_threads, tiny_model

CONFIG = ContinuousBatchingConfig(block_size=16, num_blocks=1024, max_batch_tokens=64)


def new_manager(**overrides: object) -> ContinuousBatchingManager:
    from transformers import GenerationConfig

    config = ContinuousBatchingConfig(**{**CONFIG.__dict__, **overrides})  # type: ignore[arg-type]
    return ContinuousBatchingManager(tiny_model("llama"), GenerationConfig(do_sample=False, eos_token_id=None,
                                                                           max_new_tokens=8), config)


def test_eight_threads_with_streaming_and_random_cancels() -> None:
    rng = random.Random(0)
    plans = [[(random_prompts([rng.randint(1, 24)], seed=t * 1000 + i)[0], rng.randint(1, 16),
               i % 2 == 0, rng.random() < 0.15) for i in range(100)] for t in range(8)]
    with make_engine(tiny_model("llama"), block_size=16, num_blocks=2048, max_batch_tokens=512) as engine:
        for t, plan in enumerate(plans):
            for i, (prompt, max_new, _, _) in enumerate(plan):
                engine.add_request(prompt, request_id=f"t{t}-{i}", max_new_tokens=max_new)
        expected = {rid: request.generated_tokens for rid, request in run_engine(engine).items()}
    manager = new_manager()
    manager.start()
    engine = manager.engine
    results: dict[str, list[GenerationOutput]] = {}
    errors: list[BaseException] = []

    def client(t: int) -> None:
        try:
            ids = [manager.add_request(prompt, f"t{t}-{i}", max_new, streaming=stream)
                   for i, (prompt, max_new, stream, _) in enumerate(plans[t])]
            for rid, (_, _, _, cancel) in zip(ids, plans[t], strict=True):
                if cancel:
                    manager.cancel_request(rid)
            for rid in ids:
                results[rid] = list(manager.request_id_iter(rid))
        except BaseException as error:
            errors.append(error)

    run_threads(client, 8)
    assert not errors and len(results) == 800
    for rid, outputs in results.items():
        terminal = [o for o in outputs if o.is_finished()]
        assert len(terminal) == 1 and outputs[-1] is terminal[0], rid
        final = terminal[0]
        assert [t for o in outputs for t in o.new_tokens] == final.generated_tokens, rid
        if final.status == RequestStatus.CANCELLED:
            assert expected[rid][: len(final.generated_tokens)] == final.generated_tokens
        else:
            assert final.status == RequestStatus.FINISHED and final.generated_tokens == expected[rid], rid
    assert any(r[-1].status == RequestStatus.CANCELLED for r in results.values())
    started = time.monotonic()
    manager.stop(timeout=30)
    assert time.monotonic() - started < 30 and not manager.is_running()
    assert engine.block_pool.is_whole
    engine.check_integrity()


def test_result_handler_delivers_on_the_event_loop() -> None:
    prompt = random_prompts([7], seed=30)[0]

    async def main() -> tuple[list[GenerationOutput], set[int]]:
        received: list[GenerationOutput] = []
        threads: set[int] = set()
        done = asyncio.Event()

        def on_output(output: GenerationOutput) -> None:
            received.append(output)
            threads.add(threading.get_ident())
            if output.is_finished():
                done.set()

        with continuous_batching_context_manager(tiny_model("llama"), None, CONFIG) as manager:
            rid = manager.add_request(prompt, max_new_tokens=6, streaming=True, eos_token_id=None)
            manager.register_result_handler(rid, on_output)
            await asyncio.wait_for(done.wait(), timeout=30)
        return received, threads

    received, threads = asyncio.run(main())
    assert threads == {threading.get_ident()}
    assert [t for o in received for t in o.new_tokens] == reference_generate(tiny_model("llama"), prompt, 6)
    assert received[-1].status == RequestStatus.FINISHED and sum(o.is_finished() for o in received) == 1


def test_register_result_handler_needs_a_running_loop() -> None:
    manager = new_manager()
    with pytest.raises(RuntimeError, match="running asyncio event loop"):
        manager.register_result_handler("x", print)
    manager.stop()


def test_get_result_for_one_request_neither_steals_nor_starves_others() -> None:
    short, long = random_prompts([3, 5], seed=31)
    expected_short = reference_generate(tiny_model("llama"), short, 1)
    expected_long = reference_generate(tiny_model("llama"), long, 40)
    with new_manager() as manager:
        manager.add_request(short, "short", max_new_tokens=1)
        manager.add_request(long, "long", max_new_tokens=40)
        assert manager.get_result("long", timeout=30).generated_tokens == expected_long
        other = manager.get_result(timeout=5)
        assert other.request_id == "short" and other.generated_tokens == expected_short
        assert manager.get_result(timeout=0.05) is None
        assert manager.get_result("never-added", timeout=5) is None


def test_cancel_gives_a_terminal_output_and_frees_blocks_at_once() -> None:
    prompt = random_prompts([9], seed=32)[0]
    with new_manager() as manager:
        rid = manager.add_request(prompt, max_new_tokens=1000, streaming=True)
        stream = manager.request_id_iter(rid)
        first = [next(stream) for _ in range(3)]
        manager.cancel_request(rid)
        rest = list(stream)
        final = rest[-1]
        assert final.status == RequestStatus.CANCELLED and final.finish_reason == "cancelled"
        assert 3 <= len(final.generated_tokens) < 1000
        assert [t for o in first + rest for t in o.new_tokens] == final.generated_tokens
        assert manager.engine.block_pool.is_whole
        manager.cancel_request(rid)
        manager.cancel_request("unknown")
        again = manager.add_request(prompt, max_new_tokens=3)
        assert manager.get_result(again, timeout=30).status == RequestStatus.FINISHED


def test_add_after_stop_and_duplicate_ids_are_rejected() -> None:
    manager = new_manager()
    manager.start()
    manager.add_request([1, 2, 3], "dup", max_new_tokens=300)
    with pytest.raises(ValueError, match="'dup': a request with this id is already running"):
        manager.add_request([4, 5], "dup")
    manager.stop()
    final = manager.get_result("dup", timeout=5)
    assert final is not None and final.status == RequestStatus.CANCELLED
    with pytest.raises(RuntimeError, match="the manager is stopped"):
        manager.add_request([1, 2])
    with pytest.raises(ValueError, match="token id 99999 is outside the vocabulary"):
        new_manager().add_request([99999])


def test_full_queue_blocks_then_raises_and_frees_when_admitted() -> None:
    manager = new_manager(max_queue_size=2)
    manager.queue_timeout = 0.2
    manager.add_request([1, 2, 3], "a", max_new_tokens=2)
    manager.add_request([4, 5, 6], "b", max_new_tokens=2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="queue stayed full"):
        manager.add_request([7, 8], "c")
    assert time.monotonic() - started >= 0.2
    manager.queue_timeout = 30
    manager.start()
    manager.add_request([7, 8], "c", max_new_tokens=2)
    assert {manager.get_result(timeout=30).request_id for _ in range(3)} == {"a", "b", "c"}
    manager.stop()


@pytest.mark.parametrize("stage", ["model_runner.execute", "sampler.draw"])
def test_a_failing_forward_or_sampler_fails_its_batch_only(stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = new_manager()
    owner_name, method_name = stage.split(".")
    owner = getattr(manager.engine, owner_name)
    real = getattr(owner, method_name)
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(f"{stage} exploded")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, method_name, flaky)
    prompt = random_prompts([6], seed=33)[0]
    manager.add_request(prompt, "first", max_new_tokens=4)
    manager.add_request(prompt[:3], "first-b", max_new_tokens=4)
    with manager:  # both are queued before the thread starts, so they share its first (failing) step
        failed = [manager.get_result(rid, timeout=30) for rid in ("first", "first-b")]
        assert all(f.status == RequestStatus.FAILED and f"{stage} exploded" in f.error for f in failed)
        manager.add_request(prompt, "second", max_new_tokens=4)
        second = manager.get_result("second", timeout=30)
        assert manager.engine.block_pool.is_whole
    assert second.generated_tokens == reference_generate(tiny_model("llama"), prompt, 4)


def test_a_dead_engine_thread_wakes_every_waiter(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = new_manager()

    def broken_step() -> list:
        raise MemoryError("scheduler bug")

    monkeypatch.setattr(manager.engine, "step", broken_step)
    manager.add_request([1, 2, 3], "x")
    manager.add_request([4, 5], "y", streaming=True)
    waiter: list[GenerationOutput | None] = []
    thread = threading.Thread(target=lambda: waiter.append(manager.get_result("x")))
    thread.start()
    manager.start()
    thread.join(timeout=10)
    assert waiter and waiter[0].status == RequestStatus.FAILED and "scheduler bug" in waiter[0].error
    assert [o.status for o in manager.request_id_iter("y")] == [RequestStatus.FAILED]
    with pytest.raises(RuntimeError, match="the engine thread died"):
        manager.get_result(timeout=None)
    assert not manager.is_running()


def test_keep_for_next_session_reuses_the_cache_and_restores_attention() -> None:
    model = tiny_model("llama")
    prompt = random_prompts([5], seed=34)[0]
    expected = reference_generate(model, prompt, 5)
    manager = new_manager()
    engine = manager.engine
    for _ in range(2):
        manager.start()
        assert model.config._attn_implementation == "contbatch_paged"
        rid = manager.add_request(prompt, max_new_tokens=5)
        assert manager.get_result(rid, timeout=30).generated_tokens == expected
        manager.stop(keep_for_next_session=True)
        assert manager.engine is engine and model.config._attn_implementation == "sdpa"
    manager.start()
    manager.stop()
    with pytest.raises(RuntimeError, match="stopped without keep_for_next_session"):
        _ = manager.engine


def test_mixin_methods_and_iteration() -> None:
    import contbatch

    model = contbatch.add_continuous_batching(tiny_model("qwen3"))
    prompts = random_prompts([4, 8], seed=35)
    manager = model.init_continuous_batching(continuous_batching_config=CONFIG)
    manager.start()
    manager.add_requests(prompts, max_new_tokens=3, eos_token_id=None)
    seen = {}
    for output in manager:
        seen[output.request_id] = output.generated_tokens
        if len(seen) == 2:
            manager.stop(block=False)
    manager.join(timeout=10)
    assert sorted(seen.values()) == sorted(reference_generate(model, p, 3) for p in prompts)
    with model.continuous_batching_context_manager(continuous_batching_config=CONFIG) as running:
        assert running.is_running()
    assert not running.is_running()


def test_n_samples_that_do_not_all_fit_the_queue_release_their_room() -> None:
    manager = new_manager(max_queue_size=3)
    manager.queue_timeout = 0.05
    manager.add_request([1, 2, 3], "a", max_new_tokens=2)
    with pytest.raises(RuntimeError, match="queue stayed full"):
        manager.add_request([4, 5, 6], "b", max_new_tokens=2, n=3)
    manager.add_request([4, 5, 6], "b", max_new_tokens=2, n=2)
    manager.start()
    assert {manager.get_result(rid, timeout=30).status for rid in ("a", "b_0", "b_1")} == {RequestStatus.FINISHED}
    manager.stop()


def test_requests_the_engine_refuses_fail_alone_and_give_back_their_queue_places() -> None:
    """Requests that pass the client's checks but that the engine refuses (here: a fork whose prompt is not its
    parent's sequence) fail with the engine's error, all of their command; the engine thread lives on, and the
    queue places they took are given back."""
    from contbatch.frontend.engine_loop import AddRequests
    from contbatch.frontend.output_processor import RequestState

    manager = new_manager(max_queue_size=3)
    with manager:
        engine, loop = manager.engine, manager._loop
        requests = [engine.make_request([1, 2, 3], "fine", max_new_tokens=2),
                    engine.make_request([4, 5], "bad_0", max_new_tokens=2),
                    engine.make_request([9, 9], "bad_1", max_new_tokens=2)]
        for request in requests:  # what EngineClient.add_request does before submitting
            loop.router.open(request.request_id)
            loop.gate.acquire(request.request_id)
        states = [RequestState(request.request_id, request.prompt_ids) for request in requests]
        loop.submit(AddRequests(requests[:1], states[:1]))
        loop.submit(AddRequests(requests[1:], states[1:]))
        for request_id in ("bad_0", "bad_1"):
            failed = manager.get_result(request_id, timeout=30)
            assert failed.status == RequestStatus.FAILED and "token sequence" in failed.error, request_id
        assert manager.get_result("fine", timeout=30).status == RequestStatus.FINISHED
        assert loop.gate.num_waiting == 0, "every queue place was given back"
        assert manager.is_running() and manager.engine.block_pool.is_whole
