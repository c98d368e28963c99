"""Models contbatch cannot compute exactly, found by running every causal LM family of transformers 5.25 against
`generate`: each fails its requests (or, without attention heads, its engine) with an `UnsupportedModelError`
naming what it does, where before some gave other tokens than `generate` silently (Falcon-H1, BERT without
`is_decoder`, BART) and others failed with errors about shapes or attributes. Gemma 4's text model, whose
heterogeneous config made the engine fail on reading its `head_dim`, matches `generate`, its full-attention layers'
larger keys in a cache of per-layer shapes."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoConfig

from contbatch.engine.kv_probe import probe_layers
from contbatch.engine.model_support import UnsupportedModelError, check_attention_kwargs
from tests.helpers import (
    PROMPT_LENGTHS,
    SMALL,
    TEST_DEVICE,
    assert_matches_generate,
    make_engine,
    model_of_type,
    needs_model_type,
    random_prompts,
    reference_generate,
    run_prompts,
)

RECURRENT = {
    "jamba": (dict(SMALL, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   num_experts=2, mamba_d_state=4, mamba_d_conv=2), "layer 0", "linear_attention", "keeps"),
    "falcon_h1": (dict(SMALL, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=16),
                  "layers 0, 1", "hybrid", "keep"),
    "lfm2": (dict(SMALL, layer_types=["conv", "full_attention"]), "layer 0", "conv", "keeps"),
}


@pytest.mark.parametrize("model_type", sorted(RECURRENT))
def test_layers_that_keep_a_recurrent_state_fail_their_requests_by_name(model_type: str) -> None:
    """Jamba's first layer is a Mamba layer and LFM2's a short convolution, whose states a KV cache cannot hold.
    Falcon-H1 runs a Mamba mixer beside the attention of every layer, so every layer attends through contbatch:
    its requests gave other tokens than `generate`, silently, until the config's layer types were checked."""
    config, layers, kind, keeps = RECURRENT[model_type]
    model = model_of_type(model_type, **config)
    for error in run_prompts(model).values():
        assert error == (f"UnsupportedModelError: {type(model).__name__}: {layers} of its config's layer_types "
                         f"({kind}) {keeps} a recurrent state (a state-space, linear-attention or convolution "
                         "mixer), which contbatch's paged KV cache cannot hold"), error


ATTENTION_CONFIG = dict(SMALL, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2)


@pytest.mark.parametrize(("model_type", "layers", "kinds", "verb"), [
    ("deepseek_v4", "layers 0, 1", "heavily_compressed_attention", "ask for"),
    ("hy_v4", "layers 0, 1", "indexed_attention", "ask for"),
])
def test_sparse_or_compressed_attention_layers_fail_their_requests_by_name(model_type: str, layers: str, kinds: str,
                                                                          verb: str) -> None:
    """DeepSeek-V4 attends over compressed keys beside its window, which contbatch's paged attention does not compute;
    HY-V4's indexer reads the attention mask contbatch leaves out (its requests failed with a TypeError). Any
    layer type but full, sliding and chunked attention is refused by the config."""
    needs_model_type(model_type)
    model = model_of_type(model_type, **ATTENTION_CONFIG)
    for error in run_prompts(model).values():
        assert error == (f"UnsupportedModelError: {type(model).__name__}: {layers} of its config's layer_types "
                         f"({kinds}) {verb} an attention contbatch's paged attention does not implement (it computes "
                         "full_attention, sliding_attention, chunked_attention)"), error


@pytest.mark.parametrize(("model_type", "config"), [
    ("mamba", dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=8)),
    ("rwkv", dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                  intermediate_size=128)),
])
def test_a_model_without_attention_heads_is_refused_when_the_engine_is_built(model_type: str,
                                                                             config: dict[str, object]) -> None:
    """Before, sizing the KV cache raised an AttributeError about the config."""
    model = model_of_type(model_type, **config)
    with pytest.raises(UnsupportedModelError, match=rf"^{type(model).__name__}: its config has no attention heads "
                                                    r"\(num_attention_heads\); contbatch runs models that attend"):
        make_engine(model, num_blocks=16)


