"""`response_format` (and the constraints of forced tool choices) as the engine's `StructuredOutput`: the
mapping itself, and against a live server of the embedded model with the `openai` client, outputs that
validate (20 of 20), streamed and not, on both endpoints, and the 400s of bad formats. Also the sampling
defaults the server passes (top_k=0 unless the model's generation config sets one)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.entrypoints.openai.protocol import APIError, CompletionRequest, FunctionDefinition, ResponseFormat
from contbatch.entrypoints.openai.serving import GenerationRequest, _default_top_k, _sampling
from contbatch.entrypoints.openai.structured import (
    named_tool_constraint,
    required_tools_schema,
    response_format_constraint,
)
from tests.entrypoints.openai.embedded_server import EMBEDDED, EmbeddedServed, schema_errors
from tests.helpers import fresh_tiny_model

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                   "color": {"enum": ["red", "green", "blue"]}, "happy": {"type": "boolean"}},
    "required": ["name", "color", "happy"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def served() -> Iterator[EmbeddedServed]:
    server = EmbeddedServed()
    yield server
    server.close()


def test_response_formats_map_to_constraints() -> None:
    assert response_format_constraint(None) is None
    assert response_format_constraint(ResponseFormat(type="text")) is None
    assert response_format_constraint(ResponseFormat(type="json_object")) == {"json_object": True}
    constraint = response_format_constraint(ResponseFormat.model_validate(PERSON_FORMAT))
    assert constraint is not None and json.loads(constraint["json_schema"]) == PERSON
    for bad, param in (({"type": "xml"}, "response_format.type"),
                       ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema")):
        with pytest.raises(APIError) as caught:
            response_format_constraint(ResponseFormat.model_validate(bad))
        assert caught.value.status == 400 and caught.value.param == param


def test_forced_tool_choices_map_to_schemas() -> None:
    weather = FunctionDefinition(name="get_weather", parameters=PERSON)
    bare = FunctionDefinition(name="ping")
    assert json.loads(named_tool_constraint(weather)["json_schema"]) == PERSON
    assert json.loads(named_tool_constraint(bare)["json_schema"]) == {"type": "object", "properties": {}}
    schema = required_tools_schema([weather, bare], parallel=True)
    good = [{"name": "ping", "arguments": {}}, {"name": "get_weather", "arguments": {"name": "Al", "color": "red",
                                                                                     "happy": True}}]
    assert schema_errors(good, schema) == []
    assert schema_errors([], schema) and schema_errors([{"name": "get_weather", "arguments": {}}], schema)
    assert schema_errors([{"name": "nope", "arguments": {}}], schema)
    assert required_tools_schema([bare], parallel=False)["maxItems"] == 1


def test_sampling_passes_top_k_zero_unless_the_model_sets_one() -> None:
    body = CompletionRequest(model="m", prompt="x")
    call = GenerationRequest("r", [[1]], 4, logprobs=False, top_logprobs=0, chat=False)
    assert _sampling(body, call)["top_k"] == 0
    assert _sampling(body, call, default_top_k=None)["top_k"] is None
    assert _sampling(CompletionRequest(model="m", prompt="x", top_k=7), call)["top_k"] == 7
    assert "structured_output" not in _sampling(body, call)


def test_the_server_default_top_k_ignores_transformers_global_default() -> None:
    model = fresh_tiny_model("llama")
    manager = ContinuousBatchingManager(model, None, ContinuousBatchingConfig(block_size=8, num_blocks=32))
    state = SimpleNamespace(client=manager)
    assert _default_top_k(state) == 0  # type: ignore[arg-type]
    model.generation_config.top_k = 20
    assert _default_top_k(state) is None  # type: ignore[arg-type]


def check_person(text: str | None) -> None:
    assert text is not None
    assert schema_errors(json.loads(text), PERSON) == [], text


def test_json_schema_outputs_validate_20_of_20(served: EmbeddedServed) -> None:
    texts = []
    for seed, prompt in enumerate(["Invent a person.", "Describe a cheerful friend as JSON."]):
        reply = served.client.chat.completions.create(
            model=EMBEDDED, messages=[{"role": "user", "content": prompt}], response_format=PERSON_FORMAT,
            n=10, temperature=1.0, seed=seed, max_tokens=64)
        assert [choice.finish_reason for choice in reply.choices] == ["stop"] * 10
        texts += [choice.message.content for choice in reply.choices]
    assert len(texts) == 20
    for text in texts:
        check_person(text)
    assert len(set(texts)) > 1


def test_streamed_json_schema_output_validates(served: EmbeddedServed) -> None:
    stream = served.client.chat.completions.create(
        model=EMBEDDED, messages=[{"role": "user", "content": "A person, please."}], response_format=PERSON_FORMAT,
        temperature=0, max_tokens=64, stream=True)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    check_person("".join(chunk.delta.content or "" for chunk in chunks))
    assert chunks[-1].finish_reason == "stop"


def test_json_object_and_completions_response_format(served: EmbeddedServed) -> None:
    reply = served.client.chat.completions.create(
        model=EMBEDDED, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=40)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.startswith("{")
    completion = served.client.completions.create(model=EMBEDDED, prompt="A person as JSON:", max_tokens=64,
                                                  temperature=0, extra_body={"response_format": PERSON_FORMAT})
    check_person(completion.choices[0].text)


@pytest.mark.parametrize(("response_format", "param"), [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}}, "response_format"),
], ids=["unknown-type", "no-schema", "invalid-schema"])
def test_bad_response_formats_get_400s(served: EmbeddedServed, response_format: dict[str, Any], param: str) -> None:
    body = {"model": EMBEDDED, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": response_format}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    with pytest.raises(openai.BadRequestError):
        served.client.chat.completions.create(model=EMBEDDED, messages=body["messages"], max_tokens=4,
                                              response_format=response_format)  # type: ignore[arg-type]
    assert httpx.get(f"{served.url}/health").status_code == 200
