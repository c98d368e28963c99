"""What every generation endpoint shares: the server's state, submitting a request through the asyncio client,
and answering it as one JSON body or as server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from contbatch.entrypoints.openai.chat_output import ChoiceShaper, ShaperFactory
from contbatch.entrypoints.openai.formatting import ChoiceDelta, Echo, Formatter, usage
from contbatch.entrypoints.openai.metrics import ServerMetrics
from contbatch.entrypoints.openai.protocol import LOGPROB_FLOOR, APIError, SamplingFields
from contbatch.frontend.async_client import AsyncClient, ChoiceOutput, GenerationStream
from contbatch.frontend.client import EngineClient
from contbatch.outputs import RequestStatus
from contbatch.telemetry import RequestOrigin

if TYPE_CHECKING:
    from contbatch.engine.engine import LLMEngine
    from contbatch.engine.structured import StructuredOutput
    from contbatch.entrypoints.openai.tools import TemplateSupport

DISCONNECT_POLL_SECONDS = 0.5


@dataclass
class ServerState:
    """What the routes share, kept on `app.state.contbatch`."""

    client: EngineClient
    async_client: AsyncClient
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    api_key: str | None
    max_body_bytes: int
    metrics: ServerMetrics
    tool_call_parser: str = "auto"
    template_support: TemplateSupport | None = None


def server_state(request: Request) -> ServerState:
    return request.app.state.contbatch


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       code="model_not_found", param="model")


@dataclass(frozen=True)
class GenerationRequest:
    """One API call's generation, in engine terms: each prompt of `prompts` runs `n` samples, choice
    `prompt_index * n + sample_index`. `echo` prepends each prompt to its choices: its text (`prompt_texts[i]`
    when the prompts came as text, else its ids decoded with special tokens) and, with `logprobs`, its tokens'
    entries, from the engine's prompt logprobs (`prompt_logprobs=top_logprobs`). `structured_output` constrains
    every choice (the engine's sampling keyword of that name; None: unconstrained); the engine rejecting it is a
    400 naming `constraint_param`, the request field it comes from."""

    request_id: str
    prompts: list[list[int]]
    max_tokens: int
    logprobs: bool
    top_logprobs: int
    chat: bool
    echo: bool = False
    prompt_texts: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    constraint_param: str = "response_format"

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The engine's `prompt_logprobs`: enough top entries for the echoed logprobs and for vLLM's field."""
        asked = [k for k in (self.top_logprobs if self.echo and self.logprobs else None, self.prompt_logprobs)
                 if k is not None]
        return max(asked) if asked else None

    def prompt_request_id(self, index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}"


class Choices:
    """The choices of one call's prompts (n per prompt) as one async iterator of `ChoiceOutput`s indexed
    `prompt_index * n + sample_index`, interleaved as they come, ending after every choice's final output.
    `cancel()` (or leaving an `async with` block) cancels every choice still running."""

    def __init__(self, streams: list[GenerationStream], n: int) -> None:
        self.streams, self.n = streams, n
        self._queue: asyncio.Queue[ChoiceOutput | None] = asyncio.Queue()
        self._pumps: list[asyncio.Future[None]] = []
        self._open = len(streams)

    def __len__(self) -> int:
        return len(self.streams) * self.n

    def __aiter__(self) -> Choices:
        if not self._pumps:
            self._pumps = [asyncio.ensure_future(self._pump(p, stream)) for p, stream in enumerate(self.streams)]
        return self

    async def __anext__(self) -> ChoiceOutput:
        while self._open:
            choice = await self._queue.get()
            if choice is not None:
                return choice
            self._open -= 1
        raise StopAsyncIteration

    async def _pump(self, prompt_index: int, stream: GenerationStream) -> None:
        try:
            async for choice in stream:
                self._queue.put_nowait(ChoiceOutput(prompt_index * self.n + choice.index, choice.output))
        finally:
            self._queue.put_nowait(None)

    def cancel(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        for stream in self.streams:
            stream.cancel()

    async def __aenter__(self) -> Choices:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()


async def respond(state: ServerState, http: Request, body: SamplingFields, call: GenerationRequest,
                  shaping: ShaperFactory | None = None) -> Response:
    """Runs `call` and answers it (SSE when `body.stream`). A client that disconnects has its choices cancelled.
    With `shaping` (chat only), each choice's message or deltas come from its own `shaping()` shaper."""
    origin = state.client.telemetry.origin("chat" if call.chat else "text_completion", state.model_name, http.headers)
    choices = _submit(state, body, call, origin)
    echo = None
    if call.echo:
        texts = call.prompt_texts or [cast(str, state.tokenizer.decode(prompt)) for prompt in call.prompts]
        echo = Echo(texts, body.n)
    formatter = Formatter(state.tokenizer, state.model_name, call.request_id, call.chat, call.logprobs, echo,
                          call.top_logprobs, call.prompt_logprobs)
    prompt_tokens = sum(len(prompt) for prompt in call.prompts)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_events(choices, formatter, prompt_tokens, include_usage, state.metrics, shaping),
                                 media_type="text/event-stream")
    collecting = asyncio.ensure_future(_collect(choices, formatter, prompt_tokens, state.metrics, shaping))
    while not collecting.done():
        await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_SECONDS)
        if not collecting.done() and await http.is_disconnected():
            collecting.cancel()
            choices.cancel()
            return Response(status_code=499)
    return JSONResponse(collecting.result())


