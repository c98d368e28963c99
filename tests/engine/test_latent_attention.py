"""Values of another head size than the keys: multi-head latent attention (DeepSeek-V2/V3 and the families built
on it) expands its latent into keys of `qk_nope_head_dim + qk_rope_head_dim` and values of `v_head_dim` for every
attention head, and MiMo-V2-Flash projects values smaller than its keys. The cache is sized from what the layers
compute (`kv_probe`), or from those fields where that cannot be measured, the values stored zero-padded to the keys'
size, and greedy tokens equal `generate`'s on every attention path; before, each of these models failed its
requests (a shape check, or a cache sized from `head_dim`, the rotary part)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from contbatch.engine import engine as engine_module
from contbatch.engine.kv_cache import KVCacheSpec, PagedKVCache
from contbatch.engine.kv_probe import LayerProbe
from contbatch.engine.model_support import UnsupportedModelError
from tests.helpers import (
    SMALL,
    assert_matches_generate,
    make_engine,
    model_of_type,
    needs_model_type,
    use_attention_path,
)

MLA = dict(SMALL, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=16, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, initializer_range=0.2,
           bos_token_id=0, eos_token_id=1, pad_token_id=2)
"""Keys of 24 dimensions (16 without rotary, 8 with), values of 16, four heads; `head_dim` is the rotary part."""
MLA_FAMILIES = {
    "deepseek_v2": MLA,
    "deepseek_v3": MLA,
    "minicpm3": dict(MLA, initializer_range=0.5),
    "glm4_moe_lite": MLA,
    "longcat_flash": MLA,
    "youtu": MLA,
    "sarvam_mla": MLA,
}
MIMO = dict(SMALL, head_dim=24, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2)


@pytest.mark.parametrize("model_type", sorted(MLA_FAMILIES))
def test_latent_attention_families_match_generate(model_type: str) -> None:
    """The cache holds keys of 24 dimensions (16 without rotary, 8 with) where the config's `head_dim` says 8 (the
    rotary part), and values of 16; mixed lengths, chunked prefill and decode in one engine (4-token blocks,
    24-token budget), CPU kernel."""
    needs_model_type(model_type)
    model = model_of_type(model_type, **MLA_FAMILIES[model_type])
    with make_engine(model, num_blocks=16) as engine:
        spec = engine.cache.spec
        assert (spec.num_kv_heads, spec.head_dim, spec.value_head_dim, spec.layer_shapes) == (4, 24, 16, ())
    assert_matches_generate(model)


@pytest.mark.parametrize("path", ["gathered keys", "compiled", "triton", "bfloat16", "config's shapes"])
def test_latent_attention_matches_generate_on_every_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3 through the gathered keys' SDPA, compiled (the op's output takes the values' size), the
    Triton kernel (its interpreter on a CPU), in bfloat16 (against `generate` in bfloat16), and with the cache
    sized from the config's fields, as where the probing forward measures nothing."""
    torch._dynamo.reset()
    use_attention_path(path, monkeypatch)
    if path == "config's shapes":
        monkeypatch.setattr(engine_module, "probe_layers", lambda model: LayerProbe())
    model = model_of_type("deepseek_v3", **MLA)
    if path == "bfloat16":
        model = model.to(torch.bfloat16)
    assert_matches_generate(model, {"use_default_compile_configs": path == "compiled"})


def test_values_smaller_than_the_keys_match_generate() -> None:
    """MiMo-V2-Flash's full-attention layers: keys of 24 dimensions, values of 16 (its own projection)."""
    needs_model_type("mimo_v2_flash")
    assert_matches_generate(model_of_type("mimo_v2_flash", **dict(MIMO, layer_types=["full_attention"] * 2)))


@pytest.mark.parametrize(("model_type", "expected"), [
    ("deepseek_v3", (61, 128, 192, 128)),
    ("minicpm3", (62, 40, 96, 64)),
    ("glm4_moe_lite", (47, 20, 256, None)),
    ("mimo_v2_flash", (48, 4, 192, 128)),
    ("llama", (32, 32, 128, None)),
])
def test_the_configs_spec_reads_the_key_and_value_fields(model_type: str,
                                                          expected: tuple[int, int, int, int | None]) -> None:
    """The spec a config gives where no probing forward measured the layers, on the released configs: latent
    attention's keys have every attention head, of nope + rope dimensions, whatever `num_key_value_heads` and
    `head_dim` say; `value_head_dim` is set only where values are smaller."""
    needs_model_type(model_type)
    spec = KVCacheSpec.from_model_config(AutoConfig.for_model(model_type), torch.bfloat16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.value_head_dim) == expected
    assert spec.value_dim_of(0) == (expected[3] or expected[2])


def test_values_are_stored_zero_padded_and_read_back() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, value_head_dim=5)
    cache = PagedKVCache(spec, num_blocks=4, block_size=4, device=torch.device("cpu"))
    cache.values[1].fill_(float("nan"))
    keys, values = torch.randn(2, 3, 8), torch.randn(2, 3, 5)
    slots = torch.tensor([5, 6, 11])
    cache.write(1, slots, keys, values.transpose(0, 1).contiguous().transpose(0, 1))
    read_keys, read_values = cache.gather(1, slots, batch=1, length=3)
    assert torch.equal(read_keys[0], keys)
    assert torch.equal(read_values[0, ..., :5], values)
    assert torch.equal(read_values[0, ..., 5:], torch.zeros(2, 3, 3))


def test_values_larger_than_the_keys_are_refused_when_the_engine_is_built() -> None:
    needs_model_type("mimo_v2_flash")
    model = model_of_type("mimo_v2_flash", **dict(MIMO, head_dim=16, v_head_dim=24))
    with pytest.raises(UnsupportedModelError, match=r"^MiMoV2FlashForCausalLM: layer 0's values have 24 dimensions "
                                                    r"and its keys 16; contbatch's paged KV cache holds values no "
                                                    r"larger than the keys$"):
        make_engine(model, num_blocks=16)
