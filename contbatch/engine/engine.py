"""`LLMEngine`: one step is schedule -> forward -> sample -> update. Single-threaded and deterministic;
everything else (the engine thread, the clients, the server) wraps it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch.engine.beam_search import BeamSearch
from contbatch.engine.block_pool import BlockPool
from contbatch.engine.compile import engine_compile_paths
from contbatch.engine.config import ContinuousBatchingConfig, default_max_batch_tokens
from contbatch.engine.cuda_graphs import resolve_graph_settings
from contbatch.engine.generation_config import as_ids, check_supported, resolve_generation_config
from contbatch.engine.kv_cache import (
    PagedKVCache,
    available_memory_bytes,
    num_blocks_for_memory,
    resident_block_limit,
)
from contbatch.engine.kv_cache_manager import KVCacheManager
from contbatch.engine.kv_probe import cache_layout, probe_layers
from contbatch.engine.malloc_tuning import tune_malloc
from contbatch.engine.model_runner import ModelRunner
from contbatch.engine.model_support import chunked_attention_limit, input_vocab_size
from contbatch.engine.outputs import EngineStats, RequestDelta
from contbatch.engine.packed_weights import pending_packed_bytes
from contbatch.engine.request import Request
from contbatch.engine.sampling_params import SamplingParams
from contbatch.engine.scheduler import Scheduler
from contbatch.engine.step_pipeline import StepPipeline, resolve_async_batching
from contbatch.engine.step_timer import NO_STEP_TIMER, StepTimer
from contbatch.engine.structured import GrammarCompiler
from contbatch.engine.weights import WeightsFingerprint


class LLMEngine:
    """Continuous batching over a stock transformers causal LM.

    `add_request` validates and queues a request (raising ValueError naming the request and the bad value);
    `fork` adds a request that continues another's sequence sharing its KV blocks; `step` runs one forward over
    every request that can make progress and returns one immutable `RequestDelta` per request that produced a
    token or went through an event. A failure inside a step fails the requests of that step only; the engine
    keeps serving.

    Weights: KV computed with old weights must never be reused. `check_weights()` detects changed weights
    (see `WeightsFingerprint` for the writes it cannot see) and `mark_weights_updated()` is the explicit
    signal; either empties the prefix cache and bumps `weights_version`.

    Memory between generation phases (an RL trainer's training step): `sleep()` gives the KV cache's memory back
    and `wake()` takes it again; a request added while asleep wakes the engine.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        config: ContinuousBatchingConfig | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        """`tokenizer`: the model's, needed only by structured outputs (`SamplingParams.structured_output`)."""
        self.config = config or ContinuousBatchingConfig()
        self.tokenizer = tokenizer
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self.generation_config = resolve_generation_config(generation_config, model.generation_config)
        check_supported(self.generation_config)
        device = next(model.parameters()).device
        if device.type == "cpu":
            tune_malloc()
        vocab_size = input_vocab_size(model)
        probe = probe_layers(model)
        dtype = next(model.parameters()).dtype
        spec, groups, repeats = cache_layout(model, dtype, probe)
        free = available_memory_bytes(device) - pending_packed_bytes(model)
        num_blocks = self.config.num_blocks or num_blocks_for_memory(
            spec, groups, self.config.block_size, max(free, 0), self.config.max_memory_percent
        )
        self.cache = PagedKVCache(spec, num_blocks, self.config.block_size, device, groups, repeats)
        self.block_pool = BlockPool(num_blocks, resident_block_limit(self.cache), runs=True)
        self.kv_manager = KVCacheManager(
            self.block_pool, self.config.block_size, self.config.max_blocks_per_request or 0,
            enable_caching=self.config.allow_block_sharing,
            windows=[group.sliding_window for group in groups],
        )
        max_batch_tokens = self.config.max_batch_tokens or default_max_batch_tokens(device.type, dtype)
        self.scheduler = Scheduler(self.kv_manager, max_batch_tokens, self.config.scheduler_type,
                                   self.config.max_prefill_tokens_while_decoding)
        config = self.config
        paths = engine_compile_paths(config, self.generation_config)
        self.model_runner = ModelRunner(model, self.cache, paths, resolve_graph_settings(
            config.use_cuda_graph, config.q_padding_interval_size, config.kv_padding_interval_size,
            config.max_cached_graphs, device, paths.get("decode")), renumbered=probe.renumbered,
            step_rows=max_batch_tokens)
        self.sampler = self.model_runner.sampler
        self.beam_search = BeamSearch(self.scheduler)
        self.device = device
        text_config = model.config.get_text_config()
        self.vocab_size = vocab_size
        self.max_position_embeddings: int | None = getattr(text_config, "max_position_embeddings", None)
        self.chunk_limit = chunked_attention_limit(model.config)
        self.model = model
        self._weights: WeightsFingerprint | None = None
        self._committed_blocks = 0
        self.async_batching = resolve_async_batching(config.use_async_batching, device)
        self.pipeline = StepPipeline(self.scheduler, self.model_runner, self.beam_search, self.block_pool,
                                     self.async_batching)
        self.step_timer: StepTimer = NO_STEP_TIMER

    def close(self) -> None:
        """Ends the step in flight (its deltas come with the next `step`), stops async batching's worker thread
        and restores the model's own attention implementation."""
        self.pipeline.close()
        self.model_runner.close()

    def release_thread_pools(self) -> None:
        """Gives back the OpenMP worker threads of the calling thread and of async batching's forward thread
        (`contbatch.engine.openmp`). For an idle engine: a later step makes them again."""
        self.pipeline.release_thread_pools()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request by id (read-only: owned by the scheduler)."""
        return self.scheduler.requests

    @property
    def weights_version(self) -> int:
        """Bumped each time the weights are known to have changed."""
        return self.scheduler.weights_version

    def has_unfinished_requests(self) -> bool:
        """Whether a `step` has anything to do: requests to run, a step in flight, or deltas to return."""
        return self.scheduler.num_unfinished > 0 or self.beam_search.has_pending or self.pipeline.is_busy

    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str,
        max_new_tokens: int | None = None,
        **sampling: Any,
    ) -> str:
        """Queues a request; returns its id. `sampling` overrides the generation config per request (keys of
        `SamplingParams`, or `eos_token_id`). Raises ValueError naming the request and the bad value."""
        self.add(self.make_request(input_ids, request_id, max_new_tokens, **sampling))
        return request_id

    def make_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str,
        max_new_tokens: int | None = None,
        **sampling: Any,
    ) -> Request:
        """A validated request, not queued yet. Reads only the engine's fixed settings, so any thread may call
        it. Raises ValueError naming the request and the bad value."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        prompt = self._validate_prompt(request_id, input_ids)
        try:
            params = SamplingParams.from_generation_config(
                self.generation_config, len(prompt), self.max_position_embeddings, max_new_tokens=max_new_tokens,
                **sampling
            )
            self._check_token_ids(params)
        except ValueError as error:
            raise ValueError(f"request {request_id!r}: {error}") from None
        if self.config.return_logprobs and not params.logprobs:
            params = replace(params, logprobs=True)
        self._check_lengths(request_id, len(prompt), params)
        request = Request(request_id, prompt, params)
        if params.structured_output is not None:
            try:
                request.matcher = self.grammar_compiler().matcher(params.structured_output)
            except ValueError as error:
                raise ValueError(f"request {request_id!r}: {error}") from None
        if params.seed is not None:
            request.generator = torch.Generator(self.device).manual_seed(params.seed)
        return request

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's compiler of structured outputs, made on first use from its tokenizer, with the
        generation config's EOS ids and the tokenizer's as the grammars' stop tokens. Raises ValueError when the
        engine has no tokenizer."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer: pass tokenizer= to the "
                                     "engine, manager or generate_batch")
                eos = self.generation_config.eos_token_id
                stops = [*as_ids(eos), *as_ids(self.tokenizer.eos_token_id)]
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, stops)
            return self._grammars

    def add(self, request: Request) -> None:
        """Queues a request made by `make_request`, waking the engine if it sleeps. Raises ValueError if its id
        is already queued or running."""
        self._check_new_id(request.request_id)
        self.wake()
        if request.params.num_beams > 1:
            self.beam_search.add(request)
        else:
            self.scheduler.add_request(request)

    def fork(self, parent_id: str, child: Request) -> None:
        """Adds `child`, made by `make_request` with the prompt `self.requests[parent_id].token_ids` (the parent's
        whole sequence so far), sharing the KV blocks the parent computed (copy-on-write): n samples of a prompt
        fork before the first token and share its prefill; a fork later (beams) shares everything computed.
        Raises ValueError for an unknown or finished parent, a duplicate id, a prompt that is not the parent's
        sequence, or prompt logprobs the child cannot get (see `Scheduler.fork`: a fork sharing the prefill asks
        for the parent's `prompt_logprobs` and receives the same entries). Under async batching a parent in the
        step in flight is settled first (`settle`): its sequence is the one after that."""
        parent = self.requests.get(parent_id)
        if parent is not None and parent.num_in_flight_tokens:
            self.settle()
            parent = self.requests.get(parent_id)
        if parent is None:
            raise ValueError(f"request {child.request_id!r}: cannot fork from {parent_id!r}, which is not running")
        if child.prompt_ids != parent.token_ids:
            raise ValueError(f"request {child.request_id!r}: a fork's prompt must be {parent_id!r}'s token sequence")
        self._check_new_id(child.request_id)
        self.scheduler.fork(parent, child)

    def settle(self) -> None:
        """Ends the step in flight under async batching (its deltas come with the next `step`): afterwards every
        request's `token_ids` hold all it has sampled. Does nothing for a synchronous engine."""
        self.pipeline.settle()

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests or self.beam_search.owns(request_id):
            raise ValueError(f"request {request_id!r}: a request with this id is already running")

    def _check_token_ids(self, params: SamplingParams) -> None:
        for name, token_ids in params.token_id_fields.items():
            outside = [token_id for token_id in token_ids if token_id >= self.vocab_size]
            if outside:
                raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})")

    def _validate_prompt(self, request_id: str, input_ids: Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() != 1 or input_ids.is_floating_point():
                raise ValueError(f"request {request_id!r}: input_ids must be a 1-D integer tensor, got {input_ids!r}")
            input_ids = input_ids.tolist()
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
            raise ValueError(f"request {request_id!r}: input_ids must be a list of token ids, got {input_ids!r}")
        if len(input_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        for token_id in input_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"request {request_id!r}: token id {token_id!r} is not an integer")
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"request {request_id!r}: token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        return list(input_ids)

    def _check_lengths(self, request_id: str, num_prompt_tokens: int, params: SamplingParams) -> None:
        if params.prompt_logprobs_start >= num_prompt_tokens:
            raise ValueError(f"request {request_id!r}: prompt_logprobs_start={params.prompt_logprobs_start} is not "
                             f"a position of the prompt ({num_prompt_tokens} tokens)")
        self._check_fits(request_id, num_prompt_tokens, params.max_new_tokens)

    def _check_fits(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raises ValueError when the request cannot run: more positions than the model has (or than one chunk of
        its chunked-attention layers: `chunked_attention_limit`), or more blocks than the cache can ever give one
        request. The last token sampled is never computed; a score-only
        request (max_new_tokens=0) computes its prompt but the last token, so a prompt one token longer than
        the model's positions can still be scored (as lm-eval's rolling windows are)."""
        total = num_prompt_tokens + max_new_tokens
        written = max(total - 1, 1)
        positions = total if max_new_tokens else written
        if self.max_position_embeddings is not None and positions > self.max_position_embeddings:
            raise ValueError(
                f"request {request_id!r}: prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) "
                f"needs {positions} positions: this exceeds the model's {self.max_position_embeddings} positions"
            )
        if self.chunk_limit is not None and positions > self.chunk_limit:
            raise ValueError(
                f"request {request_id!r}: prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) "
                f"needs {positions} positions, past the model's attention_chunk_size ({self.chunk_limit}): beyond it "
                f"its chunked-attention layers attend within chunks, which contbatch does not implement"
            )
        kv = self.kv_manager
        if not kv.can_ever_hold(written, self.scheduler.max_batch_tokens):
            needed = sum(kv.blocks_needed_alone(written, self.scheduler.max_batch_tokens))
            capacity = min(kv.max_blocks_per_request, self.block_pool.num_blocks)
            raise ValueError(
                f"request {request_id!r}: prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) "
                f"needs {needed} blocks of {self.config.block_size} tokens, more than the cache can ever hold for "
                f"one request ({capacity})"
            )

    def cancel_request(self, request_id: str) -> RequestDelta | None:
        """Cancels a queued or running request and frees its blocks; returns its final delta. Unknown or
        finished ids are ignored (None). An output or beam of a beam search cancels its whole group (its other
        outputs' deltas come with the next step)."""
        if self.beam_search.owns(request_id):
            return self.beam_search.cancel(request_id)
        return self.scheduler.cancel(request_id)

    def step(self) -> list[RequestDelta]:
        """Runs one step: schedule -> forward -> sample -> update (see `StepPipeline`, async batching
        included). Returns the deltas of the requests that produced a token or went through an event; a failing
        forward or sampler fails that step's requests."""
        return self.pipeline.step(self.step_timer)

    @property
    def num_scheduled_tokens_total(self) -> int:
        """Tokens scheduled for computation since the engine was made."""
        return self.pipeline.num_scheduled_tokens_total

    def stats(self) -> EngineStats:
        pool = self.block_pool
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           1.0 - pool.num_free_blocks / pool.num_blocks, self.is_sleeping, pool.num_blocks,
                           pool.num_free_blocks, pool.num_cached_blocks, pool.num_touched)

    @property
    def is_sleeping(self) -> bool:
        """True between `sleep()` and the next `wake()` (or the next request added)."""
        return not self.cache.is_allocated

    def sleep(self) -> None:
        """Gives back the KV cache's memory (see `PagedKVCache.release`), e.g. while an RL trainer trains between
        generation phases. The prefix cache is emptied first: the blocks' content is lost, so no later request
        reuses anything computed before. Idempotent. Only allowed with no unfinished request: otherwise raises
        RuntimeError naming how many there are, and changes nothing. While asleep every block is free (the pool
        is whole) and the engine holds no request; `wake()`, or adding a request, reallocates the cache."""
        if self.has_unfinished_requests():
            raise RuntimeError(f"cannot sleep with {self.scheduler.num_unfinished} unfinished request(s): let them "
                               f"finish or cancel them first")
        self.reset_prefix_cache()
        self.model_runner.drop_graphs()
        self.cache.release()
        self.block_pool.forget_touched()
        self._committed_blocks = 0

    def wake(self) -> None:
        """Reallocates the KV cache given back by `sleep()`, with the same shape, dtype and device (its content is
        undefined until written, which every request does before reading). Idempotent."""
        self.cache.allocate()

    def commit_cache(self) -> int:
        """On a CPU, commits the memory of the blocks the pool hands out next (`PagedKVCache.commit`): those
        neither handed out nor committed yet, up to its `touch_limit` (the resident cache,
        `resident_block_limit`), so that no later step pays their page faults. For a long-running server before
        its first request: it holds that memory from then on, as a server whose cache filled would. Returns the
        number of blocks committed: 0 on other devices (committed when allocated) and while asleep (`wake()`
        allocates anew, uncommitted)."""
        pool = self.block_pool
        if pool.touch_limit is None or not self.cache.is_allocated:
            return 0
        first, last = max(pool.num_touched, self._committed_blocks), min(pool.touch_limit, pool.num_blocks)
        self.cache.commit(first, last)
        self._committed_blocks = max(self._committed_blocks, last)
        return max(0, last - first)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix: nothing computed so far is shared with later requests."""
        self.kv_manager.reset_prefix_cache()

    def check_weights(self) -> bool:
        """Treats the weights as updated (`mark_weights_updated`) if they changed since the last check or mark
        (the first check only records them: nothing computed before it). Returns whether they changed. Costs one
        pass over the parameters: call it between runs, not per step, on the thread that runs the engine."""
        self.settle()
        if self._weights is None:
            self._weights = WeightsFingerprint.of(self.model)
            return False
        changed = not self._weights.matches(self.model)
        if changed:
            self.mark_weights_updated()
        return changed

    def mark_weights_updated(self) -> None:
        """The signal that the weights changed: nothing computed before is shared with later requests, and
        `weights_version` goes up. Running requests keep the KV they computed (a step in flight ends first)."""
        self.settle()
        self.reset_prefix_cache()
        self.scheduler.weights_version += 1
        self._weights = WeightsFingerprint.of(self.model)
        self.model_runner.weights_replaced()

    def check_integrity(self) -> None:
        """Cache bookkeeping invariants; call when idle to also check that nothing leaked."""
        self.kv_manager.check_integrity()
        if not self.has_unfinished_requests():
            assert self.block_pool.is_whole, "blocks leaked: the pool is not whole while the engine is idle"