def _sampling(body: SamplingFields, call: GenerationRequest, default_top_k: int | None = 0) -> dict[str, Any]:
    """The engine's sampling keywords of a call. Unset fields keep OpenAI's defaults, not transformers' global
    ones: temperature 1.0, and `top_k` is `default_top_k` (0, no top-k, unless the model's generation config
    sets one: then None, which the engine resolves to it). `structured_output` is passed only when set."""
    temperature = 1.0 if body.temperature is None else body.temperature
    sampling: dict[str, Any] = {
        "do_sample": temperature > 0, "temperature": temperature if temperature > 0 else 1.0,
        "top_p": body.top_p, "top_k": default_top_k if body.top_k is None else body.top_k,
        "seed": body.seed, "logprobs": call.logprobs, "top_logprobs": call.top_logprobs,
        "logprobs_mode": body.logprobs_mode, "prompt_logprobs": call.engine_prompt_logprobs}
    if call.structured_output is not None:
        sampling["structured_output"] = call.structured_output
    extras = {name: getattr(body, name) for name in _ENGINE_EXTRAS if getattr(body, name) is not None}
    if body.use_beam_search:
        extras.update(do_sample=False, num_beams=body.num_beams or body.n, num_return_sequences=body.n)
    return {**sampling, **extras}


_ENGINE_EXTRAS = ("presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty", "min_p", "min_tokens",
                  "stop_token_ids", "ignore_eos", "length_penalty", "early_stopping")


def _default_top_k(state: ServerState) -> int | None:
    """None when the client's generation config or the model's own sets `top_k` (the engine then resolves it to
    that value), else 0: the engine's resolved config always holds transformers' global default of 50, which
    OpenAI requests must not get."""
    configs = (state.client.generation_config, state.client.model.generation_config)
    return None if any(getattr(config, "top_k", None) is not None for config in configs) else 0


def _submit(state: ServerState, body: SamplingFields, call: GenerationRequest, origin: RequestOrigin) -> Choices:
    """Checks every prompt, then submits them all (or none: a failure cancels those already submitted), each
    traced as coming from `origin`."""
    sampling = _sampling(body, call, _default_top_k(state))
    _validate(state, call, sampling)
    streams: list[GenerationStream] = []
    try:
        for index, prompt in enumerate(call.prompts):
            streams.append(state.async_client.submit(
                prompt, request_id=call.prompt_request_id(index), n=body.n, max_new_tokens=call.max_tokens,
                streaming=body.stream, stop=body.stop_strings(), detokenize=True, record_timestamps=True,
                origin=origin, **sampling))
    except ValueError as error:
        _cancel(streams)
        raise APIError(400, _named(call, len(streams), error), code="invalid_request", param="prompt") from None
    except RuntimeError as error:
        _cancel(streams)
        raise APIError(503, str(error), code="engine_unavailable", kind="server_error") from None
    state.metrics.prompt_tokens.inc(sum(len(prompt) for prompt in call.prompts))
    return Choices(streams, body.n)


def _validate(state: ServerState, call: GenerationRequest, sampling: dict[str, Any]) -> None:
    """Checks every prompt as the engine will (`make_request`, which queues nothing) before any is submitted, so
    a bad prompt of a list is answered 400 naming its index and no prompt of the list runs. An error that goes
    away without the structured output is blamed on the constraint's field."""
    try:
        engine = state.client.engine
    except RuntimeError as error:
        raise APIError(503, str(error), code="engine_unavailable", kind="server_error") from None
    for index, prompt in enumerate(call.prompts):
        try:
            engine.make_request(prompt, call.prompt_request_id(index), call.max_tokens, **sampling)
        except ValueError as error:
            param = _blamed_field(engine, call, index, sampling)
            raise APIError(400, _named(call, index, error), code="invalid_request", param=param) from None


def _blamed_field(engine: LLMEngine, call: GenerationRequest, index: int, sampling: dict[str, Any]) -> str:
    """The request field to name for prompt `index`'s error: the constraint's when the prompt passes without
    it, else "prompt"."""
    if "structured_output" not in sampling:
        return "prompt"
    unconstrained = {key: value for key, value in sampling.items() if key != "structured_output"}
    try:
        engine.make_request(call.prompts[index], call.prompt_request_id(index), call.max_tokens, **unconstrained)
    except ValueError:
        return "prompt"
    return call.constraint_param


