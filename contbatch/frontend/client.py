"""`EngineClient`: submits requests to the engine thread and controls its sessions; the synchronous manager and
the asyncio client are built on it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch.engine.config import ContinuousBatchingConfig
from contbatch.engine.engine import LLMEngine
from contbatch.engine.outputs import EngineStats
from contbatch.frontend.detokenizer import IncrementalDetokenizer
from contbatch.frontend.engine_loop import AddRequests, CancelRequest, EngineCall, EngineLoop, LoopState
from contbatch.frontend.output_processor import RequestIds, RequestState
from contbatch.frontend.output_router import ResultHandler
from contbatch.telemetry import MetricsSink, RequestOrigin, Telemetry, TelemetryRecorder

DEFAULT_QUEUE_TIMEOUT = 60.0


class EngineClient:
    """Continuous batching on a background thread that alone owns the engine (`EngineLoop`); every public method
    is thread safe. Outputs are taken through `register_result_handler` (asyncio) or, in
    `ContinuousBatchingManager`, with blocking calls.

    Requests may be added before `start()`; they run once it is called. `stop()` ends the session: requests
    still unfinished get a CANCELLED output with their tokens so far, and adding a request raises until
    `start()` is called again. Every request gets exactly one terminal output (FINISHED, FAILED or CANCELLED).
    If the engine thread dies, every waiter gets the error at once.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
        tokenizer: PreTrainedTokenizerBase | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        """`queue_timeout`: how long `add_request` waits for room when `max_queue_size` requests are waiting.
        `tokenizer`: needed for text outputs, stop strings (`add_request(detokenize=True, stop=...)`) and
        structured outputs (`add_request(structured_output=...)`). `telemetry`: where the requests' spans and
        metrics go (default `Telemetry.default()`: the application's global providers or the `OTEL_*`
        environment, else off)."""
        self.model = model
        self.generation_config = generation_config or model.generation_config
        self.config = continuous_batching_config or ContinuousBatchingConfig()
        self.tokenizer = tokenizer
        self.telemetry_config = telemetry if telemetry is not None else Telemetry.default()
        self.telemetry = TelemetryRecorder(self.telemetry_config, _model_name(model))
        self._loop = EngineLoop(lambda: LLMEngine(self.model, self.generation_config, self.config, self.tokenizer),
                                self.config.max_queue_size, queue_timeout, self.telemetry)
        self._ids = RequestIds()

    @property
    def engine(self) -> LLMEngine:
        """The engine. While the manager runs, only the engine thread may change it; other threads may only
        call its `make_request`."""
        return self._loop.engine

    @property
    def stats(self) -> EngineStats:
        """The engine's load after its latest step."""
        return self._loop.stats

    @property
    def queue_timeout(self) -> float:
        return self._loop.gate.timeout

    @queue_timeout.setter
    def queue_timeout(self, seconds: float) -> None:
        self._loop.gate.timeout = seconds

    # --- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the background thread (a new session after `stop`); does nothing if it is running. Weights
        that changed since the previous session are detected on the engine thread before any request of the new
        session is admitted (see `mark_weights_updated`)."""
        self._loop.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False) -> None:
        """Ends the session: unfinished requests are cancelled. With `keep_for_next_session` the engine and its
        cache are kept for the next `start()`; otherwise they are released. `block` waits for the thread."""
        self._loop.stop(block, timeout, keep_for_next_session)

    def join(self, timeout: float | None = None) -> None:
        """Waits for the background thread to finish (at most `timeout` seconds)."""
        self._loop.join(timeout)

    def is_running(self) -> bool:
        return self._loop.is_running()

    # --- requests --------------------------------------------------------------------------------------------

    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        n: int = 1,
        stop: Sequence[str] | None = None,
        detokenize: bool = False,
        origin: RequestOrigin | None = None,
        **sampling: Any,
    ) -> str:
        """Submits a request; returns its id. A streaming request gets an output after every token, the others
        one final output. `sampling` overrides the generation config for this request (`do_sample`,
        `temperature`, `top_k`, `top_p`, `min_p`, `min_tokens` / `min_new_tokens`, `repetition_penalty`,
        `presence_penalty`, `frequency_penalty`, `logit_bias`, `bad_words_ids`, `suppress_tokens`,
        `stop_token_ids`, `ignore_eos`, `seed`, `logprobs`, `top_logprobs`, `logprobs_mode`: "raw" or
        "processed", `prompt_logprobs`: None or k in 0..20, the logprobs of the prompt tokens and their top k,
        `prompt_logprobs_start`: the first prompt index to score; see `SamplingParams`); fields left unset
        resolve as `model.generate` resolves them. `max_new_tokens=0` scores the prompt without generating.
        The n samples of a prompt all carry its prompt logprobs.

        With `n > 1`, n samples of the prompt run as requests `<id>_0` ... `<id>_<n-1>` (sample j seeded with
        `seed + j` when a seed is given); the prompt is computed once, and the samples share its KV blocks (a
        partly filled last block is copied when a sample first writes into it). With `detokenize` (or `stop`
        strings) outputs carry `text`; a stop string ends the request with reason "stop", the text cut before
        it. Both need the manager's tokenizer. `origin` names the request's operation, model and parent trace
        context for its span and metrics (default: a text completion of the client's model, parented on the
        calling thread's current span). Raises ValueError for bad input or a duplicate id, RuntimeError after
        `stop()` or when the queue stays full for `queue_timeout` seconds."""
        if self._loop.state >= LoopState.STOPPING:
            raise RuntimeError("the manager is stopped: call start() before adding requests")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if (stop or detokenize) and self.tokenizer is None:
            raise ValueError("stop strings and text outputs need a tokenizer: the client's tokenizer=")
        request_id = self._ids.new() if request_id is None else request_id
        seed = sampling.pop("seed", None)
        sampling.pop("num_return_sequences", None)
        ids = RequestIds.samples(request_id, n)
        if (sampling.get("num_beams") or self.engine.generation_config.num_beams or 1) > 1:
            requests = [self.engine.make_request(input_ids, request_id, max_new_tokens, eos_token_id=eos_token_id,
                                                 num_return_sequences=n, **sampling)]
        else:
            requests = [self.engine.make_request(input_ids, rid, max_new_tokens, eos_token_id=eos_token_id,
                                                 seed=None if seed is None else seed + j, **sampling)
                        for j, rid in enumerate(ids)]
        states = [RequestState(rid, requests[0].prompt_ids, streaming, record_timestamps,
                               self._detokenizer(stop, detokenize)) for rid in ids]
        if self.telemetry.active:
            for state in states:
                state.telemetry = self.telemetry.open(state.request_id, len(state.prompt_ids), requests[0].params,
                                                      origin, state.created_time)
        self._reserve(ids)
        self._loop.submit(AddRequests(requests, states))
        return request_id

    def _detokenizer(self, stop: Sequence[str] | None, detokenize: bool) -> IncrementalDetokenizer | None:
        if not (stop or detokenize) or self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, list(stop or []))

    def _reserve(self, ids: list[str]) -> None:
        """Opens the ids in the router and takes their queue places, all or none."""
        router, gate = self._loop.router, self._loop.gate
        opened: list[str] = []
        reserved = 0
        try:
            for rid in ids:
                router.open(rid)
                opened.append(rid)
                gate.acquire(rid)
                reserved += 1
        except (ValueError, RuntimeError):
            for rid in opened:
                router.discard(rid)
            gate.release(reserved)
            raise

    def add_metrics_sink(self, sink: MetricsSink) -> None:
        """Sends contbatch's metrics (requests submitted from now on, every step) to `sink` too, beside the
        OpenTelemetry instruments; the server's Prometheus collectors are one."""
        self._loop.add_metrics_sink(sink)

    def cancel_request(self, request_id: str) -> None:
        """Cancels a request: it gets a CANCELLED output with its tokens so far and its blocks are freed. An
        unknown or finished id is ignored."""
        self._loop.submit(CancelRequest(request_id))

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix: requests added after this call share nothing computed before it."""
        self._loop.submit(EngineCall(LLMEngine.reset_prefix_cache))

    def mark_weights_updated(self) -> None:
        """Signals that the model's weights changed: requests added after this call never reuse KV computed
        before it, and `weights_version` goes up. Call it after every weight update made while the manager runs
        (between sessions, `start()` also detects changes; see `WeightsFingerprint` for what it can miss)."""
        self._loop.submit(EngineCall(LLMEngine.mark_weights_updated))

    def sleep(self) -> None:
        """Gives back the KV cache's memory between generation phases (e.g. while an RL trainer trains); the
        memory is free when this returns. Runs on the engine thread between two steps while the manager runs,
        else at once. Idempotent; the prefix cache is emptied (`LLMEngine.sleep`); `stats.is_sleeping` tells.
        The next request added wakes the engine (so does `wake()`). Raises RuntimeError, changing nothing, while
        the engine has unfinished requests (queued or running); requests added before `start()` are not in the
        engine yet: they wake it when the session starts."""
        self._loop.call(LLMEngine.sleep)

    def wake(self) -> None:
        """Takes the KV cache's memory again after `sleep()` (idempotent), synchronously like `sleep()`; only
        needed to allocate before the next request arrives."""
        self._loop.call(LLMEngine.wake)

    def commit_cache(self) -> int:
        """On a CPU, commits the KV cache's resident memory now (`LLMEngine.commit_cache`), so that no request's
        steps pay its page faults later; `contbatch serve` does so before it listens. Synchronous like
        `sleep()`. Returns the number of blocks committed (0 on a GPU, while asleep, or with no engine held)."""
        return self._loop.call(LLMEngine.commit_cache) or 0

    @property
    def weights_version(self) -> int:
        """The engine's weights version (outputs carry the one they were made with)."""
        return self.engine.weights_version

    # --- results ---------------------------------------------------------------------------------------------

    def register_result_handler(self, request_id: str, callback: ResultHandler) -> None:
        """Calls `callback(output)` on the running asyncio loop of the caller, through `call_soon_threadsafe`,
        for each output of `request_id` (each token when streaming, else the final one); dropped after the
        final output. Must be called from inside a running event loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("register_result_handler must be called from a running asyncio event loop") from None
        self._loop.router.register_handler(request_id, loop, callback)


def _model_name(model: PreTrainedModel) -> str:
    """The model's name for telemetry (`gen_ai.request.model`): the last part of its `name_or_path`, else its
    class name."""
    name = str(getattr(model, "name_or_path", "") or "").rstrip("/").rsplit("/", 1)[-1]
    return name or type(model).__name__
