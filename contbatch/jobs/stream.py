"""The core of a dataset job: items in, records out, with a bounded number of prompts in flight on one manager."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from contbatch.data.prompts import as_token_ids
from contbatch.engine.model_support import raise_if_unsupported
from contbatch.engine.sampling_params import SamplingParams
from contbatch.jobs.items import JobItem
from contbatch.jobs.records import error_record, result_record
from contbatch.manager import ContinuousBatchingManager
from contbatch.outputs import GenerationOutput, RequestStatus

_STREAMS = itertools.count()


@dataclass(frozen=True)
class JobSettings:
    """What a job generates. `temperature` 0 is greedy; with a `seed`, each item is seeded from the seed and its
    id, so a resumed run samples what an uninterrupted one would. `chat_template`: text prompts become one user
    turn of the tokenizer's chat template (plain tokenization without one). `max_prompt_tokens` fails longer
    prompts. `max_in_flight` bounds the items submitted and not yet finished. `id_field` names the input's id
    (None: the record's position). `model` names the model in the settings record and OpenAI responses.
    `top_k`, `min_p` and `repetition_penalty` apply when set (None: as `generate` resolves them); `stop` strings
    end a completion before them. An item's own sampling fields (OpenAI batch lines) override all of these.
    Raises ValueError naming a bad value."""

    model: str
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    chat_template: bool = True
    max_prompt_tokens: int | None = None
    max_in_flight: int = 256
    id_field: str | None = None
    text_field: str = "question"
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = [s for s in self.stop if not isinstance(s, str) or not s]
        if bad:
            raise ValueError(f"stop strings must be non-empty strings, got {bad[0]!r}")
        sampling = {k: v for k, v in self.sampling().items() if k != "stop"}
        temperature = sampling.pop("temperature")
        if temperature:
            sampling.update(do_sample=True, temperature=temperature)
        SamplingParams.from_generation_config(None, max_new_tokens=self.max_new_tokens, **sampling)

    def sampling(self) -> dict[str, Any]:
        """The job's sampling arguments of `add_request`, before an item's own: the fields that are set."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                 "repetition_penalty": self.repetition_penalty, "stop": list(self.stop) or None}
        return {key: value for key, value in given.items() if value is not None}

    def record(self, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
        """The settings an existing output must have been made with to be resumed (the chat template by hash).
        A field an older output did not record reads as None there, which is its unset value here."""
        template = getattr(tokenizer, "chat_template", None) if self.chat_template else None
        digest = None if template is None else zlib.crc32(str(template).encode())
        return {"model": self.model, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "seed": self.seed, "n": self.n, "chat_template": digest,
                "max_prompt_tokens": self.max_prompt_tokens, "id_field": self.id_field,
                "text_field": self.text_field, "top_k": self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty, "stop": list(self.stop) or None}


@dataclass
class Finished:
    """A record ready to be written, with the tokens generated for it."""

    record: dict[str, Any]
    failed: bool
    generated_tokens: int = 0


@dataclass
class _Pending:
    item: JobItem
    outputs: list[GenerationOutput | None] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


class RecordStream:
    """Runs items on a started manager and yields a `Finished` per item, in order of completion.

    At most `settings.max_in_flight` items are submitted and unfinished at any time, so the input is read only
    as fast as it is generated. An item that cannot run (an error item, a prompt the tokenizer or the manager
    refuses, an oversize prompt) and an item whose request fails yield an error record; the stream goes on. A
    request cancelled because the manager stopped raises RuntimeError: it did not finish, so nothing is written. A
    request failed by the model (`UnsupportedModelError`: a model contbatch cannot compute exactly) raises that
    error, and nothing is written for it: every item would fail alike, and a later run with another model must
    not skip them as done.

    With `shared=True` several streams may run on one manager at once (from several threads): each takes only
    its own requests' outputs, waiting on its oldest request first."""

    def __init__(self, manager: ContinuousBatchingManager, tokenizer: PreTrainedTokenizerBase,
                 settings: JobSettings, shared: bool = False) -> None:
        self.manager, self.tokenizer, self.settings, self.shared = manager, tokenizer, settings, shared
        self._pending: dict[str, _Pending] = {}
        self._samples: dict[str, tuple[str, int]] = {}
        self._prefix = f"job{next(_STREAMS)}"
        self._ids = itertools.count()

    def run(self, items: Iterable[JobItem]) -> Iterator[Finished]:
        """Yield one `Finished` per item of `items`. Raises RuntimeError if the engine thread dies."""
        source = iter(items)
        exhausted = False
        while True:
            while not exhausted and len(self._pending) < self.settings.max_in_flight:
                item = next(source, None)
                if item is None:
                    exhausted = True
                elif (refused := self._submit(item)) is not None:
                    yield refused
            if not self._pending:
                if exhausted:
                    return
                continue
            wanted = next(iter(self._samples)) if self.shared else None
            output = self.manager.get_result(wanted, timeout=1.0)
            if output is not None and (done := self._collect(output)) is not None:
                yield done

    def _submit(self, item: JobItem) -> Finished | None:
        """Submit `item`'s request; an error `Finished` when it cannot run."""
        if item.error is not None:
            return Finished(error_record(item, item.error), True)
        try:
            prompt_ids = self._tokenize(item)
            limit = self.settings.max_prompt_tokens
            if limit is not None and len(prompt_ids) > limit:
                raise ValueError(f"the prompt has {len(prompt_ids)} tokens, more than --max-prompt-tokens {limit}")
            sampling = self._sampling(item)
            n = sampling.pop("n")
            request_id = f"{self._prefix}_{next(self._ids)}"
            self.manager.add_request(prompt_ids, request_id, **sampling, n=n)
        except Exception as error:
            return Finished(error_record(item, f"{type(error).__name__}: {error}"), True)
        self._pending[request_id] = _Pending(item, [None] * n, [""] * n)
        for j in range(n):
            self._samples[request_id if n == 1 else f"{request_id}_{j}"] = (request_id, j)
        return None

    def _tokenize(self, item: JobItem) -> list[int]:
        template = self.settings.chat_template and getattr(self.tokenizer, "chat_template", None) is not None
        if item.kind == "chat":
            messages = cast("list[dict[str, str]]", item.prompt)
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        elif item.kind == "text" and template:
            encoded = self.tokenizer.apply_chat_template([{"role": "user", "content": cast(str, item.prompt)}],
                                                         add_generation_prompt=True, tokenize=True)
        else:
            encoded = self.tokenizer(item.prompt)["input_ids"]
        ids = as_token_ids(encoded)
        if not ids:
            raise ValueError("the prompt has no tokens")
        return ids

    def _sampling(self, item: JobItem) -> dict[str, Any]:
        """`add_request`'s keyword arguments for `item`: the job's settings, overridden by the item's own."""
        merged: dict[str, Any] = {"max_new_tokens": self.settings.max_new_tokens, "n": self.settings.n,
                                  **self.settings.sampling()}
        merged.update(item.sampling)
        if merged.get("seed") is None and self.settings.seed is not None:
            merged["seed"] = (self.settings.seed + zlib.crc32(item.key.encode())) % (2**31)
        temperature = merged.pop("temperature")
        merged["do_sample"] = bool(temperature)
        if temperature:
            merged["temperature"] = temperature
        else:
            for name in ("top_p", "top_k", "min_p", "seed"):
                merged.pop(name, None)
        stop = merged.pop("stop", None)
        if stop:
            merged.update(stop=[stop] if isinstance(stop, str) else list(stop), detokenize=True)
        return merged

    def _collect(self, output: GenerationOutput) -> Finished | None:
        """Record one finished sample; the item's `Finished` once all its samples are in."""
        request_id, j = self._samples.pop(output.request_id)
        pending = self._pending[request_id]
        pending.outputs[j] = output
        pending.texts[j] = output.text if output.text is not None else cast(str, self.tokenizer.decode(
            output.generated_tokens, skip_special_tokens=True))
        if any(sample is None for sample in pending.outputs):
            return None
        del self._pending[request_id]
        outputs = [sample for sample in pending.outputs if sample is not None]
        if any(o.status == RequestStatus.CANCELLED for o in outputs):
            raise RuntimeError(f"the manager stopped before item {pending.item.item_id!r} finished")
        failed = next((o for o in outputs if o.status != RequestStatus.FINISHED), None)
        if failed is not None:
            reason = failed.error or f"the request ended {failed.status.name}"
            raise_if_unsupported(reason)  # the model's failure, not the item's
            return Finished(error_record(pending.item, reason), True)
        generated = sum(len(o.generated_tokens) for o in outputs)
        record = result_record(pending.item, pending.texts, [o.finish_reason for o in outputs],
                               len(outputs[0].prompt_ids), generated, self.settings.model)
        return Finished(record, False, generated)
