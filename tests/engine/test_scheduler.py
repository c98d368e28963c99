"""Scheduler decisions without a model: token budget, chunked prefill, policies, waiting and preemption."""

from __future__ import annotations

from contbatch.engine.batch import SchedulerOutput
from contbatch.engine.block_pool import BlockPool
from contbatch.engine.kv_cache_manager import KVCacheManager
from contbatch.engine.outputs import ModelRunnerOutput
from contbatch.engine.request import Request, RequestStatus
from contbatch.engine.sampling_params import SamplingParams
from contbatch.engine.scheduler import Scheduler


def make_scheduler(num_blocks: int = 100, block_size: int = 4, budget: int = 16, policy: str = "fifo",
                   prefill_while_decoding: int | None = None) -> Scheduler:
    return Scheduler(KVCacheManager(BlockPool(num_blocks), block_size), budget, policy, prefill_while_decoding)


def make_request(request_id: str, prompt_len: int, max_new_tokens: int = 8) -> Request:
    return Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new_tokens))


def run_step(scheduler: Scheduler, token: int = 7) -> list[tuple[str, int]]:
    batch = scheduler.schedule()
    plan = list(zip([r.request_id for r in batch.requests], batch.num_scheduled_tokens, strict=True))
    scheduler.update_from_output(batch, sampled(batch, token))
    return plan


def sampled(batch: SchedulerOutput, token: int) -> ModelRunnerOutput:
    """Every sampling target of `batch` draws `token`."""
    targets = batch.sampling_targets
    return ModelRunnerOutput([target.request_id for target in targets], [token] * len(targets))


def test_prompt_longer_than_budget_is_chunked_and_samples_only_at_its_end() -> None:
    scheduler = make_scheduler(budget=16)
    request = make_request("a", 40)
    scheduler.add_request(request)
    assert run_step(scheduler) == [("a", 16)]
    assert request.num_computed_tokens == 16 and request.num_generated_tokens == 0
    assert request.status == RequestStatus.PREFILLING
    assert run_step(scheduler) == [("a", 16)]
    assert run_step(scheduler) == [("a", 8)]
    assert request.num_generated_tokens == 1 and request.status == RequestStatus.DECODING
    assert run_step(scheduler) == [("a", 1)]


def test_fifo_schedules_running_decodes_before_new_prompts() -> None:
    scheduler = make_scheduler(budget=10)
    scheduler.add_request(make_request("a", 6))
    assert run_step(scheduler) == [("a", 6)]
    scheduler.add_request(make_request("b", 20))
    assert run_step(scheduler) == [("a", 1), ("b", 9)]


def test_prefill_first_admits_waiting_prompts_before_decodes() -> None:
    scheduler = make_scheduler(budget=10, policy="prefill_first")
    scheduler.add_request(make_request("a", 6))
    assert run_step(scheduler) == [("a", 6)]
    scheduler.add_request(make_request("b", 20))
    assert run_step(scheduler) == [("b", 10)]
    assert run_step(scheduler) == [("a", 1), ("b", 9)]


def test_prompts_share_of_a_step_is_bounded_only_while_some_request_decodes() -> None:
    scheduler = make_scheduler(budget=16, prefill_while_decoding=5)
    scheduler.add_request(make_request("a", 20))
    assert run_step(scheduler) == [("a", 16)]  # nothing decodes yet: the whole budget
    assert run_step(scheduler) == [("a", 4)]
    scheduler.add_request(make_request("b", 12))
    assert run_step(scheduler) == [("a", 1), ("b", 5)]
    scheduler.add_request(make_request("c", 3))
    assert run_step(scheduler) == [("a", 1), ("b", 5)]  # c waits: the prompts' 5 tokens are spent
    assert run_step(scheduler) == [("a", 1), ("b", 2), ("c", 3)]
    assert run_step(scheduler) == [("a", 1), ("b", 1), ("c", 1)]


def test_decodes_are_never_cut_by_the_prompts_bound() -> None:
    scheduler = make_scheduler(budget=16, prefill_while_decoding=2)
    for index in range(6):
        scheduler.add_request(make_request(f"r{index}", 2))
    assert run_step(scheduler) == [(f"r{index}", 2) for index in range(6)]
    scheduler.add_request(make_request("p", 9))
    assert run_step(scheduler) == [*((f"r{index}", 1) for index in range(6)), ("p", 2)]


def test_prefill_first_keeps_the_bound_while_some_request_decodes() -> None:
    scheduler = make_scheduler(budget=10, policy="prefill_first", prefill_while_decoding=4)
    scheduler.add_request(make_request("a", 6))
    assert run_step(scheduler) == [("a", 6)]
    scheduler.add_request(make_request("b", 20))
    assert run_step(scheduler) == [("b", 4), ("a", 1)]


def test_request_that_does_not_fit_waits_instead_of_failing() -> None:
    scheduler = make_scheduler(num_blocks=3, block_size=4, budget=64)
    scheduler.add_request(make_request("a", 8, max_new_tokens=2))
    scheduler.add_request(make_request("b", 8, max_new_tokens=2))
    assert run_step(scheduler) == [("a", 8)]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    assert run_step(scheduler) == [("a", 1)]
    assert scheduler.running == [] and run_step(scheduler) == [("b", 8)]


def test_newest_request_is_preempted_when_an_older_one_needs_a_block() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64)
    old, new = make_request("old", 3, max_new_tokens=6), make_request("new", 8, max_new_tokens=6)
    scheduler.add_request(old)
    scheduler.add_request(new)
    assert run_step(scheduler) == [("old", 3), ("new", 8)]
    assert run_step(scheduler) == [("old", 1), ("new", 1)]
    # old now needs a 2nd block for its 5th token while new holds the other 3 blocks: new is preempted.
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["old"] and batch.preempted_req_ids == ["new"]
    scheduler.update_from_output(batch, sampled(batch, 7))
    assert new.status == RequestStatus.PENDING and new.num_computed_tokens == 0
    assert new.generated_tokens == [7, 7]
    assert list(scheduler.waiting) == [new]
    scheduler.kv_manager.check_integrity()
    while scheduler.num_unfinished:
        run_step(scheduler)
    assert old.generated_tokens == [7] * 6 and new.generated_tokens == [7] * 6
    assert scheduler.kv_manager.pool.is_whole


def test_cancel_frees_blocks_and_ignores_unknown_ids() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 3))
    run_step(scheduler)
    assert scheduler.cancel("a").status == RequestStatus.CANCELLED
    assert scheduler.cancel("a") is None and scheduler.cancel("nope") is None
    assert [r.request_id for r in scheduler.running] == ["b"]
    scheduler.cancel("b")
    assert scheduler.kv_manager.pool.is_whole and scheduler.num_unfinished == 0