def test_a_window_the_layer_does_not_pass_fails_its_requests_by_name() -> None:
    """Moshi's config has a sliding window its layers do not pass to their attention function: the cache would
    keep fewer positions than they attend over."""
    model = model_of_type("moshi", **dict(ATTENTION_CONFIG, sliding_window=16))
    for error in run_prompts(model).values():
        assert error == ("UnsupportedModelError: layer 0 attends with window None, but its cache group keeps only the "
                         "last 16 positions: the model config's layer_types/sliding_window disagree with what the "
                         "layer passes to its attention function"), error


@pytest.mark.parametrize(("model_type", "decoder"), [("bart", "BartDecoder"), ("pegasus", "PegasusDecoder")])
def test_a_decoder_that_numbers_its_tokens_itself_fails_its_requests_by_name(model_type: str, decoder: str) -> None:
    """BART's decoder takes no position ids: it numbers a forward's tokens from its cache's length, so in
    contbatch's packed steps every token got a position from 0 and the tokens differed from `generate`'s."""
    model = model_of_type(model_type, vocab_size=256, d_model=64, decoder_layers=2, decoder_attention_heads=4,
                   encoder_attention_heads=4, encoder_layers=2, decoder_ffn_dim=128, max_position_embeddings=1024,
                   init_std=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2, decoder_start_token_id=0,
                   forced_eos_token_id=None)
    model.generation_config.forced_eos_token_id = None
    for error in run_prompts(model).values():
        assert error == (f"UnsupportedModelError: {type(model).__name__}: its decoder ({decoder}) takes no "
                         "position_ids and numbers its tokens itself, from its cache's length; contbatch's steps "
                         "pack many requests' tokens, each at its own position"), error


BERT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
            max_position_embeddings=1024, initializer_range=0.2)


@pytest.mark.parametrize(("model_type", "name"), [("bert", "BertSelfAttention"), ("electra", "ElectraSelfAttention")])
def test_an_encoders_bidirectional_attention_is_refused_by_name_and_its_decoder_form_matches_generate(
        model_type: str, name: str) -> None:
    """BERT's layers attend bidirectionally unless the config says `is_decoder=True` (`is_causal` False on the
    module); run causally they gave other tokens than `generate`, silently."""
    encoder = model_of_type(model_type, **BERT)
    for error in run_prompts(encoder).values():
        assert isinstance(error, str) and error.startswith(
            f"UnsupportedModelError: {name} attends bidirectionally (is_causal=False), and contbatch's paged "
            "attention is causal only"), error
    decoder = model_of_type(model_type, is_decoder=True, **BERT)
    references = [reference_generate(decoder, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)]
    assert len({token for tokens in references for token in tokens}) > 5, "a degenerate model proves nothing"
    results = run_prompts(decoder)
    for index, reference in enumerate(references):
        assert results[str(index)] == reference, index


def test_a_causal_keyword_overrides_the_modules_attribute() -> None:
    module = torch.nn.Module()
    module.is_causal = False
    check_attention_kwargs(module, {"is_causal": True})
    with pytest.raises(UnsupportedModelError, match=r"^Module attends bidirectionally \(is_causal=False\)"):
        check_attention_kwargs(module, {})
    del module.is_causal
    check_attention_kwargs(module, {})
    with pytest.raises(UnsupportedModelError, match="bidirectionally"):
        check_attention_kwargs(module, {"is_causal": False})


GEMMA4 = dict(SMALL, vocab_size_per_layer_input=256, hidden_size_per_layer_input=16, num_hidden_layers=4,
              layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8, head_dim=16,
              initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2)


@pytest.mark.parametrize("variant", [
    pytest.param({}, id="plain"), pytest.param({"num_kv_shared_layers": 2}, id="shared-kv"),
    pytest.param({"attention_k_eq_v": True}, id="k-eq-v"), pytest.param({"global_head_dim": 32}, id="larger-global"),
    pytest.param({"global_head_dim": 32, "num_global_key_value_heads": 1}, id="larger-global-fewer-heads"),
    pytest.param({"global_head_dim": 32, "num_kv_shared_layers": 2}, id="larger-global-shared-kv")])
def test_gemma4_matches_generate(variant: dict[str, object]) -> None:
    """Gemma 4's config is heterogeneous (`per_layer_config`): its full-attention layers take `global_head_dim` and
    `num_global_key_value_heads`. Where those differ from the sliding layers', each layer's keys take their own
    shape in the cache (before, reading the config's `head_dim` raised transformers' ambiguity error). Its later
    layers may read the keys of earlier ones (`num_kv_shared_layers`), or its keys double as values."""
    needs_model_type("gemma4_text")
    model = model_of_type("gemma4_text", **{"global_head_dim": 16, **GEMMA4, **variant})
    assert_matches_generate(model, {}, {"block_size": 16, "max_batch_tokens": 7}, min_distinct=5)


