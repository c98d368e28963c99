"""A live server of the embedded model (SmolLM2-135M-Instruct) on 127.0.0.1, for the tests of tool calling and
structured outputs, which need a model that writes sensible text."""

from __future__ import annotations

from typing import Any

import openai
import torch

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.data.embedded import load_model_and_tokenizer
from contbatch.entrypoints.openai.app import create_app
from tests.entrypoints.openai.test_server import LiveServer

EMBEDDED = "smollm2"


class EmbeddedServed:
    """The embedded model on CPU behind `create_app`, with an `openai` client."""

    def __init__(self, **app_options: Any) -> None:
        torch.manual_seed(0)
        model, self.tokenizer = load_model_and_tokenizer(dtype=torch.float32, device="cpu")
        self.manager = ContinuousBatchingManager(
            model, model.generation_config,
            ContinuousBatchingConfig(block_size=16, num_blocks=1024, max_batch_tokens=512), tokenizer=self.tokenizer)
        self.manager.start()
        self.live = LiveServer(create_app(self.manager, self.tokenizer, EMBEDDED, **app_options))
        self.url = self.live.url
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def close(self) -> None:
        self.live.stop()
        self.manager.stop()


_TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
                                       "integer": (int,), "number": (int, float), "null": (type(None),)}


def schema_errors(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """What makes `value` invalid under `schema`, for the JSON-schema keywords these tests use (type, enum,
    properties, required, additionalProperties: false, min/maxLength, minimum/maximum, items, min/maxItems,
    anyOf); empty when valid."""
    errors: list[str] = []
    expected = schema.get("type")
    if expected is not None:
        bad_bool = isinstance(value, bool) and expected in ("integer", "number")
        if bad_bool or not isinstance(value, _TYPES[expected]):
            return [f"{where}: {value!r} is not of type {expected}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if "anyOf" in schema and all(schema_errors(value, option, where) for option in schema["anyOf"]):
        errors.append(f"{where}: {value!r} matches none of anyOf")
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        errors.append(f"{where}: {value!r} has a length outside the bounds")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        errors.append(f"{where}: {value!r} is outside the bounds")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [f"{where}: misses {name!r}" for name in schema.get("required", []) if name not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{where}: has the extra key {key!r}" for key in value if key not in properties]
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], f"{where}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{where}: {len(value)} items is outside the bounds")
        for index, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{where}[{index}]")
    return errors
