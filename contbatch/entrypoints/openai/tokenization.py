"""The tokenizer routes at the server root, as vLLM serves them and lm-evaluation-harness's remote tokenizer calls
them: POST /tokenize, POST /detokenize and GET /tokenizer_info. They run no model; like /health they need no API
key (only /v1 routes do)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from contbatch.data.prompts import as_token_ids
from contbatch.entrypoints.openai.protocol import APIError, DetokenizeRequest, TokenizeRequest
from contbatch.entrypoints.openai.serving import ServerState, check_model, server_state

router = APIRouter()

_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """`{"tokens": ids, "count": len(ids), "max_model_len": positions or None}` for `body.prompt`."""
    state = _checked(request, body.model)
    ids = as_token_ids(state.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len(state)}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """`{"prompt": text}`: `body.tokens` decoded, special tokens kept. An id outside the model's vocabulary is
    answered 400 naming it."""
    state = _checked(request, body.model)
    vocab = vocab_size(state)
    for position, token_id in enumerate(body.tokens):
        if not 0 <= token_id < vocab:
            raise APIError(400, f"tokens[{position}]: token id {token_id} is outside the vocabulary [0, {vocab})",
                           code="invalid_request", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The tokenizer's description (vLLM's fields that lm-eval's remote tokenizer reads): its class, its special
    tokens as strings and ids (each key present, None when the tokenizer has none), its chat template (a
    string, or None), `model_max_length` and `max_model_len` (the model's positions, or None when unknown),
    `vocab_size` (the model's) and `add_bos_token`."""
    state = server_state(request)
    tokenizer = state.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for name in _SPECIAL_TOKENS:
        token = getattr(tokenizer, name, None)
        info[name] = token if isinstance(token, str) else None
        info[f"{name}_id"] = getattr(tokenizer, f"{name}_id", None) if info[name] is not None else None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    positions = max_model_len(state)
    info.update(chat_template=template if isinstance(template, str) else None, model_max_length=positions,
                max_model_len=positions, vocab_size=vocab_size(state),
                add_bos_token=bool(getattr(tokenizer, "add_bos_token", False)))
    return info


def max_model_len(state: ServerState) -> int | None:
    """The model's positions (`max_position_embeddings`), or None when its config has no such limit."""
    try:
        return state.client.engine.max_position_embeddings
    except RuntimeError:
        return None


def vocab_size(state: ServerState) -> int:
    """The model's vocabulary size (its input embeddings), or the tokenizer's while the engine is released."""
    try:
        return state.client.engine.vocab_size
    except RuntimeError:
        return len(state.tokenizer)


def _checked(request: Request, model: str | None) -> ServerState:
    state = server_state(request)
    if model is not None:
        check_model(state, model)
    return state