TEXT = dict(SMALL, initializer_range=0.2, head_dim=16, bos_token_id=0, eos_token_id=1, pad_token_id=2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}


def _vision_language_model(model_type: str, **config: object) -> transformers.PreTrainedModel:
    needs_model_type(model_type)
    torch.manual_seed(1234)
    model = transformers.AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **config))
    model.generation_config.eos_token_id = None
    return model.eval()


def test_a_prefix_lm_fails_its_requests_by_name() -> None:
    """PaliGemma attends bidirectionally over its prompt (its layers' `is_causal` is False, its mask says which
    tokens): run causally, a text prompt got other tokens than `generate`'s."""
    model = _vision_language_model("paligemma", text_config=dict(TEXT, model_type="gemma"),
                                   vision_config=dict(VISION, model_type="siglip_vision_model"), image_token_index=250)
    for error in run_prompts(model, num_blocks=64).values():
        assert isinstance(error, str) and error.startswith(
            "UnsupportedModelError: GemmaAttention attends bidirectionally (is_causal=False)"), error


def test_qwen25_vl_matches_generate_on_text_prompts() -> None:
    """Qwen2.5-VL's rotary embedding takes three position ids a token (M-RoPE); a text token's are its position
    thrice, from the position ids contbatch passes."""
    model = _vision_language_model(
        "qwen2_5_vl", text_config=dict(TEXT, rope_parameters=MROPE), image_token_id=250, video_token_id=251,
        vision_start_token_id=252, vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64,
                                                      intermediate_size=64, num_heads=2))
    references = [reference_generate(model, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)]
    assert len({token for tokens in references for token in tokens}) > 5, "a degenerate model proves nothing"
    results = run_prompts(model, num_blocks=64)
    for index, reference in enumerate(references):
        assert results[str(index)] == reference, index


WHISPER = dict(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_target_positions=1024,
               max_source_positions=64, num_mel_bins=16, init_std=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
               decoder_start_token_id=0, begin_suppress_tokens=None, suppress_tokens=None)


def test_a_forward_that_returns_every_tokens_logits_fails_its_requests_by_name() -> None:
    """Whisper's decoder as a causal LM takes no `logits_to_keep`: it returned every packed token's logits, whose
    first rows contbatch read as the requests' own, and gave other tokens than `generate`."""
    needs_model_type("whisper")
    errors = run_prompts(model_of_type("whisper", **WHISPER))
    assert errors["0"] == ("UnsupportedModelError: WhisperForCausalLM: its forward returned logits for 24 tokens where "
                           "2 were asked for (logits_to_keep): it computes every token's logits, and contbatch reads "
                           "the requests' own rows from what the forward keeps")
    for error in errors.values():
        assert isinstance(error, str) and error.startswith("UnsupportedModelError: WhisperForCausalLM: its forward "
                                                           "returned logits for "), error


def test_a_layer_that_builds_its_own_mask_fails_its_requests_by_name() -> None:
    """Doge's layers add a learned bias over the keys (and mask all but the top keys) through the attention mask
    they build themselves; contbatch attended without it and gave other tokens than `generate` once the bias
    varies (a trained model's; at initialisation it is constant)."""
    needs_model_type("doge")
    model = model_of_type("doge", **dict(ATTENTION_CONFIG, num_experts=16, num_experts_per_tok=2))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(layer.self_attn.layer_idx))
    for error in run_prompts(model).values():
        assert error == ("UnsupportedModelError: DogeAttention passes an attention mask of its own making to its "
                         "attention function (a bias or masking over the keys), which contbatch's paged attention "
                         "does not apply"), error
    with pytest.raises(UnsupportedModelError, match=r"^Module passes an attention mask of its own making"):
        check_attention_kwargs(torch.nn.Module(), {}, torch.zeros(1, 1, 1, 1))


