"""`generate`'s config semantics: unset fields resolve as `generate` resolves them, lengths count as it counts,
and every logits processor `generate` has gives `generate`'s greedy tokens, token for token."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, GPTNeoXConfig, PreTrainedModel

from contbatch import ContinuousBatchingConfig, LLMEngine, generate_batch
from contbatch.outputs import GenerationOutput
from tests.helpers import fresh_tiny_model, random_prompts, run_engine

PROMPTS = random_prompts([3, 7, 12, 20], seed=5)


def neox() -> PreTrainedModel:
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=1024, initializer_range=0.1)
    return AutoModelForCausalLM.from_config(config).eval()


def generate(model: PreTrainedModel, prompt: list[int], config: GenerationConfig | None) -> list[int]:
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                generation_config=config)
    return output[0, len(prompt):].tolist()


def engine_outputs(model: PreTrainedModel, config: GenerationConfig | None, prompts: list[list[int]],
                   **sampling: object) -> list[GenerationOutput]:
    with LLMEngine(model, config, ContinuousBatchingConfig(block_size=4, num_blocks=256)) as engine:
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, f"r{index}", **sampling)
        finished = run_engine(engine)
    return [finished[f"r{index}"] for index in range(len(prompts))]


def assert_parity(model: PreTrainedModel, config: GenerationConfig | None, prompts: list[list[int]]) -> None:
    for prompt, output in zip(prompts, engine_outputs(model, config, prompts), strict=True):
        assert output.generated_tokens == generate(model, prompt, config)


def test_gpt_neox_stops_at_the_models_own_eos_when_the_config_leaves_it_unset() -> None:
    model = neox()
    prompt = [5, 17, 33, 99, 12]
    free = generate(model, prompt, GenerationConfig(max_new_tokens=16, eos_token_id=None, pad_token_id=0))
    model.generation_config.eos_token_id = free[3]
    config = GenerationConfig(max_new_tokens=16)
    expected = generate(model, prompt, config)
    assert len(expected) == 4
    output = generate_batch(model, [prompt], config, progress_bar=False)["req_0"]
    assert output.generated_tokens == expected and output.finish_reason == "stop"


@pytest.mark.parametrize("user", [
    None, GenerationConfig(), GenerationConfig(max_new_tokens=9), GenerationConfig(repetition_penalty=1.0),
    GenerationConfig(do_sample=False, eos_token_id=None), GenerationConfig(max_length=22),
], ids=["none", "empty", "max_new", "penalty-off", "no-eos", "max_length"])
def test_fields_left_unset_come_from_the_models_generation_config(user: GenerationConfig | None) -> None:
    model = fresh_tiny_model("llama")
    free = generate(model, PROMPTS[1], GenerationConfig(max_new_tokens=12, eos_token_id=None, pad_token_id=0))
    model.generation_config.max_new_tokens = 6
    model.generation_config.repetition_penalty = 1.6
    model.generation_config.eos_token_id = free[4]
    model.generation_config.pad_token_id = 0
    assert_parity(model, user, PROMPTS)


def test_max_length_counts_the_prompt_and_the_default_is_twenty_new_tokens() -> None:
    model = fresh_tiny_model("qwen3")
    outputs = engine_outputs(model, GenerationConfig(max_length=24), PROMPTS)
    assert [len(o.generated_tokens) for o in outputs] == [24 - len(p) for p in PROMPTS]
    assert_parity(model, GenerationConfig(max_length=24), PROMPTS)
    assert [len(o.generated_tokens) for o in engine_outputs(model, GenerationConfig(), PROMPTS)] == [20] * 4
    long_prompt = random_prompts([1014], seed=3)
    assert [len(o.generated_tokens) for o in engine_outputs(model, None, long_prompt)] == [10]  # 1024 positions


def test_a_prompt_reaching_max_length_is_refused_naming_it() -> None:
    with LLMEngine(fresh_tiny_model("llama"), GenerationConfig(max_length=10)) as engine, \
            pytest.raises(ValueError, match="max_length is 10"):
        engine.add_request(list(range(3, 13)), "long")


def _free(model: PreTrainedModel) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    return [generate(model, prompt, config) for prompt in PROMPTS]


def _processor_configs(free: list[list[int]]) -> dict[str, GenerationConfig]:
    """Configs whose processors change greedy output on these prompts (asserted by the test)."""
    first, seq = free[1][0], tuple(free[2][2:4])
    common = dict(max_new_tokens=12, pad_token_id=0)
    return {
        "repetition-1.8": GenerationConfig(repetition_penalty=1.8, eos_token_id=None, **common),
        "repetition-0.5": GenerationConfig(repetition_penalty=0.5, eos_token_id=None, **common),
        "bad-words": GenerationConfig(bad_words_ids=[[first], list(seq)], eos_token_id=None, **common),
        "sequence-bias": GenerationConfig(sequence_bias={(first,): -4.0, (seq[0], 99): 9.0}, eos_token_id=None,
                                          **common),
        "suppress": GenerationConfig(suppress_tokens=[first, free[0][0]], eos_token_id=None, **common),
        "min-new-tokens": GenerationConfig(min_new_tokens=7, eos_token_id=[free[0][2], free[3][1]], **common),
        "min-length": GenerationConfig(min_length=17, eos_token_id=[free[0][2], free[3][1]], **common),
    }


@pytest.mark.parametrize("name", ["repetition-1.8", "repetition-0.5", "bad-words", "sequence-bias", "suppress",
                                  "min-new-tokens", "min-length"])
def test_each_processor_gives_generates_greedy_tokens(name: str) -> None:
    model = fresh_tiny_model("llama")
    free = _free(model)
    config = _processor_configs(free)[name]
    outputs = engine_outputs(model, config, PROMPTS)
    assert [o.generated_tokens for o in outputs] == [generate(model, p, config) for p in PROMPTS]
    assert [o.generated_tokens for o in outputs] != free  # the processor bites on these prompts


def test_per_request_processors_in_one_batch_each_give_their_own_generate() -> None:
    model = fresh_tiny_model("gemma2-softcap")
    free = _free(model)
    base = GenerationConfig(max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    overrides = [dict(repetition_penalty=1.5), {}, dict(bad_words_ids=[[free[2][0]]]),
                 dict(min_new_tokens=5, eos_token_id=free[3][1])]
    with LLMEngine(model, base, ContinuousBatchingConfig(block_size=4, num_blocks=256)) as engine:
        for index, (prompt, extra) in enumerate(zip(PROMPTS, overrides, strict=True)):
            engine.add_request(prompt, f"r{index}", **extra)
        finished = run_engine(engine)
    for index, (prompt, extra) in enumerate(zip(PROMPTS, overrides, strict=True)):
        config = GenerationConfig(**{**base.to_diff_dict(), **extra})
        assert finished[f"r{index}"].generated_tokens == generate(model, prompt, config)


def _penalised_reference(model: PreTrainedModel, prompt: list[int], steps: int, presence: float,
                         frequency: float, bias: dict[int, float]) -> list[int]:
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([tokens], device=model.device)).logits[0, -1].float()
            for token, value in bias.items():
                logits[token] += value
            counts = torch.bincount(torch.tensor(tokens[len(prompt):], dtype=torch.long, device=model.device),
                                    minlength=logits.numel())
            logits = logits - frequency * counts - presence * (counts > 0).float()
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def test_openai_penalties_and_logit_bias_match_a_plain_forward() -> None:
    model = fresh_tiny_model("llama")
    free = _free(model)
    bias = {free[0][1]: -30.0, 42: 3.5}
    outputs = engine_outputs(model, GenerationConfig(max_new_tokens=12, eos_token_id=None), PROMPTS,
                             presence_penalty=1.5, frequency_penalty=0.7,
                             logit_bias={str(token): value for token, value in bias.items()})
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.generated_tokens == _penalised_reference(model, prompt, 12, 1.5, 0.7, bias)
    assert [o.generated_tokens for o in outputs] != free


def test_stop_token_ids_stop_and_ignore_eos_runs_on() -> None:
    model = fresh_tiny_model("llama")
    free = _free(model)[1]
    config = GenerationConfig(max_new_tokens=12, eos_token_id=free[2], pad_token_id=0)
    stopped = engine_outputs(model, config, [PROMPTS[1]])[0]
    assert stopped.generated_tokens == free[:3] and stopped.finish_reason == "stop"
    ignoring = engine_outputs(model, config, [PROMPTS[1]], ignore_eos=True)[0]
    assert ignoring.generated_tokens == free and ignoring.finish_reason == "length"
    extra = engine_outputs(model, config, [PROMPTS[1]], ignore_eos=True, stop_token_ids=[free[5]])[0]
    assert extra.generated_tokens == free[:6] and extra.finish_reason == "stop"


@pytest.mark.parametrize(("config", "message"), [
    (GenerationConfig(no_repeat_ngram_size=2), "no_repeat_ngram_size=2"),
    (GenerationConfig(typical_p=0.5, do_sample=True), "typical_p=0.5"),
    (GenerationConfig(exponential_decay_length_penalty=(5, 1.5)), "exponential_decay_length_penalty=(5, 1.5)"),
])
def test_fields_contbatch_cannot_honour_are_refused_by_name(config: GenerationConfig, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        LLMEngine(fresh_tiny_model("llama"), config)


@pytest.mark.parametrize(("options", "message"), [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0, got 0.0"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3"),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
    (dict(logit_bias={"5": 101}), "logit_bias value must be in [-100, 100], got 101"),
    (dict(logit_bias={"x": 1}), "logit_bias token id must be an integer >= 0, got 'x'"),
    (dict(logit_bias={300: 1}), "logit_bias: token id 300 is outside the vocabulary [0, 256)"),
    (dict(bad_words_ids=[[]]), "bad_words_ids must hold non-empty token sequences"),
    (dict(stop_token_ids=[1000]), "stop_token_ids: token id 1000 is outside the vocabulary"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0, got -1"),
])
def test_bad_processor_values_are_refused_naming_the_value(options: dict, message: str) -> None:
    with LLMEngine(fresh_tiny_model("llama"), GenerationConfig(max_new_tokens=4)) as engine:
        with pytest.raises(ValueError) as error:
            engine.add_request([5, 6, 7], "bad", **options)
        assert message in str(error.value) and "'bad'" in str(error.value)
