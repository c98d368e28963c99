"""Which models contbatch's paged attention computes exactly, checked on the model's own forward.

contbatch runs a stock model and replaces only its attention function, so it is exact for a model whose every
layer attends through transformers' `AttentionInterface` with nothing beyond what the paged attention implements.
A model whose layers run their own attention code (BLOOM; GPT-J and CodeGen before transformers 5.24, Falcon
before 5.25) or keep a recurrent state (Mamba and hybrid layers) would attend without the cache and give wrong
tokens silently; these checks turn that into an `UnsupportedModelError` naming what the model does:
- every layer of the cache must run the paged attention exactly once in the engine's first forward
  (`check_attended`, from the layers `PagedAttentionMetadata.attended` records), and then the model's decoder must
  take the tokens' positions (`check_positions`: BART's numbers them itself) and its forward return only the
  logits asked for (`check_logits_kept`: Whisper's decoder returns every token's);
- a model's config must not ask for ALiBi, which Falcon adds to its attention mask, nor for layers that keep a
  recurrent state (Mamba, short convolutions, linear attention; Falcon-H1's hybrid layers) (`check_config`,
  before the first forward), and the engine's probing forward must have shown the model numbering its tokens by
  the positions it is given (`check_numbering`: CSM's depth decoder takes them and numbers its tokens itself);
- a layer's keys and values must have the heads and head sizes the cache was sized for (`check_kv_shape`: from
  what the layers computed in the probing forward of `kv_probe`, else from the config), its values no larger
  than its keys, and a layer must not attend over more positions than its cache group keeps (`check_window`);
- a config must give attention heads (`cache_spec`: Mamba and RWKV have none), checked when the engine is built;
- a layer must not pass attention inputs the paged attention does not implement (`check_attention_kwargs`:
  another form of attention sinks, a position bias, sparse attention's indices), nor attend bidirectionally
  (`is_causal` False, as an encoder's layers do), nor pass a mask of its own making (Doge's dynamic mask);
  gpt-oss's sinks (`s_aux`) it implements (`attention_sinks`).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

import torch
from transformers import PretrainedConfig, PreTrainedModel

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


def check_attention_kwargs(module: torch.nn.Module, kwargs: Mapping[str, Any],
                           attention_mask: torch.Tensor | None = None) -> None:
    """Raises `UnsupportedModelError` if the attention function's keywords hold an input it does not implement,
    or if the layer attends bidirectionally: its `is_causal` keyword, else its module's `is_causal` attribute, is
    False (transformers' own attention functions read them in that order), as an encoder's layers do (BERT and
    its kin unless their config says `is_decoder=True`) and a prefix LM's over its prompt (PaliGemma); or if the
    layer passes an `attention_mask` of its own making: inside contbatch's forward every mask builder of
    transformers returns None (`paged_attention_mask`), so a mask is one the layer built, a bias over keys
    (Doge's dynamic mask) or masking contbatch's does not apply."""
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if causal is False:
        raise UnsupportedModelError(
            f"{type(module).__name__} attends bidirectionally (is_causal=False), and contbatch's paged attention "
            f"is causal only (an encoder's layers, or a prefix LM's such as PaliGemma's over its prompt; BERT and its "
            f"kin attend causally with is_decoder=True in their config)")
    for name in UNSUPPORTED_ATTENTION_KWARGS.keys() & kwargs.keys():
        if kwargs[name] is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} passes '{name}' ({UNSUPPORTED_ATTENTION_KWARGS[name]}) to its attention "
                f"function, which contbatch's paged attention does not implement")
    if attention_mask is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} passes an attention mask of its own making to its attention function (a bias "
            "or masking over the keys), which contbatch's paged attention does not apply")


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


def check_kv_shape(layer: int, key: torch.Tensor, value: torch.Tensor, spec: KVCacheSpec) -> None:
    """Raises `UnsupportedModelError` if `key` or `value` [1, kv_heads, tokens, head_dim] does not fit the cache's
    `spec` (`shape_of` for keys; values of the same heads, of `value_dim_of`)."""
    heads, head_dim = key.shape[1], key.shape[-1]
    if (heads, head_dim) != spec.shape_of(layer):
        expected_heads, expected_size = spec.shape_of(layer)
        raise UnsupportedModelError(
            f"layer {layer} computes {heads} key/value heads of size {head_dim}, but the KV cache was sized "
            f"{_sized_from(spec)} for {expected_heads} of size {expected_size}"
            + _config_fields(spec, "num_key_value_heads, head_dim"))
    if value.shape[1] != heads or value.shape[-1] != spec.value_dim_of(layer):
        raise UnsupportedModelError(
            f"layer {layer} computes values of {value.shape[1]} heads of size {value.shape[-1]} beside keys of "
            f"{heads} of size {head_dim}, but the KV cache was sized {_sized_from(spec)} for values of {heads} heads "
            f"of size {spec.value_dim_of(layer)}" + _config_fields(spec, "v_head_dim, else head_dim"))


def _sized_from(spec: KVCacheSpec) -> str:
    return "from the layers' shapes in the engine's probing forward" if spec.measured else "from the model's config"


def _config_fields(spec: KVCacheSpec, fields: str) -> str:
    return "" if spec.measured else f" ({fields})"


def check_window(layer: int, sliding_window: int | None, kept: int | None) -> None:
    """Raises `UnsupportedModelError` if `layer` attends with `sliding_window` (None: all positions) while its cache
    group keeps only the last `kept` positions: the cache dropped keys the layer would see."""
    if kept is not None and (sliding_window is None or sliding_window > kept):
        raise UnsupportedModelError(
            f"layer {layer} attends with window {sliding_window}, but its cache group keeps only the last {kept} "
            "positions: the model config's layer_types/sliding_window disagree with what the layer passes to its "
            "attention function")


def check_attended(model: torch.nn.Module, attended: Sequence[int], layers: Sequence[int]) -> None:
    """Raises `UnsupportedModelError` unless `attended` (the layers that ran the paged attention in one forward,
    in call order) holds each of `layers` (the KV cache's, ascending) exactly once, and no other layer."""
    counts = Counter(attended)
    if len(attended) == len(layers) and set(counts) == set(layers):
        return
    name = type(model).__name__
    missing = [layer for layer in layers if layer not in counts]
    repeated = sorted(layer for layer, count in counts.items() if count > 1)
    unknown = sorted(set(counts) - set(layers))
    compatible = getattr(model, "is_backend_compatible", None)
    flag = f"; {name}.is_backend_compatible() is {compatible()}" if callable(compatible) else ""
    raise UnsupportedModelError(
        f"{name}: {len(counts) - len(unknown)} of its {len(layers)} layers ran contbatch's paged attention in a forward"
        + (f" (missing: {_listed(missing)})" if missing else "")
        + (f" (more than once: {_listed(repeated)})" if repeated else "")
        + (f" (not among its layers: {_listed(unknown)})" if unknown else "")
        + f". contbatch runs models whose every layer attends through transformers' AttentionInterface; this "
        f"one's layers do not (their own attention code, or state-space layers{flag}), so its outputs would be "
        "wrong")


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""The layer types (a config's `layer_types`) contbatch's paged attention computes."""
RECURRENT_LAYER_TYPES = ("conv", "linear_attention", "hybrid", "hybrid_sliding")
"""transformers' cache layer types that hold a recurrent state (a convolution's or a state-space / linear
attention's) beside or instead of keys and values."""


def check_config(model: torch.nn.Module) -> None:
    """Raises `UnsupportedModelError`, before any forward, for a model whose config asks for what contbatch's paged
    attention cannot reproduce:
    - ALiBi (Falcon's `alibi=True`): such a model adds its position bias to the attention mask it builds, and
      inside contbatch's forwards the mask builders return none (masking comes from the batch's metadata);
    - layers that keep a recurrent state (`layer_types` in `RECURRENT_LAYER_TYPES`: Mamba, short convolutions,
      linear attention), which a KV cache cannot hold. Falcon-H1's "hybrid" layers run such a mixer beside their
      attention, so every layer still attends through contbatch and `check_attended` would pass them;
    - any other layer type but `ATTENTION_LAYER_TYPES` (sparse attention over indexed keys, compressed keys, layers
      without attention);
    - recurrent layers whose earlier loops read the keys the last loop cached (Dory's `recurrent_kv_cache_mode`
      "last_loop"): contbatch keeps each call's own keys (`kv_cache.RepeatedCalls`), as "per_loop" does."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if isinstance(config, PretrainedConfig) else None
    name = type(model).__name__
    if getattr(text, "alibi", False) is True:
        raise UnsupportedModelError(
            f"{name}: its config sets alibi=True, a position bias added to the attention mask, which contbatch's "
            "paged attention does not implement")
    layer_types = list(getattr(text, "layer_types", None) or [])
    recurrent = [index for index, kind in enumerate(layer_types) if kind in RECURRENT_LAYER_TYPES]
    if recurrent:
        raise UnsupportedModelError(_layer_types_error(
            name, layer_types, recurrent, ("keeps", "keep"),
            "a recurrent state (a state-space, linear-attention or convolution mixer), which contbatch's paged KV "
            "cache cannot hold"))
    other = [index for index, kind in enumerate(layer_types) if kind not in ATTENTION_LAYER_TYPES]
    if other:
        raise UnsupportedModelError(_layer_types_error(
            name, layer_types, other, ("asks for", "ask for"),
            f"an attention contbatch's paged attention does not implement (it computes "
            f"{', '.join(ATTENTION_LAYER_TYPES)})"))
    mode = getattr(text, "recurrent_kv_cache_mode", "per_loop")
    if mode != "per_loop":
        raise UnsupportedModelError(
            f"{name}: its config sets recurrent_kv_cache_mode={mode!r}: its recurrent layers' earlier loops read the "
            "keys the last loop cached, where contbatch keeps each loop's own (as 'per_loop' does)")


def check_positions(model: torch.nn.Module) -> None:
    """Raises `UnsupportedModelError` for a model whose decoder (`get_decoder()`) takes no `position_ids`: it
    numbers a forward's tokens itself, from its cache's length (BART and its kin's decoders), where contbatch's
    steps pack many requests' tokens, each at its own position. Run after `check_attended`, which names a model
    with its own attention code first (BLOOM, whose ALiBi needs no position ids either)."""
    decoder = model.get_decoder() if isinstance(model, PreTrainedModel) else None
    if isinstance(decoder, PreTrainedModel) and "position_ids" not in inspect.signature(decoder.forward).parameters:
        raise UnsupportedModelError(
            f"{type(model).__name__}: its decoder ({type(decoder).__name__}) takes no position_ids and numbers its "
            "tokens itself, from its cache's length; contbatch's steps pack many requests' tokens, each at its own "
            "position")


def check_numbering(model: torch.nn.Module, renumbered: Collection[int]) -> None:
    """Raises `UnsupportedModelError` when the engine's probing forward (`kv_probe.probe_layers`) saw two equal
    tokens at one position reach the attention of the layers `renumbered` with different keys: the model takes
    `position_ids` and numbers its tokens otherwise (CSM's depth decoder, from its cache's length), or mixes tokens
    outside its attention, where contbatch's steps pack many requests' tokens, each at its own position; a decoder
    that takes no `position_ids` is named for that (`check_positions`). Run after `check_config`, which names layers
    that mix tokens by design (short convolutions) first."""
    if renumbered:
        check_positions(model)
        raise UnsupportedModelError(
            f"{type(model).__name__}: two equal tokens given one position reached the attention of "
            f"{_listed(sorted(renumbered))} with different keys: its forward does not number its tokens by the "
            "position_ids it takes (it numbers them itself, or mixes them outside its attention); contbatch's steps "
            "pack many requests' tokens, each at its own position")


def check_logits_kept(model: torch.nn.Module, rows: int, kept: int) -> None:
    """Raises `UnsupportedModelError` for a model whose forward returned logits of `rows` rows where `kept` were
    asked for (`logits_to_keep`, the rows each request samples or scores from): its forward takes no
    `logits_to_keep` (Whisper's decoder as a causal LM) and returns every packed token's logits, whose first rows
    are not the requests' last tokens."""
    if rows != kept:
        raise UnsupportedModelError(
            f"{type(model).__name__}: its forward returned logits for {rows} tokens where {kept} were asked for "
            "(logits_to_keep): it computes every token's logits, and contbatch reads the requests' own rows from "
            "what the forward keeps")


def input_vocab_size(model: torch.nn.Module) -> int:
    """How many token ids `model` takes: its input embeddings' rows. Raises `UnsupportedModelError` where those are
    not one table of token ids (MusicGen's decoder embeds one token per codebook a position)."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    size = getattr(embeddings, "num_embeddings", None)
    if not isinstance(size, int):
        raise UnsupportedModelError(
            f"{type(model).__name__}: its input embeddings ({type(embeddings).__name__}) are not one table of token "
            "ids; contbatch runs models that take one token id a position")
    return size


def _layer_types_error(name: str, layer_types: list[str], layers: list[int], verbs: tuple[str, str],
                       what: str) -> str:
    kinds = ", ".join(sorted({layer_types[index] for index in layers}))
    return f"{name}: {_listed(layers)} of its config's layer_types ({kinds}) {verbs[len(layers) > 1]} {what}"


def cache_spec(model: torch.nn.Module, dtype: torch.dtype,
               measured: Mapping[int, tuple[int, int, int]] | None = None) -> KVCacheSpec:
    """The KV cache's shapes for `model`: each layer's `(key/value heads, key head size, value head size)` as
    `measured` (`kv_probe.probe_layers`: what the layers handed their attention function in a probing
    forward) where that covers every layer, else as the config gives them (`KVCacheSpec.from_model_config`, or
    a heterogeneous config's `per_layer_config`: Gemma 4's 256 dimensions in its sliding layers, 512 in its full
    ones). Raises `UnsupportedModelError` for a config without attention heads (`num_attention_heads`: a
    state-space model such as Mamba or RWKV, whose layers keep a recurrent state instead of keys and values), and
    for a layer whose values are larger than its keys."""
    config = cast(PretrainedConfig, model.config)
    text = config.get_text_config()
    name = type(model).__name__
    if getattr(text, "num_attention_heads", None) is None:
        raise UnsupportedModelError(
            f"{name}: its config has no attention heads (num_attention_heads); contbatch runs models "
            "that attend, and this one's layers keep a recurrent state instead, which a paged KV cache cannot hold")
    spec = _config_spec(config, dtype)
    if measured and set(measured) == set(range(spec.num_layers)):
        spec = _measured_spec(spec, measured)
    for layer in range(spec.num_layers):
        keys, values = spec.shape_of(layer)[1], spec.value_dim_of(layer)
        if values > keys:
            raise UnsupportedModelError(
                f"{name}: layer {layer}'s values have {values} dimensions and its keys {keys}; contbatch's paged KV "
                "cache holds values no larger than the keys")
    return spec


def _config_spec(config: PretrainedConfig, dtype: torch.dtype) -> KVCacheSpec:
    text = config.get_text_config()
    if not getattr(text, "is_heterogeneous", False):
        return KVCacheSpec.from_model_config(config, dtype)
    shapes = []
    for layer in text.per_layer_config:
        heads = layer.num_attention_heads
        shapes.append((getattr(layer, "num_key_value_heads", None) or heads,
                       getattr(layer, "head_dim", None) or layer.hidden_size // heads))
    largest = max(shapes, key=lambda shape: shape[0] * shape[1])
    return KVCacheSpec(len(shapes), *largest, dtype, tuple(shapes) if len(set(shapes)) > 1 else ())


def _measured_spec(spec: KVCacheSpec, measured: Mapping[int, tuple[int, int, int]]) -> KVCacheSpec:
    """The spec of `measured` shapes; `spec` (the config's) where the layers' value sizes differ from their keys'
    in more than one way, which one `value_head_dim` cannot say (`check_kv_shape` then names the layer)."""
    shapes = [measured[layer][:2] for layer in range(spec.num_layers)]
    values = [measured[layer][2] for layer in range(spec.num_layers)]
    if all(value == shape[1] for shape, value in zip(shapes, values, strict=True)):
        value_dim = None
    elif len(set(values)) == 1:
        value_dim = values[0]
    else:
        return spec
    largest = max(shapes, key=lambda shape: shape[0] * shape[1])
    return KVCacheSpec(spec.num_layers, *largest, spec.dtype, tuple(shapes) if len(set(shapes)) > 1 else (),
                       value_dim, measured=True)


def _listed(layers: Sequence[int]) -> str:
    shown = ", ".join(str(layer) for layer in layers[:8])
    more = f" and {len(layers) - 8} more" if len(layers) > 8 else ""
    return ("layer " if len(layers) == 1 else "layers ") + shown + more