def test_input_embeddings_that_are_not_one_table_are_refused_when_the_engine_is_built() -> None:
    """MusicGen's decoder embeds one token per codebook a position (a `ModuleList` of tables): building the engine
    raised an AttributeError about `num_embeddings`."""
    model = model_of_type("llama", **SMALL)
    model.get_input_embeddings = lambda: torch.nn.ModuleList()  # type: ignore[method-assign]
    with pytest.raises(UnsupportedModelError, match=r"^LlamaForCausalLM: its input embeddings \(ModuleList\) are not "
                                                    r"one table of token ids"):
        make_engine(model, num_blocks=16)
    assert model.config._attn_implementation != "contbatch_paged", "refused before contbatch attached"


def test_a_forward_that_ignores_the_positions_it_takes_fails_its_requests_by_name() -> None:
    """CSM's depth decoder takes `position_ids` and numbers a forward's tokens itself, from its cache's length (and
    picks each token's codebook table by that number): contbatch's packed steps gave it other positions than
    `generate` did, silently, or an index error once a step held more tokens than it has codebooks. The engine's
    probing forward sees two equal tokens at one position reach its attention with different keys."""
    config = transformers.CsmDepthDecoderConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                num_attention_heads=4, num_key_value_heads=2, backbone_hidden_size=64,
                                                vocab_size=256, num_codebooks=4, max_position_embeddings=64,
                                                initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.CsmDepthDecoderForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    assert probe_layers(model).renumbered == {0, 1}
    for error in run_prompts(model).values():
        assert error == ("UnsupportedModelError: CsmDepthDecoderForCausalLM: two equal tokens given one position "
                         "reached the attention of layers 0, 1 with different keys: its forward does not number its "
                         "tokens by the position_ids it takes (it numbers them itself, or mixes them outside its "
                         "attention); contbatch's steps pack many requests' tokens, each at its own position"), error


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma3_text"])
def test_the_probe_tells_a_forward_that_numbers_its_tokens_itself(model_type: str) -> None:
    """RoPE, learned position embeddings and sliding layers alike give two equal tokens at one position equal keys
    in every layer. The same model whose forward numbers its tokens itself (a hook that replaces the positions it
    is given by 0, 1, ...) is told apart in every layer, Gemma 3's too, whose token 0 is its padding row of zeros."""
    needs_model_type(model_type)
    config = dict(SMALL, n_embd=64, n_layer=2, n_head=4, n_positions=1024) if model_type == "gpt2" else SMALL
    model = model_of_type(model_type, **config)
    probe = probe_layers(model)
    assert probe.renumbered == frozenset() and sorted(probe.shapes) == [0, 1]

    def number_itself(_: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> tuple:
        tokens = kwargs["input_ids"]
        assert isinstance(tokens, torch.Tensor)
        return args, {**kwargs, "position_ids": torch.arange(tokens.shape[1])[None]}

    model.register_forward_pre_hook(number_itself, with_kwargs=True)
    assert probe_layers(model).renumbered == {0, 1}


MLLAMA_TEXT = dict(SMALL, num_hidden_layers=4, initializer_range=0.2, cross_attention_layers=[1], bos_token_id=0,
                   eos_token_id=1, pad_token_id=2)
MLLAMA_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                     image_size=56, patch_size=14, vision_output_dim=64, intermediate_layers_indices=[0])


def _mllama(form: str) -> transformers.PreTrainedModel:
    if form == "vision-language":
        return _vision_language_model("mllama", text_config=dict(MLLAMA_TEXT, model_type="mllama_text_model"),
                                      vision_config=MLLAMA_VISION)
    torch.manual_seed(0)
    model = transformers.MllamaForCausalLM(transformers.MllamaTextConfig(**MLLAMA_TEXT)).to(TEST_DEVICE).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("form", ["text", "vision-language"])
def test_mllama_matches_generate_on_text_without_its_cross_attention_layers(form: str) -> None:
    """Llama 3.2 Vision: the layers its config lists in `cross_attention_layers` attend to an image's states, and a
    forward without an image skips them. They take no place in the KV cache; the other layers match `generate`
    (before, the first step refused the model for the layers that did not attend). The text model runs on
    `CONTBATCH_TEST_DEVICE` (a GPU session's `owed` files)."""
    model = _mllama(form)
    with make_engine(model, block_size=4, num_blocks=8) as engine:
        assert engine.cache.layers == (0, 2, 3) and engine.cache.shape[0] == 3
    assert_matches_generate(model, {"num_blocks": 64}, {"num_blocks": 64, "block_size": 16, "max_batch_tokens": 7})
