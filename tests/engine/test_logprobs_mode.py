"""Per-request `logprobs_mode`: "raw" and "processed" logprobs from the engine, checked against a plain forward
of an unattached copy of the model (its own attention, no cache) with the processing rebuilt from transformers'
logits warpers."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from contbatch import ContinuousBatchingManager, generate_batch
from contbatch.engine.sampling_params import SamplingParams
from contbatch.outputs import GenerationOutput, RequestStatus
from tests.helpers import make_engine, random_prompts, run_engine, tiny_model

NEW_TOKENS = 8
TOP = 5
ATOL = 1e-4
SETTINGS: dict[str, dict[str, Any]] = {
    "temperature-0.7": dict(temperature=0.7),
    "temperature-1.3": dict(temperature=1.3),
    "top-k-5": dict(top_k=5),
    "top-p-0.8": dict(top_p=0.8),
    "combined": dict(temperature=0.8, top_k=12, top_p=0.9),
    "top-k-3": dict(temperature=0.5, top_k=3),  # fewer kept tokens than TOP: removed ones among the top logprobs
}
GREEDY = dict(do_sample=False, temperature=0.5, top_k=3, top_p=0.5)  # all ignored by a greedy request
CASES = {**SETTINGS, "greedy": GREEDY}


def processed_reference(logits: torch.Tensor, settings: dict[str, Any]) -> torch.Tensor:
    """[T, vocab] raw logits processed as transformers' `generate` does when sampling: temperature, then top-k,
    then top-p (removed tokens at -inf); greedy settings leave the logits as they are.

    `TopPLogitsWarper` removes a token when the ascending cumulative mass up to it is <= 1 - top_p, i.e. when the
    mass of the tokens ranked above it is >= top_p; contbatch's contract keeps a token iff the mass before it is
    < top_p: the same set, up to rounding exactly at the boundary (random logits never sit there)."""
    if settings.get("do_sample") is False:
        return logits.clone()
    processors = LogitsProcessorList()
    if settings.get("temperature", 1.0) != 1.0:
        processors.append(TemperatureLogitsWarper(settings["temperature"]))
    if settings.get("top_k", 0):
        processors.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p", 1.0) < 1.0:
        processors.append(TopPLogitsWarper(settings["top_p"]))
    return processors(torch.zeros((logits.shape[0], 0), dtype=torch.long), logits.clone())


def reference_logits(reference: PreTrainedModel, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab]: the logits that predicted each generated token, from one plain forward."""
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + generated], device=reference.device), use_cache=False).logits[0]
    return logits[len(prompt) - 1:-1].float().cpu()


