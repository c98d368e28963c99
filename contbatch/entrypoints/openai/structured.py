"""`response_format` and forced tool choices as the engine's per-request constraint, `StructuredOutput`
(`contbatch.engine.structured`), passed to the engine as the sampling keyword `structured_output`.

The mapping functions return the constraint's keywords (`{"json_schema": <schema as JSON text>}` or
`{"json_object": True}`), or None for no constraint; `structured_output` builds the engine's object from them.
"""

from __future__ import annotations

import json
from typing import Any

from contbatch.engine.structured import StructuredOutput
from contbatch.entrypoints.openai.protocol import APIError, FunctionDefinition, ResponseFormat

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def response_format_constraint(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """The constraint of `response_format`: None for none or `{"type": "text"}`, `{"json_object": True}` for
    "json_object", `{"json_schema": ...}` for "json_schema". Raises APIError(400) for another type or a
    "json_schema" without `json_schema.schema`."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type != "json_schema":
        raise APIError(400, f"response_format.type must be one of {', '.join(map(repr, RESPONSE_FORMAT_TYPES))}, "
                            f"got {response_format.type!r}", code="invalid_request", param="response_format.type")
    if response_format.json_schema is None or response_format.json_schema.json_schema is None:
        raise APIError(400, "response_format of type 'json_schema' needs json_schema.schema (a JSON schema object)",
                       code="invalid_request", param="response_format.json_schema")
    return {"json_schema": json.dumps(response_format.json_schema.json_schema)}


def parameters_schema(function: FunctionDefinition) -> dict[str, Any]:
    """The JSON schema of `function`'s arguments: its `parameters`, or an object with no properties."""
    return function.parameters if function.parameters is not None else dict(EMPTY_PARAMETERS)


def named_tool_constraint(function: FunctionDefinition) -> dict[str, Any]:
    """The constraint of a `tool_choice` naming `function`: the reply is its arguments, a JSON object valid
    under its parameters schema (the server builds the call around it, as vLLM does)."""
    return {"json_schema": json.dumps(parameters_schema(function))}


def required_tools_schema(functions: list[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """The schema of a `tool_choice="required"` reply: a non-empty JSON array (of one item when not
    `parallel`) of `{"name": <a function's name>, "arguments": <valid under that function's parameters>}`."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [function.name]},
                                               "arguments": parameters_schema(function)},
              "required": ["name", "arguments"], "additionalProperties": False} for function in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def required_tools_constraint(functions: list[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    return {"json_schema": json.dumps(required_tools_schema(functions, parallel))}


def structured_output(constraint: dict[str, Any] | None, param: str) -> StructuredOutput | None:
    """The engine's `StructuredOutput` of `constraint` (None for None). A constraint it rejects is answered
    400 naming `param`."""
    if constraint is None:
        return None
    try:
        return StructuredOutput(**constraint)
    except ValueError as error:
        raise APIError(400, f"{param}: {error}", code="invalid_request", param=param) from None
