"""Structured outputs inside continuous batching, on the embedded model: every output follows its grammar, with
n samples, prefix caching and preemption, and requests without a grammar keep their exact tokens."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch import ContinuousBatchingConfig, LLMEngine, RequestStatus, StructuredOutput, generate_batch
from contbatch.data.embedded import load_model_and_tokenizer
from contbatch.engine.outputs import EventType
from contbatch.frontend.output_processor import OutputCollector
from tests.helpers import add_samples, run_engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                         "pet": {"enum": ["cat", "dog"]}}}
PERSON = StructuredOutput(json_schema=SCHEMA)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def embedded() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_model_and_tokenizer()


def chat(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def valid_person(text: str) -> bool:
    person = json.loads(text)
    return (set(person) == {"name", "age", "pet"} and isinstance(person["name"], str) and len(person["name"]) <= 12
            and isinstance(person["age"], int) and person["age"] >= 0 and person["pet"] in ("cat", "dog"))


def engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **config: object) -> LLMEngine:
    settings = {"block_size": 16, "num_blocks": 64, **config}
    return LLMEngine(model, GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False),
                     ContinuousBatchingConfig(**settings), tokenizer)  # type: ignore[arg-type]


def test_generate_batch_follows_each_prompts_grammar(embedded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tokenizer = embedded
    prompts = [chat(tokenizer, f"Describe person number {i} as JSON.") for i in range(3)]
    prompts += [chat(tokenizer, "Give me a code."), chat(tokenizer, "Cats or dogs?"), chat(tokenizer, "Hi!")]
    constraints = [PERSON] * 3 + [StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"),
                                  StructuredOutput(choice=["cats", "dogs"]), None]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)
    outputs = generate_batch(model, prompts, config, progress_bar=False, tokenizer=tokenizer,
                             structured_output=constraints)
    texts = [tokenizer.decode(o.generated_tokens, skip_special_tokens=True) for o in outputs.values()]
    assert all(o.status == RequestStatus.FINISHED and o.finish_reason == "stop" for o in outputs.values())
    assert all(valid_person(text) for text in texts[:3])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[3]) and texts[4] in ("cats", "dogs")
    alone = generate_batch(model, [prompts[5]], config, progress_bar=False)["req_0"]
    assert outputs["req_5"].generated_tokens == alone.generated_tokens  # no grammar: untouched by the others
    overlapped = generate_batch(model, prompts, config, progress_bar=False, tokenizer=tokenizer,
                                structured_output=constraints, use_async_batching=True)
    assert [o.generated_tokens for o in overlapped.values()] == [o.generated_tokens for o in outputs.values()], (
        "async batching: each grammar advances with its token before the next step samples")


def test_n_samples_each_follow_the_grammar_and_the_pool_stays_whole(
        embedded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tokenizer = embedded
    torch.manual_seed(0)
    with engine(model, tokenizer) as eng:
        ids = add_samples(eng, chat(tokenizer, "A person, as JSON."), "s", 4, do_sample=True, temperature=1.0,
                          structured_output=PERSON)
        outputs = run_engine(eng)
    texts = [tokenizer.decode(outputs[rid].generated_tokens, skip_special_tokens=True) for rid in ids]
    assert all(valid_person(text) for text in texts) and len(set(texts)) > 1


def test_preemption_and_prefix_caching_keep_outputs_valid(
        embedded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tokenizer = embedded
    prompts = [chat(tokenizer, f"Person {i} as JSON, please.") for i in range(6)]
    prompts += prompts[:2]
    preempted, cached, outputs = 0, 0, OutputCollector()
    with engine(model, tokenizer, num_blocks=14, block_size=8, allow_block_sharing=True) as tight:
        for i, prompt in enumerate(prompts):
            tight.add_request(prompt, f"t{i}", structured_output=PERSON)
        while tight.has_unfinished_requests():
            deltas = tight.step()
            outputs.add(deltas)
            preempted += sum(e.type == EventType.PREEMPTED for d in deltas for e in d.events)
            cached = max([cached, *(d.num_cached_tokens for d in deltas)])
        tight.check_integrity()
        assert tight.block_pool.is_whole
    assert preempted > 0 and cached > 0
    for i in range(len(prompts)):
        output = outputs.finished[f"t{i}"]
        assert output.finish_reason == "stop"
        assert valid_person(tokenizer.decode(output.generated_tokens, skip_special_tokens=True))


def test_bad_constraints_fail_their_own_request_naming_the_problem(
        embedded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tokenizer = embedded
    prompt = chat(tokenizer, "Hi")
    with LLMEngine(model, GenerationConfig(max_new_tokens=4)) as no_tokenizer, \
            pytest.raises(ValueError, match="structured outputs need the model's tokenizer"):
        no_tokenizer.add_request(prompt, "x", structured_output=PERSON)
    outputs = generate_batch(model, [prompt, prompt], GenerationConfig(max_new_tokens=4), progress_bar=False,
                             tokenizer=tokenizer, structured_output=[
                                 StructuredOutput(json_schema={"type": "nonsense"}), None])
    assert outputs["req_0"].status == RequestStatus.FAILED and "invalid JSON schema" in (outputs["req_0"].error or "")
    assert outputs["req_1"].status == RequestStatus.FINISHED
    with engine(model, tokenizer) as eng, pytest.raises(ValueError, match="structured_output"):
        eng.add_request(prompt, "y", structured_output={"json_schema": "{}", "unknown": 1})


def test_the_grammar_mask_is_applied_before_sampling(embedded: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tokenizer = embedded
    with engine(model, tokenizer) as eng:
        eng.add_request(chat(tokenizer, "Yes or no?"), "c", structured_output=StructuredOutput(choice=["maybe"]),
                        logprobs=True, top_logprobs=3)
        output = run_engine(eng)["c"]
    assert tokenizer.decode(output.generated_tokens, skip_special_tokens=True) == "maybe"
    assert all(torch.isfinite(torch.tensor(lp)) for lp in output.logprobs)
