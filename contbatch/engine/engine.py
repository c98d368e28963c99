"""`LLMEngine`: one step is schedule -> run the model -> sample -> update. Single-threaded and deterministic;
everything else (generate_batch, the manager, the server) wraps it."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from contbatch.config import ContinuousBatchingConfig
from contbatch.engine.block_pool import BlockPool
from contbatch.engine.kv_cache import (
    KVCacheSpec,
    PagedKVCache,
    available_memory_bytes,
    kv_cache_groups,
    num_blocks_for_memory,
)
from contbatch.engine.kv_cache_manager import KVCacheManager
from contbatch.engine.model_runner import ModelRunner
from contbatch.engine.request import Request
from contbatch.engine.sampler import Sampler
from contbatch.engine.scheduler import Scheduler
from contbatch.outputs import RequestStatus
from contbatch.sampling_params import SamplingParams

DEFAULT_MAX_BATCH_TOKENS = {"cpu": 512, "cuda": 4096}


class LLMEngine:
    """Continuous batching over a stock transformers causal LM.

    `add_request` validates and queues a request (raising ValueError naming the request and the bad value);
    `step` runs one forward over every request that can make progress and returns the requests that produced a
    token. A failure inside a step fails the requests of that step only; the engine keeps serving.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        config: ContinuousBatchingConfig | None = None,
    ) -> None:
        self.config = config or ContinuousBatchingConfig()
        self.generation_config = generation_config or model.generation_config
        device = next(model.parameters()).device
        spec = KVCacheSpec.from_model_config(model.config, next(model.parameters()).dtype)
        groups = kv_cache_groups(model.config)
        num_blocks = self.config.num_blocks or num_blocks_for_memory(
            spec, groups, self.config.block_size, available_memory_bytes(device), self.config.max_memory_percent
        )
        self.cache = PagedKVCache(spec, num_blocks, self.config.block_size, device, groups)
        self.block_pool = BlockPool(num_blocks)
        self.kv_manager = KVCacheManager(
            self.block_pool, self.config.block_size, self.config.max_blocks_per_request or 0,
            enable_caching=self.config.allow_block_sharing,
            windows=[group.sliding_window for group in groups],
        )
        max_batch_tokens = self.config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS.get(device.type, 4096)
        self.scheduler = Scheduler(self.kv_manager, max_batch_tokens, self.config.scheduler_type)
        self.model_runner = ModelRunner(model, self.cache)
        self.sampler = Sampler()
        self.device = device
        text_config = model.config.get_text_config()
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_position_embeddings: int | None = getattr(text_config, "max_position_embeddings", None)
        self.requests: dict[str, Request] = {}
        self._request_ids = itertools.count()
        self.model = model
        self._weights = weights_fingerprint(model)
        self.num_scheduled_tokens_total = 0

    def close(self) -> None:
        """Restores the model's own attention implementation."""
        self.model_runner.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        record_timestamps: bool = False,
        **sampling: Any,
    ) -> str:
        """Queues a request; returns its id. `sampling` overrides the generation config per request (keys of
        `SamplingParams`, or `eos_token_id`). Raises ValueError naming the request and the bad value."""
        request_id = f"req_{next(self._request_ids)}" if request_id is None else request_id
        request = self.make_request(input_ids, request_id, max_new_tokens, record_timestamps, **sampling)
        self.add(request)
        return request_id

    def make_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str,
        max_new_tokens: int | None = None,
        record_timestamps: bool = False,
        **sampling: Any,
    ) -> Request:
        """A validated request, not queued yet. Reads only the engine's fixed settings, so any thread may call
        it. Raises ValueError naming the request and the bad value."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        try:
            params = SamplingParams.from_generation_config(
                self.generation_config, max_new_tokens=max_new_tokens, **sampling
            )
        except ValueError as error:
            raise ValueError(f"request {request_id!r}: {error}") from None
        if self.config.return_logprobs and not params.logprobs:
            params = replace(params, logprobs=True)
        prompt = self._validate_prompt(request_id, input_ids, params)
        request = Request(request_id, prompt, params, record_timestamps=record_timestamps)
        if params.seed is not None:
            request.generator = torch.Generator(self.device).manual_seed(params.seed)
        return request

    def add(self, request: Request, leader: Request | None = None) -> None:
        """Queues a request made by `make_request`. With `leader` (an earlier request of this engine with the same
        prompt: n samples of one prompt), it shares the leader's prefill. Raises ValueError if its id is already
        queued or running."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r}: a request with this id is already running")
        if leader is not None and self.requests.get(leader.request_id) is leader \
                and leader.prompt_ids == request.prompt_ids:
            request.leader = leader
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def _validate_prompt(self, request_id: str, input_ids: Sequence[int] | torch.Tensor,
                         params: SamplingParams) -> list[int]:
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
        total = len(input_ids) + params.max_new_tokens
        if self.max_position_embeddings is not None and total > self.max_position_embeddings:
            raise ValueError(
                f"request {request_id!r}: prompt ({len(input_ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) = {total} exceeds the model's {self.max_position_embeddings} positions"
            )
        kv = self.kv_manager
        # the last token is sampled, never written to the cache
        if not kv.can_ever_hold(total - 1, self.scheduler.max_batch_tokens):
            needed = sum(kv.blocks_needed_alone(total - 1, self.scheduler.max_batch_tokens))
            capacity = min(kv.max_blocks_per_request, self.block_pool.num_blocks)
            raise ValueError(
                f"request {request_id!r}: prompt ({len(input_ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) needs {needed} blocks of {self.config.block_size} tokens, more than "
                f"the cache can ever hold for one request ({capacity})"
            )
        return list(input_ids)

    def cancel_request(self, request_id: str) -> Request | None:
        """Cancels a queued or running request and frees its blocks; unknown or finished ids are ignored."""
        request = self.scheduler.cancel(request_id)
        if request is not None:
            self.requests.pop(request_id, None)
        return request

    def step(self) -> list[Request]:
        """Runs one step; returns the requests that produced a token or failed in it."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return self._fail_unschedulable()
        self.num_scheduled_tokens_total += batch.total_num_scheduled_tokens
        try:
            logits = self.model_runner.execute(batch, self.kv_manager)
            sampling = batch.sampling_requests
            if len(sampling) != logits.shape[0]:  # n samples of a prompt share its logits row
                logits = logits[torch.tensor(batch.sampling_rows, device=logits.device)]
            sampled = self.sampler.sample(
                logits, [r.params for r in sampling], [r.generator for r in sampling]
            )
        except Exception as error:  # a failing batch fails its own requests, never the engine
            self.scheduler.finish_requests(batch.requests, RequestStatus.FAILED, "error",
                                           f"{type(error).__name__}: {error}")
            return self._retire(batch.requests)
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top = None
        if sampled.top_logprobs is not None:
            values, ids = sampled.top_logprobs
            top = [list(zip(row_ids, row_values, strict=True))
                   for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)]
        produced = self.scheduler.update(batch, sampled.token_ids.tolist(), logprobs, time.time(), top)
        return self._retire(produced)

    def _fail_unschedulable(self) -> list[Request]:
        """With nothing running and the whole cache free, a waiting request that still cannot start never will:
        it fails alone instead of stalling the engine (validation at admission makes this a last resort)."""
        scheduler = self.scheduler
        if scheduler.running or not scheduler.waiting or not self.block_pool.is_whole:
            return []
        request = scheduler.waiting[0]
        scheduler.finish_requests([request], RequestStatus.FAILED, "error",
                                  f"request {request.request_id!r} cannot fit in the KV cache even alone")
        return self._retire([request])

    def _retire(self, requests: list[Request]) -> list[Request]:
        for request in requests:
            if request.is_finished:
                self.requests.pop(request.request_id, None)
        return requests

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix: nothing computed so far is shared with later requests."""
        self.kv_manager.reset_prefix_cache()

    def check_weights(self) -> bool:
        """Resets the prefix cache if the model's weights changed since the last check (KV computed with the
        old weights must never be reused). Returns whether they changed."""
        weights = weights_fingerprint(self.model)
        changed = weights != self._weights
        if changed:
            self.reset_prefix_cache()
            self._weights = weights
        return changed

    def check_integrity(self) -> None:
        """Cache bookkeeping invariants; call when idle to also check that nothing leaked."""
        self.kv_manager.check_integrity()
        if not self.has_unfinished_requests():
            assert self.block_pool.is_whole, "blocks leaked: the pool is not whole while the engine is idle"


def weights_fingerprint(model: PreTrainedModel) -> tuple[tuple[int, int], ...]:
    """Identifies the current weights: each parameter's storage, its in-place version counter (bumped by
    optimizer steps and `load_state_dict`), and a checksum of a few of its values (which also catches writes
    through `.data`, which bypass the version counter)."""
    parameters = list(model.parameters())
    with torch.no_grad():
        samples = torch.stack([p.reshape(-1)[:: max(1, p.numel() // 8)][:8].float().sum() for p in parameters])
    checksums = samples.tolist()
    return tuple((p.data_ptr(), p._version, hash(c)) for p, c in zip(parameters, checksums, strict=True))
