"""`ContinuousBatchingConfig`: how the engine sizes its cache and batches, validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import CompileConfig

from contbatch.engine.cpu_features import cpu_has_amx

SCHEDULER_TYPES = ("fifo", "prefill_first")
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 512, "cuda": 4096}
AMX_MAX_BATCH_TOKENS = 4096


@dataclass(frozen=True)
class ContinuousBatchingConfig:
    """Every field of transformers' `ContinuousBatchingConfig`, with the same names and defaults, and one of
    contbatch's own: `max_prefill_tokens_while_decoding`.

    Attributes:
        block_size: tokens per KV-cache block.
        num_blocks: blocks in the cache; None sizes it from `max_memory_percent` of the memory left after the
            model (on CPU: of the available RAM).
        max_batch_tokens: the token budget of one forward pass; None picks a default for the device.
        max_memory_percent: share of the free memory the cache may take, in (0, 1].
        max_blocks_per_request: caps the blocks one request may hold (0: no cap beyond the cache itself).
        allow_block_sharing: allow requests to share KV blocks (prefix caching); it can only be allowed, never
            forced.
        varlen_compile_config, decode_compile_config: `torch.compile` settings of the steps that prefill (varlen)
            and of the steps where every request decodes one token; None runs that path eagerly, unless
            `use_default_compile_configs` is set or the generation config has a `compile_config` (the fallback
            transformers takes; `disable_compile` turns it off). The model's forward is compiled whole, attention
            included as the custom op `contbatch::paged_attention` (see `contbatch.engine.compile`).
        use_default_compile_configs: compile the paths left None with `default_compile_config` (inductor,
            dynamic shapes).
        use_cuda_graph: replay decode steps (every request computes one token) from captured CUDA graphs
            (`contbatch.engine.cuda_graphs`). None: on for a model on a CUDA device, unless the decode compile
            config captures graphs itself (inductor's "reduce-overhead"); True on a CPU warns and runs without.
        q_padding_interval_size: a graph's batch is padded to a multiple of this many requests (0: 8).
        kv_padding_interval_size: a graph's key range is padded to a multiple of this many tokens (0: 256).
        max_cached_graphs: captured graphs kept, least recently used dropped first (0: 64).
        use_async_batching: schedule and prepare step N+1 on the host while step N's forward runs (on a worker
            thread on a CPU; on a GPU its launched kernels), carrying the tokens N samples into N+1
            (`contbatch.engine.step_pipeline`); outputs are the synchronous engine's. None: on for a model on a
            CUDA device (1.6-1.9x the synchronous engine's tok/s on an H200 with decode graphs); off on a CPU,
            where the host work it hides is about 2% of a step.
        scheduler_type: "fifo" (decodes first, then new prefills, in arrival order) or "prefill_first"
            (waiting prompts are admitted before running decodes take the budget).
        return_logprobs: record the log-probability of every generated token.
        max_queue_size: bound on requests waiting to be admitted (0: unbounded).
        max_prefill_tokens_while_decoding: in a step where some request is decoding, the requests that compute
            more than one token (prompts, whole or in chunks, and sequences recomputed after preemption) get at
            most this many tokens in all; decodes are bounded by `max_batch_tokens` alone. It bounds the delay a
            burst of new prompts adds between the tokens of the requests already generating, at about the same
            throughput (stall-free batching, as in Sarathi-Serve). None: no bound beyond `max_batch_tokens`.
            `contbatch serve` sets 128 on CPU (docs/performance.md).
    """

    block_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float = 0.8
    max_blocks_per_request: int | None = 0
    allow_block_sharing: bool = True
    use_async_batching: bool | None = None
    use_cuda_graph: bool | None = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    max_cached_graphs: int = 0
    varlen_compile_config: CompileConfig | None = None
    decode_compile_config: CompileConfig | None = None
    use_default_compile_configs: bool = False
    scheduler_type: str = "fifo"
    return_logprobs: bool = False
    max_queue_size: int = 0
    max_prefill_tokens_while_decoding: int | None = None

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.num_blocks is not None:
            _positive_int("num_blocks", self.num_blocks)
        for name in ("max_batch_tokens", "max_prefill_tokens_while_decoding"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        percent = self.max_memory_percent
        if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 < percent <= 1:
            raise ValueError(f"max_memory_percent must be in (0, 1], got {percent!r}")
        for name in ("max_blocks_per_request", "q_padding_interval_size", "kv_padding_interval_size",
                     "max_cached_graphs", "max_queue_size"):
            value = getattr(self, name)
            if name == "max_blocks_per_request" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("allow_block_sharing", "use_default_compile_configs", "return_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("use_async_batching", "use_cuda_graph"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be a bool or None, got {getattr(self, name)!r}")
        for name in ("varlen_compile_config", "decode_compile_config"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, CompileConfig):
                raise ValueError(f"{name} must be a transformers CompileConfig or None, got {value!r}")
        if self.scheduler_type not in SCHEDULER_TYPES:
            raise ValueError(f"scheduler_type must be one of {SCHEDULER_TYPES}, got {self.scheduler_type!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_sources(cls, config: ContinuousBatchingConfig | None, *sources: Any) -> ContinuousBatchingConfig:
        """`config` (or the defaults) updated with the config fields found in `sources`, in order.

        A source is a mapping (e.g. `generate_batch`'s **kwargs) or an object with attributes (e.g. a
        `GenerationConfig` that carries `max_batch_tokens`, as in transformers' older examples); None values
        are skipped.
        """
        values = {name: getattr(config, name) for name in cls.field_names()} if config else {}
        for source in sources:
            for name in cls.field_names():
                value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
                if value is not None:
                    values[name] = value
        return cls(**values)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def default_max_batch_tokens(device_type: str, dtype: torch.dtype) -> int:
    """The token budget of a step when the config leaves `max_batch_tokens` unset: `DEFAULT_MAX_BATCH_TOKENS` for
    the device (4,096 for a device it does not name), but `AMX_MAX_BATCH_TOKENS` for a bfloat16 model on a CPU with
    AMX, whose products keep gaining from longer prompt chunks well past 512 rows (docs/performance.md, "a
    sixtieth session"; 4,096 rather than 2,048 since "a sixty-fifth session": 7% off lm-eval's 3-shot prompts)."""
    if device_type == "cpu" and dtype == torch.bfloat16 and cpu_has_amx():
        return AMX_MAX_BATCH_TOKENS
    return DEFAULT_MAX_BATCH_TOKENS.get(device_type, 4096)
