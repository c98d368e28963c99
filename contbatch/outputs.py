"""Public result types: what a caller gets back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field

from contbatch.engine.outputs import PromptLogprob
from contbatch.engine.request import RequestStatus

__all__ = ["GenerationOutput", "PromptLogprob", "RequestStatus"]


@dataclass
class GenerationOutput:
    """The result of one request.

    Attributes:
        request_id: the id the request was submitted under.
        prompt_ids: the prompt's token ids, as submitted.
        generated_tokens: the tokens generated so far (all of them once the status is terminal).
        logprobs: the log-probability of each generated token, when asked for: under the raw logits, or under
            the distribution it was drawn from with `logprobs_mode="processed"`.
        status: the request's status when this output was made.
        finish_reason: "stop" (an EOS token or a stop string), "length" (max_new_tokens), "cancelled" or
            "error"; None while running.
        error: the error text of a FAILED request.
        top_logprobs: for each generated token, the request's `top_logprobs` most likely tokens at that step as
            (token id, log-probability), most likely first, when asked for.
        created_time: `time.time()` when the request was submitted.
        timestamps: `time.time()` at which each generated token was produced, when asked for.
        new_tokens: the tokens generated since this request's previous output (a streaming request gets an
            output per step; the concatenated `new_tokens` of its outputs equal the final `generated_tokens`).
        num_cached_tokens: how many prompt tokens came from the prefix cache instead of being computed.
        text: the detokenized generation so far, cut before the first stop string, when the request was
            submitted with text output (a client with a tokenizer); else None.
        new_text: the part of `text` new since the previous output.
        weights_version: the engine's weights version when this output was made (see
            `ContinuousBatchingManager.mark_weights_updated`).
        prompt_logprobs: when the request asked for them (`prompt_logprobs=k`, k in 0..20), one entry per prompt
            token: None for the first (nothing precedes it), then a `PromptLogprob` per token: `logprob`, its
            log-probability given the tokens before it (log_softmax of the raw logits, float32, no temperature
            or top-k/top-p), and `top_logprobs`, the k most likely (token id, logprob) there, most likely first.
            Complete in the final output (and in every streamed output, since the prompt is computed before the
            first token); all n samples of a prompt carry the same. Such a request computes its whole
            prompt, taking nothing from the prefix cache (`num_cached_tokens` stays 0, except for the samples
            forked from it). None when not asked for.
        sequence_score: for a beam search output (`num_beams > 1`), its score as `generate` reports it in
            `sequences_scores`; None otherwise.
    """

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None
    error: str | None = None
    created_time: float = 0.0
    timestamps: list[float] | None = None
    new_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    text: str | None = None
    new_text: str = ""
    weights_version: int = 0
    prompt_logprobs: list[PromptLogprob | None] | None = None
    sequence_score: float | None = None

    def is_finished(self) -> bool:
        return self.status.is_finished
