"""Beam search inside continuous batching: each beam is a request of the batch, beams share their common prefix's
KV blocks (copy-on-write forks), and each group chooses its next beams with `generate`'s arithmetic, so that
sequences and scores are `generate(num_beams=k)`'s.

A group waits until every live beam has computed its last token (the scheduler never schedules a beam with
nothing to compute), then `BeamGroup.advance` ranks the `beams_to_keep` best continuations of all beams, keeps
the k best that do not stop as the next beams, and merges the stopping ones into its k finished hypotheses
(normalised by `length ** length_penalty`), exactly as `GenerationMixin._beam_search` does for one prompt. Only
the group's final outputs leave the engine: the beams' own deltas are internal."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from contbatch.engine.outputs import RequestDelta
from contbatch.engine.request import Request, RequestStatus
from contbatch.engine.scheduler import Scheduler

NEG = -1.0e9


@dataclass(eq=False)
class BeamGroup:
    """One prompt's beam search: its live beams (k of them, some possibly the same request while they all are
    the prompt), their running scores, and its k finished hypotheses (generated tokens and scores)."""

    request_id: str
    output_ids: list[str]
    beams: list[Request]
    running_scores: torch.Tensor
    finished: list[list[int]]
    finished_scores: torch.Tensor
    is_sent_finished: torch.Tensor
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    heuristic_unsatisfied: bool = True
    num_generated: int = 0

    @classmethod
    def start(cls, request: Request, output_ids: list[str]) -> BeamGroup:
        k = request.params.num_beams
        scores = torch.full((k,), NEG, dtype=torch.float32)
        scores[0] = 0.0
        return cls(request.request_id.rsplit("#", 1)[0], output_ids, [request] * k, scores, [[] for _ in range(k)],
                   torch.full((k,), NEG, dtype=torch.float32), torch.zeros(k, dtype=torch.bool))

    @property
    def live(self) -> list[Request]:
        """The distinct live beam requests."""
        return list({id(beam): beam for beam in self.beams}.values())

    @property
    def ready(self) -> bool:
        return all(beam.request_id in self.rows for beam in self.live)

    def advance(self) -> tuple[bool, list[tuple[int, int]]]:
        """Ranks the continuations of the beams' rows (each [vocab] processed log-probabilities); returns whether
        the search is over and the next beams as (index of the parent in `beams`, token)."""
        params = self.beams[0].params
        k, eos = params.num_beams, torch.tensor(params.eos_token_ids, dtype=torch.long)
        rows = torch.stack([self.rows[beam.request_id] for beam in self.beams])
        self.rows.clear()
        vocab = rows.shape[1]
        keep = max(2, 1 + len(params.eos_token_ids)) * k
        flat = (rows + self.running_scores[:, None]).reshape(1, -1)
        top_scores, top_indices = torch.topk(flat, k=keep)
        top_scores, top_indices = top_scores[0], top_indices[0]
        parents, tokens = top_indices // vocab, top_indices % vocab
        hits = torch.isin(tokens, eos) | (self.num_generated + 1 >= params.max_new_tokens)
        running = top_scores + hits.to(torch.float32) * NEG
        chosen = torch.topk(running, k=k)[1]
        self._merge_finished(top_scores, parents, tokens, hits, k)
        self.running_scores = running[chosen]
        self.num_generated += 1
        self._update_heuristic()
        exists_open = not (bool(self.is_sent_finished.all()) and params.early_stopping is True)
        done = not (self.heuristic_unsatisfied and exists_open and not bool(hits.all()))
        return done, [(int(parents[i]), int(tokens[i])) for i in chosen]

    def _merge_finished(self, top_scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor,
                        hits: torch.Tensor, k: int) -> None:
        """`_update_finished_beams`: the stopping continuations among the k best join the finished hypotheses
        when they beat them."""
        params = self.beams[0].params
        ranks = torch.arange(hits.shape[0]) < k
        just_finished = hits & ranks
        scores = top_scores / ((self.num_generated + 1) ** params.length_penalty)
        if bool(self.is_sent_finished.all()) and params.early_stopping is True:
            scores = scores + NEG
        if not self.heuristic_unsatisfied:
            scores = scores + NEG
        scores = scores + (~just_finished).to(torch.float32) * NEG
        merged = torch.cat((self.finished_scores, scores))
        flags = torch.cat((self.is_sent_finished, just_finished))
        best = torch.topk(merged, k=k)[1].tolist()
        self.finished = [self.finished[i] if i < k else
                         [*self.beams[int(parents[i - k])].generated_tokens, int(tokens[i - k])] for i in best]
        self.finished_scores, self.is_sent_finished = merged[best], flags[best]

    def _update_heuristic(self) -> None:
        """`_check_early_stop_heuristic`: could a running beam still beat the worst finished hypothesis?"""
        params = self.beams[0].params
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            length = params.max_new_tokens
        else:
            length = self.num_generated
        best_running = self.running_scores[:1] / (length ** params.length_penalty)
        worst = torch.where(self.is_sent_finished, self.finished_scores.min(), torch.tensor(NEG))
        self.heuristic_unsatisfied = self.heuristic_unsatisfied and bool((best_running > worst).any())

    def final_deltas(self, weights_version: int) -> list[RequestDelta]:
        """The outputs: the best `len(output_ids)` hypotheses, best first, with their scores."""
        eos = set(self.beams[0].params.eos_token_ids)
        now = time.time()
        return [RequestDelta(output_id, RequestStatus.FINISHED, now, tuple(tokens),
                             finish_reason="stop" if tokens and tokens[-1] in eos else "length",
                             weights_version=weights_version, sequence_score=float(score))
                for output_id, tokens, score in zip(self.output_ids, self.finished, self.finished_scores,
                                                    strict=False)]

    def failed_deltas(self, status: RequestStatus, reason: str, error: str | None) -> list[RequestDelta]:
        now = time.time()
        return [RequestDelta(output_id, status, now, finish_reason=reason, error=error)
                for output_id in self.output_ids]


class BeamSearch:
    """The engine's beam groups: starts them, feeds them their beams' rows after each step, turns their choices
    into requests (continued, forked or dropped), and reports only their final outputs. Engine thread only."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._owner: dict[str, BeamGroup] = {}
        self._pending: list[RequestDelta] = []
        self._ids = itertools.count(1)

    def owns(self, request_id: str) -> bool:
        """Whether `request_id` is a beam or an output of a live group."""
        return request_id in self._owner

    @property
    def is_active(self) -> bool:
        """Whether a beam group is running."""
        return bool(self._owner)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def add(self, request: Request) -> None:
        """Starts the group of `request` (`num_beams > 1`): its outputs are `request_id` (one) or
        `request_id_j`, and its first beam computes the prompt."""
        base, n = request.request_id, request.params.num_return_sequences
        output_ids = [base] if n == 1 else [f"{base}_{j}" for j in range(n)]
        taken = [rid for rid in [*output_ids, f"{base}#0"] if rid in self._owner or rid in self.scheduler.requests]
        if taken:
            raise ValueError(f"request {base!r}: a request with the id {taken[0]!r} is already running")
        beam = Request(f"{base}#0", list(request.prompt_ids), request.params)
        group = BeamGroup.start(beam, output_ids)
        for rid in [*output_ids, beam.request_id]:
            self._owner[rid] = group
        self.scheduler.add_request(beam)

    def update(self, deltas: list[RequestDelta], rows: dict[str, torch.Tensor]) -> list[RequestDelta]:
        """The step's deltas without the beams' own, plus the outputs of the groups that ended; advances every
        group whose beams all computed their last token, and fails the groups a failed beam belongs to."""
        for request_id, row in rows.items():
            self._owner[request_id].rows[request_id] = row
        out = [delta for delta in deltas if delta.request_id not in self._owner]
        for delta in deltas:
            group = self._owner.get(delta.request_id)
            if group is not None and delta.status == RequestStatus.FAILED:
                self._end(group, group.failed_deltas(RequestStatus.FAILED, "error", delta.error))
        touched = dict.fromkeys(self._owner[rid] for rid in rows if rid in self._owner)
        for group in touched:
            if group.ready:
                self._advance(group)
        out += self._pending
        self._pending = []
        return out

    def cancel(self, request_id: str) -> RequestDelta | None:
        """Cancels the group of `request_id`; returns the delta of `request_id` if it is an output (the group's
        other outputs come with the next step)."""
        group = self._owner[request_id]
        self._end(group, group.failed_deltas(RequestStatus.CANCELLED, "cancelled", None))
        mine = [delta for delta in self._pending if delta.request_id == request_id]
        self._pending = [delta for delta in self._pending if delta.request_id != request_id]
        return mine[0] if mine else None

    def _advance(self, group: BeamGroup) -> None:
        done, choices = group.advance()
        if done:
            self._end(group, group.final_deltas(self.scheduler.weights_version))
            return
        old, continued, beams = group.live, set(), []
        appends: list[tuple[Request, int]] = []
        for parent_index, token in choices:
            parent = group.beams[parent_index]
            if id(parent) not in continued:
                continued.add(id(parent))
                beams.append(parent)
                appends.append((parent, token))
                continue
            child = Request(f"{group.request_id}#{next(self._ids)}", parent.prompt_ids, parent.params,
                            token_ids=list(parent.token_ids))
            self._owner[child.request_id] = group
            self.scheduler.fork_computed(parent, child)
            child.token_ids.append(token)
            beams.append(child)
        for parent, token in appends:
            parent.token_ids.append(token)
            if parent.status == RequestStatus.PREFILLING:
                parent.status = RequestStatus.DECODING
        group.beams = beams
        self._drop([beam for beam in old if id(beam) not in continued])

    def _end(self, group: BeamGroup, deltas: list[RequestDelta]) -> None:
        """Drops the group's beams and queues its final `deltas`."""
        self._drop(group.live)
        for request_id in [rid for rid, owner in self._owner.items() if owner is group]:
            del self._owner[request_id]
        self._pending += deltas

    def _drop(self, beams: list[Request]) -> None:
        for beam in beams:
            self._owner.pop(beam.request_id, None)
        self.scheduler.finish_requests([b for b in beams if not b.is_finished], RequestStatus.CANCELLED, "cancelled")
