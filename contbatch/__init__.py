"""contbatch: continuous batching for any Hugging Face transformers causal LM."""

from contbatch.api import (
    ContinuousMixin,
    add_continuous_batching,
    continuous_batching_context_manager,
    generate_batch,
    init_continuous_batching,
)
from contbatch.engine.config import ContinuousBatchingConfig
from contbatch.engine.engine import LLMEngine
from contbatch.engine.model_support import UnsupportedModelError
from contbatch.engine.sampling_params import SamplingParams
from contbatch.engine.structured import StructuredOutput
from contbatch.frontend.async_client import AsyncClient, ChoiceOutput
from contbatch.frontend.client import EngineClient
from contbatch.manager import ContinuousBatchingManager
from contbatch.outputs import GenerationOutput, RequestStatus
from contbatch.scoring import loglikelihood
from contbatch.telemetry import RequestOrigin, Telemetry

__all__ = [
    "AsyncClient",
    "ChoiceOutput",
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "ContinuousMixin",
    "EngineClient",
    "GenerationOutput",
    "LLMEngine",
    "RequestOrigin",
    "RequestStatus",
    "SamplingParams",
    "StructuredOutput",
    "Telemetry",
    "UnsupportedModelError",
    "add_continuous_batching",
    "continuous_batching_context_manager",
    "generate_batch",
    "init_continuous_batching",
    "loglikelihood",
]
