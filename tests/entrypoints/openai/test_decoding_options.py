"""The server's decoding options with the `openai` client: beam search (vLLM's `use_beam_search`), penalties and
logit bias, and the 400s for values out of range."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from contbatch.data.embedded import embedded_model_dir
from tests.entrypoints.openai.test_server import MODEL, Served


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    server = Served(AutoTokenizer.from_pretrained(embedded_model_dir()))
    yield server
    server.close()


def prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return tokenizer("The weather today is")["input_ids"]


def test_beam_search_returns_generates_best_sequences(served: Served) -> None:
    ids = prompt_ids(served.tokenizer)
    response = served.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, n=2,
        extra_body={"use_beam_search": True, "num_beams": 4, "length_penalty": 0.5, "early_stopping": "never"})
    config = GenerationConfig(num_beams=4, num_return_sequences=2, max_new_tokens=8, length_penalty=0.5,
                              early_stopping="never", eos_token_id=None, pad_token_id=0, do_sample=False)
    with torch.inference_mode():
        expected = served.reference_model.generate(torch.tensor([ids]), generation_config=config,
                                                   attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    texts = [served.text(row[len(ids):].tolist()) for row in expected]
    assert [choice.text for choice in sorted(response.choices, key=lambda c: c.index)] == texts
    assert served.wait_until_pool_whole()


def test_penalties_and_logit_bias_change_the_output(served: Served) -> None:
    ids = prompt_ids(served.tokenizer)
    plain = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    first = served.greedy(ids, 1)[0]
    biased = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                              logit_bias={str(first): -100})
    assert served.tokenizer(biased.choices[0].text, add_special_tokens=False)["input_ids"][:1] != [first]
    penalised = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                                 frequency_penalty=2.0, presence_penalty=2.0,
                                                 extra_body={"repetition_penalty": 1.5})
    assert plain.choices[0].text != penalised.choices[0].text


@pytest.mark.parametrize(("extra", "message"), [
    ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2], got 3.0"),
    ({"logit_bias": {"5": 300}}, "logit_bias value must be in [-100, 100], got 300"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty must be a finite number > 0"),
    ({"n": 3, "extra_body": {"use_beam_search": True, "num_beams": 2}},
     "num_return_sequences (3) must be at most num_beams (2)"),
    ({"extra_body": {"use_beam_search": True, "num_beams": 2}, "logprobs": 1}, "beam search does not support logprobs"),
])
def test_bad_decoding_options_are_a_400_naming_them(served: Served, extra: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        served.client.completions.create(model=MODEL, prompt=prompt_ids(served.tokenizer), max_tokens=4, **extra)
    assert message in str(error.value)