def at_tokens(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


@dataclass
class Run:
    outputs: dict[str, GenerationOutput]
    raw: dict[str, torch.Tensor]  # request id -> reference raw logits at each generated token


@pytest.fixture(scope="module")
def run() -> Run:
    """One engine batch holding, for every case, a "raw" and a "processed" request with the same prompt and seed
    (prompts of different lengths across cases), all asking for logprobs and TOP top logprobs."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)  # taken before the engine attaches: keeps the model's own attention
    prompts = random_prompts([5 + 3 * i for i in range(len(CASES))], seed=21)
    cases = {}
    with make_engine(model, block_size=4, num_blocks=128) as engine:
        for index, (name, settings) in enumerate(CASES.items()):
            for mode in ("raw", "processed"):
                rid = f"{name}/{mode}"
                cases[rid] = prompts[index]
                engine.add(engine.make_request(prompts[index], rid, NEW_TOKENS, seed=100 + index, logprobs=True,
                                               top_logprobs=TOP, logprobs_mode=mode,
                                               **{"do_sample": True, "top_k": 0, **settings}))
        outputs = run_engine(engine)
    raw = {rid: reference_logits(reference, prompt, outputs[rid].generated_tokens) for rid, prompt in cases.items()}
    return Run(outputs, raw)


def test_the_mode_does_not_change_the_tokens(run: Run) -> None:
    for name in CASES:
        raw, processed = run.outputs[f"{name}/raw"], run.outputs[f"{name}/processed"]
        assert raw.status == processed.status == RequestStatus.FINISHED
        assert raw.generated_tokens == processed.generated_tokens and len(raw.generated_tokens) == NEW_TOKENS


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_processed_logprobs_match_the_processed_reference(run: Run, name: str) -> None:
    output = run.outputs[f"{name}/processed"]
    raw = run.raw[f"{name}/processed"]
    expected = at_tokens(processed_reference(raw, SETTINGS[name]), output.generated_tokens)
    actual = torch.tensor(output.logprobs)
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all()
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
    # Power: the processed distribution is not the raw one at these settings.
    assert (actual - at_tokens(raw, output.generated_tokens)).abs().max() > 1e-2


@pytest.mark.parametrize("name", sorted(CASES))
def test_raw_logprobs_match_the_raw_reference(run: Run, name: str) -> None:
    output = run.outputs[f"{name}/raw"]
    expected = at_tokens(run.raw[f"{name}/raw"], output.generated_tokens)
    torch.testing.assert_close(torch.tensor(output.logprobs), expected, atol=ATOL, rtol=0)


def check_top(top: list[list[tuple[int, float]]], reference: torch.Tensor) -> None:
    """Each step's (id, logprob) pairs are the TOP largest of log_softmax(reference[step]): values within ATOL,
    ids as sets among the finite values; -inf entries (more asked than kept) name removed tokens."""
    logprobs = torch.log_softmax(reference, -1)
    assert len(top) == logprobs.shape[0]
    for step, pairs in enumerate(top):
        assert len(pairs) == TOP
        expected = logprobs[step].topk(TOP).values
        ids = torch.tensor([token for token, _ in pairs])
        values = torch.tensor([value for _, value in pairs])
        torch.testing.assert_close(values, expected, atol=ATOL, rtol=0)
        finite = torch.isfinite(values)
        assert set(ids[finite].tolist()) == set(logprobs[step].topk(int(finite.sum())).indices.tolist())
        assert torch.isinf(logprobs[step][ids[~finite]]).all()


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_processed_top_logprobs_are_the_top_of_the_processed_distribution(run: Run, name: str) -> None:
    output = run.outputs[f"{name}/processed"]
    assert output.top_logprobs is not None
    check_top(output.top_logprobs, processed_reference(run.raw[f"{name}/processed"], SETTINGS[name]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_raw_top_logprobs_are_the_top_of_the_raw_distribution(run: Run, name: str) -> None:
    output = run.outputs[f"{name}/raw"]
    assert output.top_logprobs is not None
    check_top(output.top_logprobs, run.raw[f"{name}/raw"])


def test_greedy_processed_logprobs_are_the_raw_ones(run: Run) -> None:
    """The two requests' logits come from different batch positions (and prefix-cache reuse), so they agree to
    rounding; the sampler-level test checks exact equality on one logits row."""
    raw, processed = run.outputs["greedy/raw"], run.outputs["greedy/processed"]
    assert processed.generated_tokens == raw.generated_tokens == run.raw["greedy/raw"].argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(processed.logprobs), torch.tensor(raw.logprobs), atol=1e-5, rtol=0)
    assert processed.top_logprobs is not None and raw.top_logprobs is not None
    assert [[i for i, _ in top] for top in processed.top_logprobs] == [[i for i, _ in top] for top in raw.top_logprobs]
    check_top(processed.top_logprobs, run.raw["greedy/processed"])


def test_an_unknown_mode_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="logprobs_mode must be 'raw' or 'processed', got 'foo'"):
        SamplingParams(logprobs_mode="foo")
    with pytest.raises(ValueError, match="got 'bar'"):
        SamplingParams.from_generation_config(GenerationConfig(logprobs_mode="bar"))
    with (make_engine(tiny_model("llama"), block_size=4, num_blocks=16) as engine,
          pytest.raises(ValueError, match=r"request 'r': .*got 'Processed'")):
        engine.make_request([5, 6, 7], "r", 2, logprobs=True, logprobs_mode="Processed")


def test_an_unknown_mode_fails_only_its_request_through_the_manager() -> None:
    manager = ContinuousBatchingManager(tiny_model("llama"), GenerationConfig(do_sample=False, max_new_tokens=3))
    with manager:
        good = manager.add_request([5, 6, 7], "good", logprobs=True, logprobs_mode="processed", temperature=0.7,
                                   seed=1)
        with pytest.raises(ValueError, match="got 'foo'"):
            manager.add_request([5, 6, 7], "bad", logprobs=True, logprobs_mode="foo")
        output = manager.get_result(good, timeout=60)
    assert output is not None and output.status == RequestStatus.FINISHED
    assert output.logprobs is not None and len(output.logprobs) == 3


def test_generate_batch_takes_the_mode_from_the_generation_config() -> None:
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    prompts = random_prompts([6, 11], seed=4)
    settings = dict(temperature=0.6, top_k=10)
    config = GenerationConfig(do_sample=True, max_new_tokens=5, eos_token_id=None, logprobs_mode="processed",
                              **settings)
    outputs = generate_batch(model, prompts, config, return_logprobs=True, progress_bar=False, block_size=4)
    for prompt, output in zip(prompts, outputs.values(), strict=True):
        raw = reference_logits(reference, prompt, output.generated_tokens)
        expected = at_tokens(processed_reference(raw, settings), output.generated_tokens)
        torch.testing.assert_close(torch.tensor(output.logprobs), expected, atol=ATOL, rtol=0)
    config.logprobs_mode = "nope"
    failed = generate_batch(model, prompts, config, return_logprobs=True, progress_bar=False, block_size=4)
    assert all(o.status == RequestStatus.FAILED and "'nope'" in (o.error or "") for o in failed.values())
