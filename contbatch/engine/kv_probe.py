"""What each layer of a model hands its attention function, measured by one forward of one token before the KV
cache is sized (`measure_kv_shapes`).

A config does not always say what the layers compute: MiMo-V2-Flash's sliding layers take twice the config's
key/value heads, JetMoE repeats its keys for each of the experts a token's attention runs, a stray
`num_key_value_heads` in a config whose layers have no grouped-query attention. `model_support.cache_spec` sizes
the cache from these measurements where they cover every layer, and from the config where they do not (a forward
that failed, layers with their own attention code, which the first step then refuses by name).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from contbatch.engine.attention import METADATA_KWARG, paged_forward, register_paged_attention, remember_own_attention
from contbatch.engine.attention_types import KVShapeProbe


def measure_kv_shapes(model: PreTrainedModel) -> dict[int, tuple[int, int, int]]:
    """Each attending layer's `(key/value heads, key head size, value head size)`, by `layer_idx`, from a forward
    of one token (id 0 at position 0, no cache, no gradient) whose attention calls record their inputs and attend
    nothing (`KVShapeProbe`); empty when that forward raises. The model's attention implementation is switched to
    contbatch's for the forward and back after it."""
    previous = model.config._attn_implementation
    remember_own_attention(model)
    probe = KVShapeProbe({})
    token = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    try:
        model.set_attn_implementation(register_paged_attention())
        with torch.no_grad(), paged_forward(probe):
            model(input_ids=token, position_ids=token, use_cache=False, **{METADATA_KWARG: probe})
    except Exception:  # the first step reports what fails; the config sizes the cache meanwhile
        return {}
    finally:
        model.set_attn_implementation(previous)
    return probe.shapes
