"""contbatch: continuous batching for any Hugging Face transformers causal LM."""

from contbatch.api import (
    ContinuousMixin,
    add_continuous_batching,
    continuous_batching_context_manager,
    generate_batch,
    init_continuous_batching,
)
from contbatch.config import ContinuousBatchingConfig
from contbatch.engine.engine import LLMEngine
from contbatch.manager import ContinuousBatchingManager
from contbatch.outputs import GenerationOutput, RequestStatus
from contbatch.sampling_params import SamplingParams

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "ContinuousMixin",
    "GenerationOutput",
    "LLMEngine",
    "RequestStatus",
    "SamplingParams",
    "add_continuous_batching",
    "continuous_batching_context_manager",
    "generate_batch",
    "init_continuous_batching",
]
