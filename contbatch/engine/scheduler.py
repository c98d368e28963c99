"""`Scheduler`: decides each step which requests compute how many tokens, under a token budget.

There are no prefill and decode phases: every request has `num_tokens` tokens of which `num_computed_tokens` are
in the cache, and each step the scheduler lets requests catch up, at most `max_batch_tokens` tokens in all. A
prompt longer than the remaining budget is computed in chunks over several steps (chunked prefill). While some
request decodes, prompts (requests computing more than one token) get at most `max_prefill_tokens_while_decoding`
of a step's tokens: new prompts then delay the requests already generating by a bounded step (stall-free batching).
"""

from __future__ import annotations

import time
from collections import deque

from contbatch.engine.batch import PromptLogprobsTask, SamplingTarget, ScheduledRequest, SchedulerOutput, StepBudget
from contbatch.engine.deltas import DeltaJournal
from contbatch.engine.kv_cache_manager import KVCacheManager
from contbatch.engine.outputs import EventType, ModelRunnerOutput, PromptLogprob, RequestDelta
from contbatch.engine.request import Request, RequestStatus


class Scheduler:
    """Owns every unfinished request: the waiting queue, the running list, and requests waiting on a fork.

    Policies (`policy`):
      - "fifo": running requests first, in admission order, then waiting requests in arrival order;
      - "prefill_first": waiting requests are admitted first, running requests share what budget is left.

    Fork (`fork`): a child forked from a parent whose prompt is not computed yet waits beside it (a follower);
    the step that completes the parent's prompt samples the followers' first tokens from the same logits and
    forks the parent's blocks to them. If the parent ends before that, its first follower takes its place.
    A child forked later starts from the parent's whole sequence, sharing its blocks at once.

    Memory: blocks are allocated as tokens are scheduled. When a running request cannot get a block, the most
    recently admitted running request is preempted (its blocks are freed, its generated tokens kept, and it
    waits at the head of the queue to be recomputed), so no request fails because others hold the memory.

    Prompt logprobs: each chunk of a request that still needs them carries a `PromptLogprobsTask` for the prompt
    tokens it scores and has not reported yet (`Request.num_prompt_logprobs`), so a prompt recomputed after
    preemption reports nothing twice. Such a request takes from the prefix cache only the positions before the
    first one whose logits it needs (`Request.max_cached_tokens`). Followers (n samples) receive their
    leader's entries as they are computed.

    Score-only requests (`max_new_tokens=0`) compute their prompt but its last token, sample nothing and finish
    with reason "length" in the step that completes it, with their followers that are score-only too.
    """

    def __init__(self, kv_manager: KVCacheManager, max_batch_tokens: int, policy: str = "fifo",
                 max_prefill_tokens_while_decoding: int | None = None) -> None:
        self.kv_manager = kv_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        self.policy = policy
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.weights_version = 0
        self._followers: dict[str, list[Request]] = {}
        self._journal = DeltaJournal()

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add_request(self, request: Request) -> None:
        """Queues a new request (its id must not be in use)."""
        self._register(request)
        self.waiting.append(request)

    def fork(self, parent: Request, child: Request) -> None:
        """Adds `child`, whose prompt is `parent`'s whole token sequence, sharing what `parent` computed.

        Before `parent` has sampled its first token, `child` waits for `parent`'s prompt and samples its first
        token from the same logits row (n samples of a prompt: one prefill). After, `child` shares `parent`'s
        blocks at once (copy-on-write) and computes only `parent`'s last sampled token itself; a `parent` that
        holds no blocks (preempted) just has its sequence copied.

        Prompt logprobs: a child forked before `parent`'s first token must ask for the same `prompt_logprobs`
        (it receives `parent`'s entries), and a child asking for them must be forked before `parent` computed
        any of its prompt; else raises ValueError, adding nothing.
        """
        while parent.leader is not None:
            parent = parent.leader
        parent.check_fork_prompt_logprobs(child)
        self._register(child)
        if parent.num_generated_tokens == 0:
            child.leader = parent
            self._followers.setdefault(parent.request_id, []).append(child)
        elif self.kv_manager.holds(parent.request_id):
            self._start_forked(parent, child)
        else:
            self.waiting.append(child)

    def fork_computed(self, parent: Request, child: Request) -> None:
        """Adds `child`, whose tokens extend `parent`'s computed ones (a beam continuing another's sequence),
        sharing `parent`'s blocks (copy-on-write); a `parent` holding no blocks (preempted) has the child wait
        and compute its tokens itself."""
        self._register(child)
        if self.kv_manager.holds(parent.request_id):
            self._start_forked(parent, child)
        else:
            self.waiting.append(child)

    def preempt_idle(self) -> bool:
        """Preempts the running requests that have nothing to compute (beams waiting for their group), giving
        their blocks to the waiting requests; returns whether there were any."""
        idle = [request for request in self.running
                if request.num_computed_tokens >= request.num_tokens_to_compute and not request.num_in_flight_tokens]
        for request in idle:
            self.running.remove(request)
            self._requeue(request)
            self.waiting.append(request)
        return bool(idle)

    def _requeue(self, request: Request) -> None:
        """Frees a preempted request's blocks; it will recompute its tokens."""
        self.kv_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PENDING
        self._event(request, EventType.PREEMPTED)

    def _register(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._event(request, EventType.QUEUED)

    def _event(self, request: Request, kind: EventType) -> None:
        self._journal.event(request.request_id, kind)

    def _start_forked(self, parent: Request, child: Request) -> None:
        """Runs `child` from `parent`'s computed tokens, sharing its blocks."""
        self.kv_manager.fork(parent, child)
        child.leader = None
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = min(parent.num_computed_tokens, child.num_prompt_tokens)
        child.status = RequestStatus.PREFILLING
        self.running.append(child)
        self._event(child, EventType.SCHEDULED)

    # --- scheduling ------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Chooses this step's batch and allocates the blocks its tokens need."""
        output = SchedulerOutput()
        decoding = any(request.status == RequestStatus.DECODING for request in self.running)
        budget = StepBudget.of(self.max_batch_tokens, self.max_prefill_tokens_while_decoding if decoding else None)
        if self.policy == "prefill_first":
            self._admit_waiting(output, budget)
            self._schedule_running(output, budget)
        else:
            self._schedule_running(output, budget)
            self._admit_waiting(output, budget)
        return output

    def _add_to_batch(self, output: SchedulerOutput, request: Request, num_tokens: int) -> None:
        """Appends `num_tokens` of `request` from its `next_position` to `output`; an awaited token (sampled by
        the step in flight) goes in as a placeholder, `carried`, filled in once that step has sampled it."""
        start = request.next_position
        end = start + num_tokens
        token_ids = request.token_ids[start:end]
        carried = num_tokens - len(token_ids)
        samplers: tuple[SamplingTarget, ...] = ()
        if end == len(request.token_ids) + request.num_awaited_tokens and not request.is_score_only:
            if followers := self._followers.get(request.request_id):
                samplers = (request.sampling_target, *[follower.sampling_target for follower in followers])
            else:
                samplers = (request.sampling_target,)
            request.num_awaited_tokens += request.tokens_appended_by(samplers)
        output.requests.append(ScheduledRequest(
            request.request_id, token_ids + [0] * carried if carried else token_ids, start,
            self.kv_manager.block_tables(request.request_id), samplers,
            request.prompt_logprobs_task(end) if request.params.prompt_logprobs is not None else None, carried > 0,
        ))
        request.num_in_flight_tokens += num_tokens

    def _schedule_running(self, output: SchedulerOutput, budget: StepBudget) -> None:
        """Schedules the running requests that are not in `output` yet, oldest first, from `budget`."""
        scheduled = {scheduled.request_id for scheduled in output.requests}
        for request in list(self.running):
            if budget.tokens <= 0:
                break
            if request.status == RequestStatus.PENDING or request.request_id in scheduled:
                continue
            if request.num_in_flight_tokens and (not request.can_schedule_ahead or (
                    request.num_awaited_tokens and request.request_id in self._followers)):
                continue
            start = request.num_computed_tokens + request.num_in_flight_tokens
            wanted = request.num_tokens_to_compute + request.num_awaited_tokens - start
            num_tokens = budget.allowance(wanted)
            if num_tokens <= 0:  # a beam waiting for its group to choose its next token, or no chunk budget left
                continue
            if (copies := self._allocate(request, start + num_tokens, output, scheduled)) is None:
                continue
            if copies:
                output.block_copies += copies
            self._add_to_batch(output, request, num_tokens)
            scheduled.add(request.request_id)
            budget.spend(wanted, num_tokens)

    def _allocate(self, request: Request, num_tokens: int, output: SchedulerOutput,
                  scheduled: set[str]) -> list[tuple[int, int]] | None:
        """Grows `request` to `num_tokens` tokens, preempting newer ones to fit: its block copies (None: preempted)."""
        while (copies := self.kv_manager.try_allocate(request, num_tokens)) is None:
            victim = self._preempt_newest(output, scheduled)
            if victim is None or victim is request:
                return None
        return copies

    def _preempt_newest(self, output: SchedulerOutput, scheduled: set[str]) -> Request | None:
        """Preempts the most recently admitted running request that is not already in `output`."""
        for position in range(len(self.running) - 1, -1, -1):
            victim = self.running[position]
            if victim.request_id in scheduled or victim.num_in_flight_tokens:
                continue
            del self.running[position]
            self._requeue(victim)
            self.waiting.appendleft(victim)
            output.preempted_req_ids.append(victim.request_id)
            return victim
        return None

    def _admit_waiting(self, output: SchedulerOutput, budget: StepBudget) -> None:
        """Admits waiting requests in order while the budget and the free blocks allow (head-of-line: a request
        that does not fit yet stops admission, so arrival order is kept). A request starts from its longest
        cached prefix; one whose next block another request is computing right now is skipped for this step,
        to share that block once it is computed."""
        kv = self.kv_manager
        deferred: list[Request] = []
        while self.waiting and budget.tokens > 0:
            request = self.waiting.popleft()
            hit = kv.cached_prefix(request)
            num_cached = hit.num_tokens(kv.block_size) if hit else 0
            if kv.is_being_computed(request, num_cached // kv.block_size):
                deferred.append(request)
                continue
            wanted = request.num_tokens_to_compute - num_cached
            num_tokens = budget.allowance(wanted)
            if num_tokens <= 0 or not kv.can_allocate(request, num_cached + num_tokens, hit):
                self.waiting.appendleft(request)
                break
            kv.start_with_prefix(request, hit)
            request.num_computed_tokens = num_cached
            output.block_copies += kv.allocate_slots(request, num_cached + num_tokens)
            if request.num_generated_tokens == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.PREFILLING
            self.running.append(request)
            self._event(request, EventType.SCHEDULED)
            self._add_to_batch(output, request, num_tokens)
            budget.spend(wanted, num_tokens)
        self.waiting.extendleft(reversed(deferred))

    # --- results ---------------------------------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestDelta]:
        """Advances every request of `output` by its scheduled tokens and appends the tokens sampled in
        `result` (forking waiting followers from their leader first). Finished requests leave and give back
        their blocks. Returns a delta for every request that produced a token or went through an event.

        `result` has a row for each of `output`'s sampling targets still unfinished: a request that ended while
        its step was in flight (async batching) is skipped."""
        now = time.time()
        produced: list[tuple[Request, int]] = []
        scored: list[Request] = []
        row = 0
        for scheduled in output.requests:
            request = self.requests.get(scheduled.request_id)
            if request is None:  # ended while its step was in flight (async batching): nothing to record
                row += sum(target.request_id in self.requests for target in scheduled.samplers)
                continue
            num_tokens = len(scheduled.token_ids)
            request.num_in_flight_tokens -= num_tokens
            request.num_computed_tokens += num_tokens
            if scheduled.samplers:
                request.num_awaited_tokens -= request.tokens_appended_by(scheduled.samplers)
            if scheduled.prompt_logprobs is not None:
                self._record_prompt_logprobs(request, scheduled.prompt_logprobs, result)
            if request.is_score_only and request.num_computed_tokens == request.num_tokens_to_compute:
                scored += self._finish_scored(request)
            self.kv_manager.cache_computed_blocks(request)
            self.kv_manager.free_unreachable(request)
            for target in scheduled.samplers:
                sampler = self.requests.get(target.request_id)
                if sampler is None:  # cancelled while its step was in flight: it was not sampled
                    continue
                if sampler is not request:
                    self._fork_follower(request, sampler)
                if sampler.params.num_beams > 1:  # its group chooses its next token (see BeamSearch)
                    row += 1
                    continue
                sampler.append_token(result.sampled_token_ids[row])
                produced.append((sampler, row))
                row += 1
        deltas = [self._delta(request, now, result, index) for request, index in produced]
        deltas += [self._delta(request, now) for request in scored]
        deltas += self._event_deltas(now)
        self._drop_finished()
        return deltas

    def _record_prompt_logprobs(self, request: Request, task: PromptLogprobsTask, result: ModelRunnerOutput) -> None:
        """Queues the entries of `task` for the next delta of `request` and of its followers."""
        entries: list[PromptLogprob | None] = [None] * (task.first_scored - task.first)
        entries += result.prompt_logprobs.get(request.request_id, ())
        for receiver in (request, *self._followers.get(request.request_id, ())):
            receiver.num_prompt_logprobs += len(entries)
            self._journal.add_prompt_logprobs(receiver.request_id, entries)

    def _finish_scored(self, request: Request) -> list[Request]:
        """Finishes a score-only request whose prompt is computed, and its followers that are score-only too
        (they received its prompt logprobs); returns them. Other followers wait for a leader of their own."""
        ended = [request, *(follower for follower in self._followers.get(request.request_id, ())
                            if follower.is_score_only)]
        for ending in ended:
            ending.finish(RequestStatus.FINISHED, "length")
        return ended

    def _fork_follower(self, leader: Request, follower: Request) -> None:
        """Starts `follower` from `leader`'s just computed prompt."""
        followers = self._followers[leader.request_id]
        followers.remove(follower)
        if not followers:
            del self._followers[leader.request_id]
        self._start_forked(leader, follower)

    def _delta(self, request: Request, now: float, result: ModelRunnerOutput | None = None,
               row: int = 0) -> RequestDelta:
        return self._journal.delta(request, now, self.weights_version, result, row)

    def _event_deltas(self, now: float) -> list[RequestDelta]:
        """Deltas of the requests with events or prompt logprobs but no new token (admitted, preempted, forked,
        finished, or a prompt chunk computed)."""
        return [self._delta(self.requests[request_id], now) for request_id in self._journal.pending()
                if request_id in self.requests]

    def finish_requests(self, requests: list[Request], status: RequestStatus, reason: str,
                        error: str | None = None) -> list[RequestDelta]:
        """Ends `requests` (a failed batch, a cancelled id, ...), frees their blocks, and returns the deltas of
        the requests that changed (those already finished are left as they are)."""
        now = time.time()
        ended = [request for request in requests if not request.is_finished]
        for request in ended:
            request.finish(status, reason, error)
        deltas = [self._delta(request, now) for request in ended]
        self._drop_finished()
        return deltas

    def cancel(self, request_id: str) -> RequestDelta | None:
        """Cancels an unfinished request; returns its final delta, or None when the id is unknown or finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        (delta,) = self.finish_requests([request], RequestStatus.CANCELLED, "cancelled")
        return delta

    def _drop_finished(self) -> None:
        finished = [request for request in self.requests.values() if request.is_finished]
        if not finished:
            return
        for leader_id, group in list(self._followers.items()):
            group[:] = [follower for follower in group if not follower.is_finished]
            if not group:
                del self._followers[leader_id]
        for request in finished:
            del self.requests[request.request_id]
            self._journal.forget(request.request_id)
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