def _named(call: GenerationRequest, index: int, error: ValueError) -> str:
    """The engine's message for prompt `index`, named `prompt[index]` when the call has several prompts."""
    message = str(error).removeprefix(f"request {call.prompt_request_id(index)!r}: ")
    return message if len(call.prompts) == 1 else f"prompt[{index}]: {message}"


def _cancel(streams: list[GenerationStream]) -> None:
    for stream in streams:
        stream.cancel()


async def _deltas(choices: Choices, metrics: ServerMetrics) -> AsyncIterator[ChoiceDelta]:
    """The choices' outputs as OpenAI choice deltas; a failed choice raises APIError(500) (and cancels the
    others)."""
    async with choices:
        async for choice in choices:
            output = choice.output
            if output.status == RequestStatus.FAILED:
                raise APIError(500, f"generation failed: {output.error}", code="engine_error", kind="server_error")
            reason = None
            if output.is_finished():
                reason = "length" if output.finish_reason == "length" else "stop"
                metrics.observe_finished(output)
            yield _finite(ChoiceDelta.of(choice.index, output, reason))


def _finite(delta: ChoiceDelta) -> ChoiceDelta:
    """`delta` with every -inf log-probability (a token top-k or top-p removed, in "processed" mode) raised to
    LOGPROB_FLOOR, as vLLM does: JSON has no infinity."""
    values = [*delta.logprobs, *(lp for top in delta.top_logprobs for _, lp in top)]
    if all(lp != float("-inf") for lp in values):
        return delta
    return dataclasses.replace(
        delta, logprobs=[max(lp, LOGPROB_FLOOR) for lp in delta.logprobs],
        top_logprobs=[[(i, max(lp, LOGPROB_FLOOR)) for i, lp in top] for top in delta.top_logprobs])


async def _collect(stream: Choices, formatter: Formatter, prompt_tokens: int, metrics: ServerMetrics,
                   shaping: ShaperFactory | None = None) -> dict[str, Any]:
    choices: dict[int, dict[str, Any]] = {}
    generated = 0
    async for delta in _deltas(stream, metrics):
        if delta.index not in choices:
            choices[delta.index] = formatter.first_choice(delta)
        formatter.extend(choices[delta.index], delta)
        if delta.finish_reason is not None:
            generated += delta.num_generated
    response = formatter.response([choices[i] for i in sorted(choices)], prompt_tokens, generated)
    if shaping is not None:
        for choice in response["choices"]:
            shaper = shaping()
            choice["message"] = shaper.message(choice["message"]["content"])
            choice["finish_reason"] = shaper.finish_reason(choice["finish_reason"])
    return response


async def _events(stream: Choices, formatter: Formatter, prompt_tokens: int, include_usage: bool,
                  metrics: ServerMetrics, shaping: ShaperFactory | None = None) -> AsyncIterator[str]:
    generated = 0
    started: set[int] = set()
    shapers: dict[int, ChoiceShaper] = {}
    if formatter.chat:
        for index in range(len(stream)):
            yield _event(formatter.chunk(index, {"role": "assistant", "content": ""}, None, None))
    try:
        async for delta in _deltas(stream, metrics):
            first = delta.index not in started
            started.add(delta.index)
            if delta.finish_reason is not None:
                generated += delta.num_generated
            if shaping is not None:
                chunk = _shaped_chunk(formatter, delta, shapers.setdefault(delta.index, shaping()))
                if chunk is not None:
                    yield _event(chunk)
            elif delta.text or delta.finish_reason is not None or (first and formatter.has_prompt_part):
                yield _event(formatter.delta_chunk(delta, first))
    except APIError as error:
        yield _event(error.body())
    if include_usage:
        yield _event({**formatter.header(chunk=True), "choices": [], "usage": usage(prompt_tokens, generated)})
    yield "data: [DONE]\n\n"


def _shaped_chunk(formatter: Formatter, delta: ChoiceDelta, shaper: ChoiceShaper) -> dict[str, Any] | None:
    """The chunk of `delta` with the fields `shaper` makes of its text; None when it carries nothing (no
    fields, no finish reason, no logprobs)."""
    fields = shaper.delta(delta.text, delta.finish_reason is not None)
    reason = shaper.finish_reason(delta.finish_reason)
    chunk = formatter.delta_chunk(delta)
    choice = chunk["choices"][0]
    if not fields and reason is None and not (choice["logprobs"] and delta.token_ids):
        return None
    choice["delta"], choice["finish_reason"] = fields, reason
    return chunk


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
