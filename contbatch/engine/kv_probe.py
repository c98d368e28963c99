"""What each layer of a model hands its attention function, measured by one forward of two equal tokens at one
position before the KV cache is sized (`probe_layers`).

A config does not always say what the layers compute: MiMo-V2-Flash's sliding layers take twice the config's
key/value heads, JetMoE repeats its keys for each of the experts a token's attention runs, a stray
`num_key_value_heads` in a config whose layers have no grouped-query attention. `model_support.cache_spec` sizes
the cache from these measurements where they cover every layer, and from the config where they do not (a forward
that failed, layers with their own attention code, which the first step then refuses by name).

Nor does a forward's signature say whether it uses the positions it takes: CSM's depth decoder takes `position_ids`
and numbers its tokens itself. Two equal tokens given one position must reach every layer's attention with equal
keys; a layer where they do not (`LayerProbe.renumbered`) fails the first step (`model_support.check_numbering`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from contbatch.engine.attention import METADATA_KWARG, paged_forward, register_paged_attention, remember_own_attention
from contbatch.engine.attention_types import KVShapeProbe
from contbatch.engine.kv_cache import KVCacheGroup, KVCacheSpec, RepeatedCalls, kv_cache_groups
from contbatch.engine.model_support import cache_spec


@dataclass(frozen=True)
class LayerProbe:
    """What the probing forward saw: each attending layer's `(key/value heads, key head size, value head size)` by
    `layer_idx` (empty when the forward raised), how many times each layer called its attention function, and the
    layers whose keys told two equal tokens at one position apart."""

    shapes: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    renumbered: frozenset[int] = frozenset()
    calls: dict[int, int] = field(default_factory=dict)


def probe_layers(model: PreTrainedModel) -> LayerProbe:
    """One forward of two equal tokens (id 0, or 1 where 0 is the embeddings' padding row, all zeros), both at
    position 0 (no cache, no gradient), whose attention calls record their inputs and attend nothing
    (`KVShapeProbe`). The model's attention implementation is switched to contbatch's for the forward and back
    after it. An empty `LayerProbe` when the forward raises."""
    previous = model.config._attn_implementation
    remember_own_attention(model)
    probe = KVShapeProbe({})
    try:
        padding = getattr(model.get_input_embeddings(), "padding_idx", None)
        tokens = torch.full((1, 2), int(padding == 0), dtype=torch.long, device=next(model.parameters()).device)
        positions = torch.zeros_like(tokens)
        model.set_attn_implementation(register_paged_attention())
        with torch.no_grad(), paged_forward(probe):
            model(input_ids=tokens, position_ids=positions, use_cache=False, **{METADATA_KWARG: probe})
    except Exception:  # the first step reports what fails; the config sizes the cache meanwhile
        return LayerProbe()
    finally:
        model.set_attn_implementation(previous)
    return LayerProbe(probe.shapes, frozenset(probe.renumbered), dict(probe.calls))


def cache_layout(model: PreTrainedModel, dtype: torch.dtype,
                 probe: LayerProbe) -> tuple[KVCacheSpec, list[KVCacheGroup], RepeatedCalls]:
    """The KV cache's spec and groups for `model` from what `probe` measured (`model_support.cache_spec`), with a
    cache layer more for each attention call a layer makes beyond its first (`RepeatedCalls`)."""
    spec = cache_spec(model, dtype, probe.shapes)
    repeats = RepeatedCalls.of(spec.num_layers, probe.calls)
    spec = repeats.spec(spec)
    return spec, kv_cache_groups(model.config, spec, repeats), repeats

