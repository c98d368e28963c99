"""What passes from one step to the next: a step's draws as the device holds them (`DrawnStep`), and the next
step's inputs built on the host (`PreparedBatch`), into which async batching carries those draws on the device."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from contbatch.engine.attention import AttentionGroup
from contbatch.engine.outputs import ModelRunnerOutput, PromptLogprob
from contbatch.engine.sampler import SamplerOutput


@dataclass
class DrawnStep:
    """A step's draws (`ModelRunner.draw`): `sampled` on the logits' device, row i for `request_ids[i]`.

    On a CUDA device the copies of `sampled` to the host start as the step is made (into pinned memory, with an
    event recorded after them on the device's stream), so that `resolve` waits for this step's sampling alone,
    not for the forward launched after it; that forward reads the tokens on the device (`PreparedBatch.carry`).
    Elsewhere `sampled` is already on the host and nothing waits.

    Attributes:
        request_ids: the sampling targets' requests, in order.
        sampled: the tokens and logprobs, on the logits' device.
        prompt_logprobs, beam_scores: as in `ModelRunnerOutput`, already on the host.
    """

    request_ids: list[str]
    sampled: SamplerOutput
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)
    beam_scores: dict[str, torch.Tensor] = field(default_factory=dict)
    _host: SamplerOutput | None = field(default=None, init=False, repr=False)
    _copied: torch.cuda.Event | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        device = self.sampled.token_ids.device
        if device.type == "cuda":
            self._host = self.sampled.to("cpu", non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device))
        else:
            self._host = self.sampled.to("cpu")

    def resolve(self) -> ModelRunnerOutput:
        """The step's `ModelRunnerOutput`, once its copies have reached the host (waits for them)."""
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host
        assert host is not None
        top = None
        if host.top_logprobs is not None:
            values, ids = host.top_logprobs
            top = [tuple(zip(row_ids, row_values, strict=True))
                   for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)]
        return ModelRunnerOutput(
            request_ids=self.request_ids,
            sampled_token_ids=host.token_ids.tolist(),
            logprobs=host.logprobs.tolist() if host.logprobs is not None else None,
            top_logprobs=top,
            prompt_logprobs=self.prompt_logprobs,
            beam_scores=self.beam_scores,
        )


@dataclass
class PreparedBatch:
    """A batch's inputs, built on the host by `ModelRunner.prepare`; `execute` moves them to the device.

    Attributes:
        input_ids, positions: [num_tokens], the packed batch.
        logits_indices: the packed indices of the logits rows to compute.
        slot_mapping: [cache groups, num_tokens], the cache slot of each token.
        groups: the attention groups.
        carried_rows, carried_ids: the packed indices of the placeholders of carried tokens
            (`ScheduledRequest.carried`) and their requests.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    carried_rows: list[int]
    carried_ids: list[str]
    _carry: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def carry(self, drawn: DrawnStep) -> None:
        """Takes each carried placeholder's token from `drawn`, the step before (by request id), as the device
        holds it: `device_input_ids` writes them there, so this batch's forward may start before they reach the
        host. A request `drawn` has no token for (it failed or ended) keeps the placeholder: its row's results
        are never used."""
        source_of = {request_id: index for index, request_id in enumerate(drawn.request_ids)}
        pairs = [(row, source_of[request_id]) for row, request_id in zip(self.carried_rows, self.carried_ids,
                                                                         strict=True) if request_id in source_of]
        if pairs:
            index = int_tensor(value for pair in zip(*pairs, strict=True) for value in pair).view(2, -1)
            self._carry = (index, drawn.sampled.token_ids)

    def device_input_ids(self, device: torch.device) -> torch.Tensor:
        """The input ids on `device`, with the carried tokens (`carry`) written in there (on a CPU, into
        `input_ids` itself)."""
        input_ids = self.input_ids.to(device, non_blocking=True)
        if self._carry is not None:
            index, tokens = self._carry
            index = index.to(device, non_blocking=True)
            input_ids[index[0]] = tokens[index[1]].to(input_ids.dtype)
        return input_ids


def int_tensor(values: Iterable[int]) -> torch.Tensor:
    """A CPU int64 tensor of `values`, built through an `array` (several times faster than `torch.tensor` on a
    list of Python ints: the host builds one per step and per batch input)."""
    buffer = array("q", values)
    return torch.frombuffer(buffer, dtype=torch.int64) if buffer else torch.empty(0, dtype=torch.int64)
