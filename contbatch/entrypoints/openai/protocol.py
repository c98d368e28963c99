"""The OpenAI request bodies the server accepts (pydantic), and OpenAI-style errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from contbatch.engine.sampling_params import MAX_TOP_LOGPROBS

MAX_N = 16
LOGPROB_FLOOR = -9999.0


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema under `schema` (a JSON schema object)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}`. `type` is checked by the route (another value is a 400)."""

    model_config = ConfigDict(extra="ignore")

    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Unknown fields are ignored, as OpenAI does.

    `logprobs_mode` is an extra body field (as vLLM's are; `extra_body=` in the `openai` client): "raw" (the
    default, OpenAI's meaning) or "processed" (log-probabilities under the distribution the token was drawn from:
    after temperature, top-k and top-p); another value is answered 400 naming it. Tokens removed by top-k or
    top-p have log-probability -inf, reported as LOGPROB_FLOOR since JSON has no infinity.

    OpenAI's `presence_penalty`, `frequency_penalty` and `logit_bias`, and vLLM's extra `repetition_penalty`,
    `min_p`, `min_tokens`, `stop_token_ids` and `ignore_eos`, go to the engine, whose ValueError for a value out
    of range is a 400 naming it. `use_beam_search` (vLLM's) runs beam search with `num_beams` beams (default:
    `n`) and returns the `n` best sequences; `length_penalty` and `early_stopping` are `generate`'s.
    """

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool | None = None
    use_beam_search: bool = False
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    logprobs_mode: str | None = None
    response_format: ResponseFormat | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [stop for stop in stops if stop]


class CompletionRequest(SamplingFields):
    """A /v1/completions body. `prompt` takes OpenAI's four forms: a string, a list of strings, a list of token
    ids, or a list of lists of token ids; several prompts give their choices in prompt order (choice
    `prompt_index * n + sample_index`). `max_tokens=0` generates nothing (with `echo`: scoring only).
    `echo` starts each choice's text, and with `logprobs` its logprobs, with the prompt. `logprobs` above
    MAX_TOP_LOGPROBS is answered 400 naming it (checked by the route, not here, so it is not a 422).
    `prompt_logprobs=k` is vLLM's extra field: each choice gets `prompt_logprobs`, per prompt token None (the
    first) or `{token id: {"logprob", "rank", "decoded_token"}}` for the token and the k most likely there
    (`rank`: its place among those, None when it is not one of them); above MAX_TOP_LOGPROBS is a 400."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0)


class ContentPart(BaseModel):
    """One part of a message's content list; only `{"type": "text", "text": ...}` parts can be rendered."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    """A called function: `arguments` is OpenAI's JSON string (a JSON object is accepted too)."""

    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A message of the history. `content` is a string, a list of text parts, or None (only for an assistant
    message with `tool_calls`); a `tool` message answers the call `tool_call_id`."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message with tool_calls may "
                             "omit it)")
        return self


class FunctionDefinition(BaseModel):
    """A function tool: `parameters` is the JSON schema of its arguments (an object)."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the function the reply must call."""

    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    """A /v1/chat/completions body. `tools` are OpenAI function tools; `tool_choice` is "none", "auto" (the
    default with tools), "required" or a `NamedToolChoice` (another string is a 400, checked by the route);
    `parallel_tool_calls=False` allows at most one call per reply."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(BaseModel):
    """A /tokenize body (vLLM's): the prompt's ids, with the tokenizer's special tokens unless
    `add_special_tokens` is false."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """A /detokenize body (vLLM's): the ids to decode, special tokens kept."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
