"""Models beyond the parity suite's families: a model whose layers drop the forward's keywords still attends
through the cache (greedy equals `generate`, eager and compiled), gpt-oss's attention sinks are computed (every
attention path); a model contbatch cannot compute exactly (its own attention code, state-space layers, sparse or
compressed attention, bidirectional attention, attention inputs it does not implement) fails each request with an
`UnsupportedModelError` naming what it does, never with wrong tokens, and leaves the pool whole."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig

from contbatch import generate_batch
from contbatch.engine.model_support import (
    UnsupportedModelError,
    attention_sinks,
    check_attended,
    check_attention_kwargs,
)
from tests.helpers import (
    PROMPT_LENGTHS,
    SMALL,
    make_engine,
    model_of_type,
    random_prompts,
    reference_generate,
    run_engine,
    run_prompts,
    use_attention_path,
)

# Families beyond the parity suite's (tests/helpers.py), each as transformers 5 builds it; weights large enough
# that greedy tokens vary (small random weights repeat one token, which wrong attention could repeat too).
MORE_FAMILIES: dict[str, dict[str, object]] = {
    "gpt2": dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=1024, initializer_range=0.1,
                 bos_token_id=0, eos_token_id=0),
    "gpt_neox": {**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}, "rotary_pct": 0.25},
    "opt": dict(vocab_size=256, hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=2,
                max_position_embeddings=1024, word_embed_proj_dim=64, init_std=0.2),
    "phi": SMALL,
    "phi3": dict(SMALL, pad_token_id=0),
    "gemma": dict(SMALL, head_dim=16, initializer_range=0.2),
    "olmo2": SMALL,
    "granite": SMALL,
    "cohere": SMALL,
    "starcoder2": dict(SMALL, initializer_range=0.2),
    "smollm3": dict(SMALL, pad_token_id=0),
    "mixtral": dict(SMALL, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "qwen3_moe": dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "olmoe": dict(SMALL, num_experts=4, num_experts_per_tok=2),
    **{name: dict(SMALL, head_dim=16, bos_token_id=0, eos_token_id=1, pad_token_id=2) for name in (
        "glm4", "ernie4_5", "exaone4", "hunyuan_v1_dense", "seed_oss", "apertus", "ministral", "olmo3", "cohere2")},
    "granitemoe": dict(SMALL, num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(SMALL, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0),
    "llama4_text": dict(SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                        pad_token_id=0),
    "gpt_bigcode": dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=1024, initializer_range=0.2),
    "dbrx": dict(vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_seq_len=1024, initializer_range=0.2,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
}


@pytest.mark.parametrize("model_type", sorted(MORE_FAMILIES))
def test_more_families_match_generate(model_type: str) -> None:
    """Mixed lengths, chunked prefill and decode in one engine (4-token blocks, 24-token budget)."""
    model = model_of_type(model_type, **MORE_FAMILIES[model_type])
    results = run_prompts(model)
    references = [reference_generate(model, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)]
    assert len({token for tokens in references for token in tokens}) > 8, "a degenerate model proves nothing"
    for index, reference in enumerate(references):
        assert results[str(index)] == reference, index


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_layers_that_drop_the_forwards_keywords_attend_through_the_cache(compiled: bool) -> None:
    """StableLM's decoder layers call their attention without the forward's keywords (contbatch's metadata
    among them): the thread's forward hands the metadata over, so chunked prefill and decode match `generate`."""
    torch._dynamo.reset()
    model = model_of_type("stablelm", **SMALL)
    results = run_prompts(model, use_default_compile_configs=compiled)
    for index, prompt in enumerate(random_prompts(PROMPT_LENGTHS, seed=1)):
        assert results[str(index)] == reference_generate(model, prompt, 8), index


TRANSFORMERS = Version(transformers.__version__)
GPTJ = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=1024, rotary_dim=8, initializer_range=0.1)
CODEGEN = GPTJ  # CodeGen's config takes GPT-J's fields
FALCON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, initializer_range=0.1)
# (model type, config, the transformers release from which its layers attend through AttentionInterface, or None)
OWN_CODE_OR_INTERFACE = [
    ("gptj", GPTJ, Version("5.24")),
    ("codegen", CODEGEN, Version("5.24")),
    ("bloom", dict(vocab_size=256, hidden_size=64, n_layer=2, n_head=4), None),
    ("falcon", FALCON, Version("5.25")),
]


