"""Layers that call their attention function more than once a forward: DiffLlama's attend twice, over two halves
of their values, and Dory's recurrent layers once a loop. Each call after a layer's first takes a cache layer of
its own (`kv_cache.RepeatedCalls`, counted by the engine's probing forward), so the calls' keys and values stay
apart; both match `generate`, where before their first step refused them (layers that ran the paged attention
more than once)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from contbatch.engine import engine as engine_module
from contbatch.engine.kv_cache import KVCacheGroup, KVCacheSpec, RepeatedCalls, kv_cache_groups
from contbatch.engine.kv_probe import LayerProbe, probe_layers
from tests.helpers import SMALL, assert_matches_generate, make_engine, model_of_type, needs_model_type, run_prompts

IDS = dict(initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2)
DORY = dict(SMALL, num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
            n_recurrent_loops=2, sliding_window=6, ngpt_alpha_init=0.9, **IDS)
"""Dory's layers 1 and 2 run twice; its residual rate of 0.9 makes the loops' keys differ (at the default 0.05 a
random model's loops barely change the tokens)."""


def _matches_generate(model: torch.nn.Module, **engine_config: object) -> None:
    assert_matches_generate(model, dict(num_blocks=64, **engine_config),
                            dict(num_blocks=64, block_size=16, max_batch_tokens=7, **engine_config))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_diffllama_attends_twice_a_layer_and_matches_generate(compiled: bool) -> None:
    needs_model_type("diffllama")
    model = model_of_type("diffllama", **dict(SMALL, **IDS))
    assert probe_layers(model).calls == {0: 2, 1: 2}
    with make_engine(model, block_size=4, num_blocks=8) as engine:
        assert engine.cache.repeated_calls == {0: (2,), 1: (3,)}
        assert [group.layers for group in engine.cache.groups] == [(0, 2, 1, 3)]
    _matches_generate(model, use_default_compile_configs=compiled)


def test_dorys_recurrent_loops_each_keep_their_keys_and_match_generate() -> None:
    """The loops' layers keep their sliding window (every fourth layer attends fully)."""
    needs_model_type("dory")
    model = model_of_type("dory", **DORY)
    with make_engine(model, block_size=4, num_blocks=32) as engine:
        assert engine.cache.repeated_calls == {1: (4,), 2: (5,)}
        assert [(group.layers, group.sliding_window) for group in engine.cache.groups] == [
            ((3,), None), ((0,), 6), ((1,), 6), ((4,), 6), ((2,), 6), ((5,), 6)]
    _matches_generate(model)


def test_dorys_last_loop_cache_fails_its_requests_by_name() -> None:
    """With one cache per recurrent layer, written by the last loop and read by the earlier ones, `generate`
    computes other tokens than the model's own forward; contbatch keeps each loop's keys, so it refuses."""
    needs_model_type("dory")
    for error in run_prompts(model_of_type("dory", **dict(DORY, recurrent_kv_cache_mode="last_loop"))).values():
        assert error == ("UnsupportedModelError: DoryForCausalLM: its config sets recurrent_kv_cache_mode='last_loop': "
                         "its recurrent layers' earlier loops read the keys the last loop cached, where contbatch "
                         "keeps each loop's own (as 'per_loop' does)"), error


def test_a_repeated_call_the_probe_did_not_count_fails_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    needs_model_type("diffllama")
    monkeypatch.setattr(engine_module, "probe_layers", lambda model: LayerProbe())
    for error in run_prompts(model_of_type("diffllama", **dict(SMALL, **IDS))).values():
        assert isinstance(error, str) and "(more than once: layers 0, 1)" in error, error


def test_repeated_calls_number_their_cache_layers_after_the_models() -> None:
    repeats = RepeatedCalls.of(3, {1: 3, 2: 1, 7: 2})
    assert (repeats.extra, repeats.source) == ({1: (3, 4)}, (0, 1, 2, 1, 1))
    assert RepeatedCalls.of(3, {0: 1}) == RepeatedCalls()
    spec = KVCacheSpec(3, 4, 16, torch.float32, ((2, 16), (4, 16), (2, 16)))
    assert repeats.spec(spec).layer_shapes == ((2, 16), (4, 16), (2, 16), (4, 16), (4, 16))
    assert repeats.spec(KVCacheSpec(3, 2, 16, torch.float32)).num_layers == 5
    config = AutoConfig.for_model("gemma3_text", **dict(SMALL, num_hidden_layers=3, sliding_window=8,
                                                        layer_types=["sliding_attention", "full_attention",
                                                                     "sliding_attention"]))
    assert kv_cache_groups(config, repeats.spec(KVCacheSpec(3, 2, 16, torch.float32)), repeats) == [
        KVCacheGroup((1, 3), None), KVCacheGroup((4,), None), KVCacheGroup((0, 2), 8)]
