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

    n samples of one prompt: a request whose `leader` has not sampled yet waits beside it (a follower) instead
    of in the queue; the step that completes the leader's prompt samples the followers' first tokens from the
    same logits and forks the leader's blocks to them. If the leader ends before that, the first follower
    becomes the leader of the others and joins the queue.

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
        self._followers: dict[str, list[Request]] = {}

    def add_request(self, request: Request) -> None:
        leader = request.leader
        if leader is not None and not leader.is_finished and leader.num_generated_tokens == 0:
            self._followers.setdefault(leader.request_id, []).append(request)
        else:
            self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + sum(map(len, self._followers.values()))

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
            batch.block_copies += self.kv_manager.allocate_slots(request, request.num_computed_tokens + num_tokens)
            batch.add(request, num_tokens, self._followers.get(request.request_id))
            scheduled.add(id(request))
            budget -= num_tokens
        return budget

    def _make_room(self, request: Request, num_tokens: int, batch: SchedulerOutput, scheduled: set[int]) -> bool:
        """Preempts the newest unscheduled requests until `request` can hold `num_tokens`. False when
        `request` itself had to be preempted."""
        while not self.kv_manager.can_allocate(request, num_tokens):
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
            hit = kv.cached_prefix(request)
            num_cached = hit.num_blocks * kv.block_size if hit else 0
            if kv.is_being_computed(request, num_cached // kv.block_size):
                deferred.append(request)
                continue
            num_tokens = min(request.num_tokens - num_cached, budget)
            if not kv.can_allocate(request, num_cached + num_tokens, hit):
                self.waiting.appendleft(request)
                break
            kv.start_with_prefix(request, hit)
            request.num_computed_tokens = num_cached
            batch.block_copies += kv.allocate_slots(request, num_cached + num_tokens)
            if request.num_generated_tokens == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.PREFILLING
            self.running.append(request)
            batch.add(request, num_tokens, self._followers.get(request.request_id))
            budget -= num_tokens
        self.waiting.extendleft(reversed(deferred))
        return budget

    def update(self, batch: SchedulerOutput, sampled: list[int], logprobs: list[float] | None, now: float,
               top_logprobs: list[list[tuple[int, float]]] | None = None) -> list[Request]:
        """Advances every request of `batch` by its scheduled tokens and appends the sampled tokens (one per
        request of `batch.sampling_requests`, in that order, with their logprobs and top alternatives when given);
        followers are forked from their leader first. Returns the requests that produced a token, finished or
        not; finished ones leave the running list and give back their blocks."""
        produced: list[Request] = []
        sample_index = 0
        for index, request in enumerate(batch.requests):
            request.num_computed_tokens += batch.num_scheduled_tokens[index]
            self.kv_manager.cache_computed_blocks(request)
            self.kv_manager.free_out_of_window(request)
            if not batch.sampling[index]:
                continue
            samplers = [request, *batch.followers.get(index, ())]
            if request.is_finished:
                sample_index += len(samplers)
                continue
            for follower in samplers[1:]:
                self._fork(request, follower)
            for sampler in samplers:
                logprob = logprobs[sample_index] if logprobs is not None and sampler.params.wants_logprobs else None
                top = None
                if top_logprobs is not None and sampler.params.top_logprobs:
                    top = top_logprobs[sample_index][: sampler.params.top_logprobs]
                sampler.append_token(sampled[sample_index], logprob, now, top)
                produced.append(sampler)
                sample_index += 1
        self._drop_finished()
        return produced

    def _fork(self, leader: Request, follower: Request) -> None:
        """Starts `follower` from `leader`'s just computed prompt, sharing its blocks."""
        followers = self._followers.get(leader.request_id, [])
        followers.remove(follower)
        if not followers:
            self._followers.pop(leader.request_id, None)
        self.kv_manager.fork(leader, follower)
        follower.leader = None
        follower.num_computed_tokens = leader.num_computed_tokens
        follower.num_cached_tokens = follower.num_prompt_tokens
        self.running.append(follower)

    def finish_requests(self, requests: list[Request], status: RequestStatus, reason: str,
                        error: str | None = None) -> None:
        """Ends `requests` (e.g. a failed batch, or cancelled ids) and frees their blocks."""
        for request in requests:
            request.finish(status, reason, error)
        self._drop_finished()

    def cancel(self, request_id: str) -> Request | None:
        """Cancels a waiting or running request; returns it, or None when the id is unknown or finished."""
        followers = [follower for group in self._followers.values() for follower in group]
        for request in (*self.waiting, *self.running, *followers):
            if request.request_id == request_id:
                self.finish_requests([request], RequestStatus.CANCELLED, "cancelled")
                return request
        return None

    def _drop_finished(self) -> None:
        for leader_id, group in list(self._followers.items()):
            group[:] = [follower for follower in group if not follower.is_finished]
            if not group:
                del self._followers[leader_id]
        finished = [request for request in (*self.running, *self.waiting) if request.is_finished]
        if not finished:
            return
        for request in finished:
            self.kv_manager.free(request.request_id)
            self._promote_follower(request.request_id)
        self.running = [request for request in self.running if not request.is_finished]
        self.waiting = deque(request for request in self.waiting if not request.is_finished)

    def _promote_follower(self, leader_id: str) -> None:
        """A leader ended before its prompt was computed: its first follower leads the others, from the front of
        the queue (they arrived with the leader)."""
        followers = self._followers.pop(leader_id, None)
        if followers:
            new_leader, *rest = followers
            new_leader.leader = None
            for follower in rest:
                follower.leader = new_leader
            if rest:
                self._followers[new_leader.request_id] = rest
            self.waiting.appendleft(new_leader)
