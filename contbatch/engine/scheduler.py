"""`Scheduler`: decides each step which requests compute how many tokens, under a token budget.

There are no prefill and decode phases: every request has `num_tokens` tokens of which `num_computed_tokens` are
in the cache, and each step the scheduler lets requests catch up, at most `max_batch_tokens` tokens in all. A
prompt longer than the remaining budget is computed in chunks over several steps (chunked prefill).
"""

from __future__ import annotations

from collections import deque

from contbatch.engine.batch import SchedulerOutput
from contbatch.engine.kv_cache_manager import KVCacheManager
from contbatch.engine.request import Request
from contbatch.outputs import RequestStatus


class Scheduler:
    """Owns the waiting queue and the running list.

    Policies (`scheduler_type`):
      - "fifo": running requests first, in admission order, then waiting requests in arrival order;
      - "prefill_first": waiting requests are admitted first, running requests share what budget is left.

    Memory: blocks are allocated as tokens are scheduled. When a running request cannot get a block, the most
    recently admitted running request is preempted (its blocks are freed, its generated tokens kept, and it
    waits at the head of the queue to be recomputed), so no request fails because others hold the memory.
    """

    def __init__(self, kv_manager: KVCacheManager, max_batch_tokens: int, policy: str = "fifo") -> None:
        self.kv_manager = kv_manager
        self.max_batch_tokens = max_batch_tokens
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        """Chooses this step's batch and allocates the blocks its tokens need."""
        batch = SchedulerOutput()
        budget = self.max_batch_tokens
        if self.policy == "prefill_first":
            budget = self._admit_waiting(batch, budget)
            self._schedule_running(batch, budget)
        else:
            budget = self._schedule_running(batch, budget)
            self._admit_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: SchedulerOutput, budget: int) -> int:
        """Schedules the running requests that are not in `batch` yet, oldest first."""
        scheduled = {id(request) for request in batch.requests}
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status == RequestStatus.PENDING or id(request) in scheduled:
                continue
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, request.num_computed_tokens + num_tokens, batch, scheduled):
                continue
            self.kv_manager.allocate_slots(request.request_id, request.num_computed_tokens + num_tokens)
            batch.add(request, num_tokens)
            scheduled.add(id(request))
            budget -= num_tokens
        return budget

    def _make_room(self, request: Request, num_tokens: int, batch: SchedulerOutput, scheduled: set[int]) -> bool:
        """Preempts the newest unscheduled requests until `request` can hold `num_tokens`. False when
        `request` itself had to be preempted."""
        while not self.kv_manager.can_allocate(request.request_id, num_tokens):
            victim = self._preempt_newest(batch, scheduled)
            if victim is None or victim is request:
                return False
        return True

    def _preempt_newest(self, batch: SchedulerOutput, scheduled: set[int]) -> Request | None:
        """Preempts the most recently admitted running request that is not already in `batch`."""
        for position in range(len(self.running) - 1, -1, -1):
            victim = self.running[position]
            if id(victim) in scheduled:
                continue
            del self.running[position]
            self.kv_manager.free(victim.request_id)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PENDING
            self.waiting.appendleft(victim)
            batch.preempted.append(victim)
            return victim
        return None

    def _admit_waiting(self, batch: SchedulerOutput, budget: int) -> int:
        """Admits waiting requests in order while the budget and the free blocks allow (head-of-line: a request
        that does not fit yet stops admission, so arrival order is kept). A request starts from its longest
        cached prefix; one whose next block another request is computing right now is skipped for this step,
        to share that block once it is computed."""
        kv = self.kv_manager
        deferred: list[Request] = []
        while self.waiting and budget > 0:
            request = self.waiting.popleft()
            prefix = kv.cached_prefix(request)
            if kv.is_being_computed(request, len(prefix)):
                deferred.append(request)
                continue
            num_cached = len(prefix) * kv.block_size
            num_tokens = min(request.num_tokens - num_cached, budget)
            if not kv.can_allocate(request.request_id, num_cached + num_tokens, prefix):
                self.waiting.appendleft(request)
                break
            kv.start_with_prefix(request, prefix)
            kv.allocate_slots(request.request_id, num_cached + num_tokens)
            request.num_computed_tokens = num_cached
            if request.num_generated_tokens == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.PREFILLING
            self.running.append(request)
            batch.add(request, num_tokens)
            budget -= num_tokens
        self.waiting.extendleft(reversed(deferred))
        return budget

    def update(self, batch: SchedulerOutput, sampled: list[int], logprobs: list[float] | None, now: float,
               top_logprobs: list[list[tuple[int, float]]] | None = None) -> list[Request]:
        """Advances every request of `batch` by its scheduled tokens and appends the sampled tokens (one per
        request that samples, in batch order, with their logprobs and top alternatives when given). Returns the
        requests that produced a token, finished or not; finished ones leave the running list and give back
        their blocks."""
        produced: list[Request] = []
        sample_index = 0
        for index, request in enumerate(batch.requests):
            samples = batch.sampling[index]
            request.num_computed_tokens += batch.num_scheduled_tokens[index]
            self.kv_manager.cache_computed_blocks(request)
            self.kv_manager.free_out_of_window(request)
            if not samples or request.is_finished:
                sample_index += samples
                continue
            logprob = logprobs[sample_index] if logprobs is not None and request.params.wants_logprobs else None
            top = None
            if top_logprobs is not None and request.params.top_logprobs:
                top = top_logprobs[sample_index][: request.params.top_logprobs]
            request.append_token(sampled[sample_index], logprob, now, top)
            sample_index += 1
            produced.append(request)
        self._drop_finished()
        return produced

    def finish_requests(self, requests: list[Request], status: RequestStatus, reason: str,
                        error: str | None = None) -> None:
        """Ends `requests` (e.g. a failed batch, or cancelled ids) and frees their blocks."""
        for request in requests:
            request.finish(status, reason, error)
        self._drop_finished()

    def cancel(self, request_id: str) -> Request | None:
        """Cancels a waiting or running request; returns it, or None when the id is unknown or finished."""
        for request in (*self.waiting, *self.running):
            if request.request_id == request_id:
                self.finish_requests([request], RequestStatus.CANCELLED, "cancelled")
                return request
        return None

    def _drop_finished(self) -> None:
        for request in self.running:
            if request.is_finished:
                self.kv_manager.free(request.request_id)
        self.running = [request for request in self.running if not request.is_finished]
        if any(request.is_finished for request in self.waiting):
            for request in self.waiting:
                if request.is_finished:
                    self.kv_manager.free(request.request_id)
            self.waiting = deque(request for request in self.waiting if not request.is_finished)

