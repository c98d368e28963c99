"""contbatch: continuous batching for any Hugging Face transformers causal LM."""

from contbatch.api import ContinuousMixin, add_continuous_batching, generate_batch
from contbatch.config import ContinuousBatchingConfig
from contbatch.engine.engine import LLMEngine
from contbatch.outputs import GenerationOutput, RequestStatus
from contbatch.sampling_params import SamplingParams

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousMixin",
    "GenerationOutput",
    "LLMEngine",
    "RequestStatus",
    "SamplingParams",
    "add_continuous_batching",
    "generate_batch",
]