def _since(model_type: str) -> Version | None:
    return next(since for name, _, since in OWN_CODE_OR_INTERFACE if name == model_type)


@pytest.mark.parametrize(("model_type", "config"), [
    pytest.param(model_type, config, id=model_type, marks=pytest.mark.skipif(
        since is not None and since <= TRANSFORMERS, reason=f"its layers attend through the interface from {since}"))
    for model_type, config, since in OWN_CODE_OR_INTERFACE
])
def test_a_model_with_its_own_attention_code_fails_its_requests_by_name(model_type: str,
                                                                       config: dict[str, object]) -> None:
    model = model_of_type(model_type, **config)
    for error in run_prompts(model).values():
        assert isinstance(error, str)
        assert error.startswith(f"UnsupportedModelError: {type(model).__name__}: 0 of its 2 layers ran"), error
        assert "missing: layers 0, 1" in error and "is_backend_compatible() is False" in error


@pytest.mark.parametrize(("model_type", "config"), [
    pytest.param("gptj", GPTJ, id="gptj"),
    pytest.param("codegen", CODEGEN, id="codegen"),
    pytest.param("falcon", FALCON, id="falcon-multi-query-parallel"),
    pytest.param("falcon", dict(FALCON, new_decoder_architecture=True, num_kv_heads=2), id="falcon-new-architecture"),
    pytest.param("falcon", dict(FALCON, multi_query=False, parallel_attn=False), id="falcon-multi-head-sequential"),
])
def test_gptj_codegen_and_falcon_match_generate_where_they_attend_through_the_interface(
        model_type: str, config: dict[str, object]) -> None:
    """GPT-J's and CodeGen's layers attend through AttentionInterface from transformers 5.24 on, Falcon's (all three
    layouts of its fused query/key/value projection) from 5.25 on; before, the test above fails them by name."""
    since = _since(model_type)
    if since is not None and since > TRANSFORMERS:
        pytest.skip(f"transformers {TRANSFORMERS}: its layers run their own attention code until {since}")
    model = model_of_type(model_type, **config)
    results = run_prompts(model)
    references = [reference_generate(model, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)]
    assert len({token for tokens in references for token in tokens}) > 8, "a degenerate model proves nothing"
    for index, reference in enumerate(references):
        assert results[str(index)] == reference, index


def test_falcon_with_alibi_fails_its_requests_by_name() -> None:
    """ALiBi Falcon adds its position bias to the attention mask: refused by name before any forward, on every
    transformers release (before 5.25 its layers' own attention code would be refused anyway)."""
    model = model_of_type("falcon", **dict(FALCON, alibi=True))
    for error in run_prompts(model).values():
        assert isinstance(error, str)
        assert error.startswith("UnsupportedModelError: FalconForCausalLM: its config sets alibi=True"), error


GPT_OSS = dict(SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=6,
               layer_types=["sliding_attention", "full_attention"], initializer_range=0.3)


@pytest.mark.parametrize("path", ["cpu kernel", "gathered keys", pytest.param("compiled", marks=pytest.mark.slow),
                                  "triton"])
