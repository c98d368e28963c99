"""The names contbatch reports under: OpenTelemetry GenAI semantic conventions where they have one, `contbatch.*`
for the engine's own. docs/monitoring.md lists each with its unit."""

from __future__ import annotations

INSTRUMENTATION_SCOPE = "contbatch"

OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
TOKEN_TYPE = "gen_ai.token.type"
ERROR_TYPE = "error.type"
ERROR_MESSAGE = "error.message"

TIME_IN_QUEUE = "contbatch.request.time_in_queue"
TIME_TO_FIRST_TOKEN = "contbatch.request.time_to_first_token"
PREFILL_TIME = "contbatch.request.prefill_time"
DECODE_TIME = "contbatch.request.decode_time"
CACHED_PROMPT_TOKENS = "contbatch.request.cached_prompt_tokens"
PREEMPTIONS = "contbatch.request.preemptions"

EVENT_PREEMPTED = "contbatch.request.preempted"
EVENT_CANCELLED = "contbatch.request.cancelled"
EVENT_FAILED = "contbatch.request.failed"

STEP_SPAN = "contbatch.step"
SCHEDULE_SPAN = "contbatch.step.schedule"
FORWARD_SPAN = "contbatch.step.forward"
SAMPLE_SPAN = "contbatch.step.sample"
BATCH_SIZE = "contbatch.batch.size"
BATCH_PREFILL_TOKENS = "contbatch.batch.prefill_tokens"
BATCH_DECODE_TOKENS = "contbatch.batch.decode_tokens"
BATCH_FILL = "contbatch.batch.fill"
BATCH_PREEMPTED = "contbatch.batch.preempted"

FAILED_ERROR_TYPE = "contbatch.request_failed"

TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TOKEN_USAGE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
BATCH_FILL_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
