"""Which models contbatch's paged attention computes exactly, checked on the model's own forward.

contbatch runs a stock model and replaces only its attention function, so it is exact for a model whose every
layer attends through transformers' `AttentionInterface` with nothing beyond what the paged attention implements.
A model whose layers run their own attention code (BLOOM; GPT-J and CodeGen before transformers 5.24, Falcon
before 5.25) or keep a recurrent state (Mamba and hybrid layers) would attend without the cache and give wrong
tokens silently; these checks turn that into an `UnsupportedModelError` naming what the model does:
- every layer of the cache must run the paged attention exactly once in the engine's first forward
  (`check_attended`, from the layers `PagedAttentionMetadata.attended` records);
- a model must not ask for ALiBi, which Falcon adds to its attention mask (`check_position_bias`, before the
  first forward);
- a layer's keys must have the heads and head size its config gave the cache (`check_kv_shape`);
- a layer must not pass attention inputs the paged attention does not implement (`check_attention_kwargs`:
  another form of attention sinks, a position bias, sparse attention's indices), nor attend bidirectionally
  (`is_causal` False, as an encoder's layers do); gpt-oss's sinks (`s_aux`) it implements (`attention_sinks`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PretrainedConfig

from contbatch.engine.kv_cache import KVCacheSpec

UNSUPPORTED_ATTENTION_KWARGS = {
    "sinks": "attention sinks",
    "position_bias": "a position bias",
    "indices": "sparse attention's indices",
    "block_indices": "sparse attention's block indices",
}


class UnsupportedModelError(RuntimeError):
    """The model computes something contbatch's paged attention cannot reproduce; its requests fail with this
    (their `error` starts with `UNSUPPORTED_PREFIX`)."""


UNSUPPORTED_PREFIX = f"{UnsupportedModelError.__name__}: "


def raise_if_unsupported(error: str | None) -> None:
    """Raises the `UnsupportedModelError` that failed a request whose `error` this is (a model-wide failure: every
    request would fail alike); returns for any other error, or none."""
    if error and error.startswith(UNSUPPORTED_PREFIX):
        raise UnsupportedModelError(error.removeprefix(UNSUPPORTED_PREFIX))


def chunked_attention_limit(config: PretrainedConfig) -> int | None:
    """The positions a request may span on a model with chunked-attention layers (Llama 4's `layer_types`
    "chunked_attention": a query sees only the keys of its own `attention_chunk_size` chunk), or None. Within one
    chunk they attend as full attention does; past it contbatch would attend across chunks, so requests stop there."""
    text = config.get_text_config()
    if "chunked_attention" not in (getattr(text, "layer_types", None) or []):
        return None
    return getattr(text, "attention_chunk_size", None)


def check_attention_kwargs(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> None:
    """Raises `UnsupportedModelError` if the attention function's keywords hold an input it does not implement,
    or if the layer attends bidirectionally: its `is_causal` keyword, else its module's `is_causal` attribute, is
    False (transformers' own attention functions read them in that order), as an encoder's layers do (BERT and
    its kin unless their config says `is_decoder=True`)."""
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if causal is False:
        raise UnsupportedModelError(
            f"{type(module).__name__} attends bidirectionally (is_causal=False), and contbatch's paged attention "
            f"is causal only (an encoder-style model: for BERT and its kin, set is_decoder=True in the config)")
    for name in UNSUPPORTED_ATTENTION_KWARGS.keys() & kwargs.keys():
        if kwargs[name] is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} passes '{name}' ({UNSUPPORTED_ATTENTION_KWARGS[name]}) to its attention "
                f"function, which contbatch's paged attention does not implement")


def attention_sinks(module: torch.nn.Module, kwargs: Mapping[str, Any], num_heads: int) -> torch.Tensor | None:
    """The layer's attention sinks (gpt-oss's `s_aux`: one logit per query head, added to its softmax's
    denominator) as a contiguous float32 [num_heads] tensor, or None; raises `UnsupportedModelError` for another
    shape."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (num_heads,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise UnsupportedModelError(f"{type(module).__name__} passes attention sinks 's_aux' of shape {shape}; "
                                    f"contbatch takes one per query head ({num_heads})")
    return sinks.detach().float().contiguous()


def check_kv_shape(layer: int, key: torch.Tensor, spec: KVCacheSpec) -> None:
    """Raises `UnsupportedModelError` if `key` [1, kv_heads, tokens, head_dim] does not fit the cache's `spec`."""
    heads, head_dim = key.shape[1], key.shape[-1]
    if heads != spec.num_kv_heads or head_dim != spec.head_dim:
        raise UnsupportedModelError(
            f"layer {layer} computes {heads} key/value heads of size {head_dim}, but the KV cache was sized from "
            f"the model's config for {spec.num_kv_heads} of size {spec.head_dim} (num_key_value_heads, head_dim)")


def check_attended(model: torch.nn.Module, attended: Sequence[int], num_layers: int) -> None:
    """Raises `UnsupportedModelError` unless `attended` (the layers that ran the paged attention in one forward,
    in call order) holds every layer of `range(num_layers)` exactly once."""
    counts = Counter(attended)
    if len(attended) == num_layers and set(counts) == set(range(num_layers)):
        return
    name = type(model).__name__
    missing = [layer for layer in range(num_layers) if layer not in counts]
    repeated = sorted(layer for layer, count in counts.items() if count > 1)
    unknown = sorted(layer for layer in counts if not 0 <= layer < num_layers)
    compatible = getattr(model, "is_backend_compatible", None)
    flag = f"; {name}.is_backend_compatible() is {compatible()}" if callable(compatible) else ""
    raise UnsupportedModelError(
        f"{name}: {len(counts) - len(unknown)} of its {num_layers} layers ran contbatch's paged attention in a forward"
        + (f" (missing: {_listed(missing)})" if missing else "")
        + (f" (more than once: {_listed(repeated)})" if repeated else "")
        + (f" (not among its layers: {_listed(unknown)})" if unknown else "")
        + f". contbatch runs models whose every layer attends through transformers' AttentionInterface; this "
        f"one's layers do not (their own attention code, or state-space layers{flag}), so its outputs would be "
        "wrong")


def check_position_bias(model: torch.nn.Module) -> None:
    """Raises `UnsupportedModelError` for a model whose config asks for ALiBi (Falcon's `alibi=True`): such a model
    adds its position bias to the attention mask it builds, and inside contbatch's forwards the mask builders return
    none (masking comes from the batch's metadata), so the bias would be lost."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if isinstance(config, PretrainedConfig) else None
    if getattr(text, "alibi", False) is True:
        raise UnsupportedModelError(
            f"{type(model).__name__}: its config sets alibi=True, a position bias added to the attention mask, "
            "which contbatch's paged attention does not implement")


def _listed(layers: Sequence[int]) -> str:
    shown = ", ".join(str(layer) for layer in layers[:8])
    more = f" and {len(layers) - 8} more" if len(layers) > 8 else ""
    return ("layer " if len(layers) == 1 else "layers ") + shown + more