def test_attention_sinks_match_generate(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's attention sinks (`s_aux`, one logit per head in the softmax's denominator), on sliding and full
    layers: through the CPU kernel, through the gathered keys' written-out attention, compiled, and through the
    Triton kernel (its interpreter on a CPU)."""
    torch._dynamo.reset()
    use_attention_path(path, monkeypatch)
    model = model_of_type("gpt_oss", **GPT_OSS)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 3.0, generator=torch.Generator().manual_seed(layer.self_attn.layer_idx))
    results = run_prompts(model, use_default_compile_configs=path == "compiled")
    references = [reference_generate(model, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)]
    assert len({token for tokens in references for token in tokens}) > 8
    for index, reference in enumerate(references):
        assert results[str(index)] == reference, index
    without = model_of_type("gpt_oss", **GPT_OSS)
    assert [reference_generate(without, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)] \
        != references, "the sinks change the tokens"


def test_attention_inputs_it_does_not_implement_are_refused_by_name() -> None:
    module = torch.nn.Module()
    with pytest.raises(UnsupportedModelError, match=r"^Module passes 'position_bias' \(a position bias\) to its "
                                                    r"attention function, which contbatch's paged attention does not"):
        check_attention_kwargs(module, {"position_bias": torch.zeros(1), "scaling": 0.1})
    check_attention_kwargs(module, {"position_bias": None, "indices": None})
    with pytest.raises(UnsupportedModelError, match=r"attention sinks 's_aux' of shape \(2, 4\); contbatch takes one "
                                                    r"per query head \(4\)"):
        attention_sinks(module, {"s_aux": torch.zeros(2, 4)}, 4)
    assert attention_sinks(module, {"s_aux": torch.zeros(4, dtype=torch.bfloat16)}, 4).dtype == torch.float32


def test_generate_batch_raises_for_an_unsupported_model() -> None:
    """Every output would fail alike, so the call raises as the first arrives; the manager it kept has stopped
    with its pool whole."""
    model = model_of_type("bloom", vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
    with pytest.raises(UnsupportedModelError, match=r"^BloomForCausalLM: 0 of its 2 layers ran"):
        generate_batch(model, random_prompts([4, 9, 6]), GenerationConfig(max_new_tokens=3, do_sample=False),
                       progress_bar=False, persistent_manager=True)
    manager = model._contbatch_manager
    assert not manager.is_running() and manager.engine.block_pool.is_whole


def test_check_attended_names_missing_and_repeated_layers() -> None:
    check_attended(torch.nn.Module(), [0, 1, 2], [0, 1, 2])
    check_attended(torch.nn.Module(), [0, 2], [0, 2])
    with pytest.raises(UnsupportedModelError, match=r"Module: 2 of its 3 layers ran .* \(missing: layer 2\) "
                                                    r"\(more than once: layer 0\)\. .*state-space layers\), so"):
        check_attended(torch.nn.Module(), [0, 0, 1], [0, 1, 2])
    with pytest.raises(UnsupportedModelError, match=r"\(missing: layers 0, 1, 2, 3, 4, 5, 6, 7 and 2 more\)"):
        check_attended(torch.nn.Module(), [], list(range(10)))
    with pytest.raises(UnsupportedModelError, match=r"Module: 0 of its 2 layers ran .* \(missing: layers 0, 1\) "
                                                    r"\(not among its layers: layer 2\)\."):
        check_attended(torch.nn.Module(), [2], [0, 1])


def test_the_check_runs_until_a_forward_passes_it() -> None:
    model = model_of_type("llama", **SMALL)
    with make_engine(model, block_size=4) as engine:
        assert not engine.model_runner.attention_checked
        engine.add_request([5, 6, 7], "r", max_new_tokens=2)
        run_engine(engine)
        assert engine.model_runner.attention_checked


def test_chunked_attention_runs_within_a_chunk_and_refuses_past_it() -> None:
    """Llama 4's chunked-attention layers: a request within one `attention_chunk_size` chunk equals `generate`; one
    that would reach past it is refused when added, naming the limit."""
    model = model_of_type("llama4_text", **SMALL, head_dim=16, num_local_experts=2, intermediate_size_mlp=128,
                   attention_chunk_size=48)
    prompt = random_prompts([30], seed=3)[0]
    with make_engine(model, block_size=4, max_batch_tokens=24) as engine:
        engine.add_request(prompt, "fits", max_new_tokens=18)
        with pytest.raises(ValueError, match=r"request 'past': prompt \(30 tokens\) \+ max_new_tokens \(19\) needs 49 "
                                             r"positions, past the model's attention_chunk_size \(48\)"):
            engine.add_request(prompt, "past", max_new_tokens=19)
        outputs = run_engine(engine)
    assert outputs["fits"].generated_tokens == reference_generate(model, prompt, 18)
