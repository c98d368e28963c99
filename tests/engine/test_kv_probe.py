"""The KV cache sized from what each layer hands its attention function (`kv_probe.probe_layers`, one forward
of two tokens before the cache is made), where the config does not say it: MiMo-V2-Flash's sliding layers take twice
the config's key/value heads, JetMoE repeats its keys for each attention expert of a token, GPT-BigCode's
multi-query layers compute one head, and a stray `num_key_value_heads` in a config without grouped-query attention
says 2 where the layers compute 4. Each of these failed its requests before; now each matches `generate`. Where no
measurement covers the layers, the config sizes the cache and a layer that disagrees still fails by name."""

from __future__ import annotations

import pytest
import torch

from contbatch.engine import engine as engine_module
from contbatch.engine.kv_cache import KVCacheSpec
from contbatch.engine.kv_probe import LayerProbe, probe_layers
from contbatch.engine.model_support import UnsupportedModelError, check_kv_shape
from tests.helpers import (
    PROMPT_LENGTHS,
    SMALL,
    make_engine,
    model_of_type,
    needs_model_type,
    random_prompts,
    reference_generate,
    run_prompts,
)

MIMO = dict(SMALL, head_dim=24, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            sliding_window=6, layer_types=["full_attention", "sliding_attention"], initializer_range=0.2,
            bos_token_id=0, eos_token_id=1, pad_token_id=2)
# (model type, config, each layer's measured (key/value heads, key head size, value head size))
MEASURED = [
    ("mimo_v2_flash", MIMO, {0: (2, 24, 16), 1: (4, 24, 16)}),
    ("jetmoe", dict(SMALL, num_local_experts=4, num_experts_per_tok=2, kv_channels=16, initializer_range=0.2),
     {0: (4, 16, 16), 1: (4, 16, 16)}),
    ("gpt_bigcode", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=1024, initializer_range=0.2,
                         num_key_value_heads=2), {0: (1, 16, 16), 1: (1, 16, 16)}),
    ("gpt_neox", SMALL, {0: (4, 16, 16), 1: (4, 16, 16)}),
]


@pytest.mark.parametrize(("model_type", "config", "shapes"), MEASURED, ids=[case[0] for case in MEASURED])
def test_layers_the_config_misdescribes_are_measured_and_match_generate(
        model_type: str, config: dict[str, object], shapes: dict[int, tuple[int, int, int]]) -> None:
    needs_model_type(model_type)
    model = model_of_type(model_type, **config)
    own = model.config._attn_implementation
    assert probe_layers(model).shapes == shapes
    assert model.config._attn_implementation == own, "the probe gives the model its attention back"
    with make_engine(model, num_blocks=16) as engine:
        assert engine.cache.spec.measured
        assert [engine.cache.spec.shape_of(layer) for layer in shapes] == [shape[:2] for shape in shapes.values()]
        assert [engine.cache.spec.value_dim_of(layer) for layer in shapes] == [shape[2] for shape in shapes.values()]
    results = run_prompts(model)
    references = [reference_generate(model, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)]
    assert len({token for tokens in references for token in tokens}) > 8, "a degenerate model proves nothing"
    for index, reference in enumerate(references):
        assert results[str(index)] == reference, (index, results[str(index)])


def test_mimo_sliding_layers_attend_with_their_sinks() -> None:
    """The sliding layers' sinks (`s_aux`) change the tokens, so the match above computed them."""
    needs_model_type("mimo_v2_flash")
    model = model_of_type("mimo_v2_flash", **MIMO)
    with torch.no_grad():
        model.model.layers[1].self_attn.sinks.normal_(3.0, 2.0, generator=torch.Generator().manual_seed(1))
    references = [reference_generate(model, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)]
    results = run_prompts(model)
    assert [results[str(index)] for index in range(len(references))] == references
    without = model_of_type("mimo_v2_flash", **MIMO)
    assert [reference_generate(without, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)] \
        != references, "the sinks change the tokens"


def test_a_forward_that_fails_measures_nothing() -> None:
    model = model_of_type("llama", **SMALL)
    own = model.config._attn_implementation
    model.model.embed_tokens.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("no")))
    assert probe_layers(model).shapes == {}
    assert model.config._attn_implementation == own


def test_without_a_measurement_a_layer_the_config_misdescribes_fails_its_requests_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The config sizes the cache (2 heads, from the stray field) and the first step's check names the layer."""
    monkeypatch.setattr(engine_module, "probe_layers", lambda model: LayerProbe())
    for error in run_prompts(model_of_type("gpt_neox", **SMALL)).values():
        assert error == ("UnsupportedModelError: layer 0 computes 4 key/value heads of size 16, but the KV cache "
                         "was sized from the model's config for 2 of size 16 (num_key_value_heads, head_dim)")


def test_a_measurement_that_misses_a_layer_leaves_the_config_to_size_the_cache() -> None:
    """BLOOM's layers run their own attention code: nothing is measured, and its requests fail by name."""
    model = model_of_type("bloom", vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
    assert probe_layers(model).shapes == {}
    for error in run_prompts(model).values():
        assert isinstance(error, str) and "0 of its 2 layers ran contbatch's paged attention" in error, error


def test_a_layer_that_differs_from_its_measured_shape_is_named_with_the_measurement() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, measured=True)
    keys = torch.zeros(1, 4, 3, 16)
    with pytest.raises(UnsupportedModelError, match=r"^layer 1 computes 4 key/value heads of size 16, but the KV "
                                                    r"cache was sized from the layers' shapes in the engine's probing "
                                                    r"forward for 2 of size 16$"):
        check_kv_shape(1, keys, keys, spec)
    with pytest.raises(UnsupportedModelError, match=r"values of 2 heads of size 8 beside keys of 2 of size 16, but "
                                                    r"the KV cache was sized from the layers' shapes in the engine's "
                                                    r"probing forward for values of 2 heads of size 16$"):
        check_kv_shape(1, keys[:, :2], keys[:, :2, :, :8], spec)
