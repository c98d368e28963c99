"""`DeltaJournal`: each event and prompt-logprob entry is reported once, by the request's next delta."""

from __future__ import annotations

from contbatch.engine.deltas import DeltaJournal
from contbatch.engine.outputs import EventType, ModelRunnerOutput
from contbatch.engine.request import Request, RequestStatus
from contbatch.engine.sampling_params import SamplingParams


def test_a_delta_reports_what_is_pending_once_and_forget_drops_it() -> None:
    journal = DeltaJournal()
    scored = Request("a", [1, 2, 3], SamplingParams(max_new_tokens=2, prompt_logprobs=0, logprobs=True))
    plain = Request("b", [4, 5], SamplingParams(max_new_tokens=2))
    journal.event("b", EventType.QUEUED)
    journal.event("a", EventType.QUEUED)
    journal.add_prompt_logprobs("a", [None])
    journal.event("a", EventType.SCHEDULED)
    assert journal.pending() == ["b", "a"]

    result = ModelRunnerOutput(["a"], [9], logprobs=[-0.5])
    delta = journal.delta(scored, 1.0, 3, result, 0)
    assert [event.type for event in delta.events] == [EventType.QUEUED, EventType.SCHEDULED]
    assert (delta.new_token_ids, delta.new_logprobs, delta.new_prompt_logprobs) == ((9,), (-0.5,), (None,))
    assert delta.weights_version == 3 and delta.new_top_logprobs is None
    assert journal.pending() == ["b"]
    again = journal.delta(scored, 2.0, 3)
    assert (again.events, again.new_token_ids, again.new_prompt_logprobs) == ((), (), ())

    plain.finish(RequestStatus.CANCELLED, "cancelled")
    final = journal.delta(plain, 3.0, 0)
    assert [event.type for event in final.events] == [EventType.QUEUED, EventType.FINISHED]
    assert final.new_prompt_logprobs is None and final.finish_reason == "cancelled"
    journal.event("b", EventType.PREEMPTED)
    journal.add_prompt_logprobs("a", [None])
    journal.forget("b")
    journal.forget("a")
    assert journal.pending() == []
