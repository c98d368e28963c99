"""Beam search inside continuous batching: sequences and scores equal `generate(num_beams=k)`'s, alongside other
requests, under preemption, through `generate_batch` and the manager; beams share blocks and leak none."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, LLMEngine, RequestStatus, generate_batch
from contbatch.outputs import GenerationOutput
from tests.helpers import fresh_tiny_model, random_prompts, reference_generate, run_engine

PROMPTS = random_prompts([3, 7, 12, 20], seed=5)
NEW = 12
RETURN = 3


def frequent_tokens(model: PreTrainedModel) -> list[int]:
    """Two tokens beams often produce early: as EOS ids they end many hypotheses at different lengths."""
    config = GenerationConfig(num_beams=4, num_return_sequences=4, max_new_tokens=NEW, eos_token_id=None,
                              pad_token_id=0)
    counts: collections.Counter[int] = collections.Counter()
    with torch.inference_mode():
        for prompt in PROMPTS:
            output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                    dtype=torch.long), generation_config=config)
            counts.update(output[:, len(prompt) + 1:len(prompt) + 8].flatten().tolist())
    return [token for token, _ in counts.most_common(2)]


def beam_config(eos: list[int], early_stopping: bool | str, length_penalty: float) -> GenerationConfig:
    return GenerationConfig(num_beams=4, num_return_sequences=RETURN, max_new_tokens=NEW, do_sample=False,
                            early_stopping=early_stopping, length_penalty=length_penalty, eos_token_id=eos,
                            pad_token_id=0)


def reference(model: PreTrainedModel, prompt: list[int], config: GenerationConfig) -> tuple[list[list[int]],
                                                                                            torch.Tensor]:
    """generate's returned sequences (generated part, each at its own length) and their scores."""
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                generation_config=config, return_dict_in_generate=True, output_scores=True)
    lengths = (output.beam_indices != -1).sum(dim=1).tolist()
    return ([output.sequences[j, len(prompt):len(prompt) + lengths[j]].tolist() for j in range(RETURN)],
            output.sequences_scores)


def assert_matches(model: PreTrainedModel, config: GenerationConfig, outputs: dict[str, GenerationOutput],
                   prefix: str = "r") -> list[int]:
    lengths = []
    for index, prompt in enumerate(PROMPTS):
        sequences, scores = reference(model, prompt, config)
        mine = [outputs[f"{prefix}{index}_{j}"] for j in range(RETURN)]
        assert [o.generated_tokens for o in mine] == sequences
        torch.testing.assert_close(torch.tensor([o.sequence_score for o in mine]), scores, atol=1e-5, rtol=1e-5)
        assert all(o.status == RequestStatus.FINISHED for o in mine)
        lengths += [len(o.generated_tokens) for o in mine]
    return lengths


@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "gemma2-softcap"])
@pytest.mark.parametrize(("early_stopping", "length_penalty"), [
    (False, 1.0), (True, 1.0), ("never", 0.5), (False, -1.0), (True, 2.0), ("never", 1.5)])
def test_sequences_and_scores_equal_generates(name: str, early_stopping: bool | str, length_penalty: float) -> None:
    model = fresh_tiny_model(name)
    config = beam_config(frequent_tokens(model), early_stopping, length_penalty)
    with LLMEngine(model, config, ContinuousBatchingConfig(block_size=4, num_blocks=256)) as engine:
        for index, prompt in enumerate(PROMPTS):
            engine.add(engine.make_request(prompt, f"r{index}", num_return_sequences=RETURN))
        outputs = run_engine(engine)
    lengths = assert_matches(model, config, outputs)
    if name == "llama" and length_penalty <= 1.0:
        assert min(lengths) < NEW  # hypotheses end at EOS before the length limit: both endings are covered


def test_beams_run_beside_other_requests_and_under_preemption() -> None:
    model = fresh_tiny_model("llama")
    config = beam_config(frequent_tokens(model), False, 1.0)
    greedy = random_prompts([9, 15], seed=8)
    preempted = 0
    with LLMEngine(model, config, ContinuousBatchingConfig(block_size=4, num_blocks=20,
                                                           max_batch_tokens=16)) as engine:
        for index, prompt in enumerate(PROMPTS):
            engine.add(engine.make_request(prompt, f"r{index}", num_return_sequences=RETURN))
        for index, prompt in enumerate(greedy):
            engine.add_request(prompt, f"g{index}", num_beams=1, eos_token_id=None)
        outputs = {}
        while engine.has_unfinished_requests():
            deltas = engine.step()
            preempted += sum(event.type.value == "preempted" for delta in deltas for event in delta.events)
            for delta in deltas:
                outputs.setdefault(delta.request_id, []).append(delta)
        engine.check_integrity()
        assert engine.block_pool.is_whole
    finished = {rid: _as_output(rid, deltas) for rid, deltas in outputs.items()}
    assert_matches(model, config, finished)
    for index, prompt in enumerate(greedy):
        assert finished[f"g{index}"].generated_tokens == reference_generate(model, prompt, NEW)
    assert not any("#" in rid for rid in outputs), "beams' own deltas stay inside the engine"
    assert preempted > 0


def _as_output(request_id: str, deltas: list) -> GenerationOutput:
    last = deltas[-1]
    return GenerationOutput(request_id, generated_tokens=[t for d in deltas for t in d.new_token_ids],
                            status=last.status, finish_reason=last.finish_reason, sequence_score=last.sequence_score)


def test_beams_share_the_prompts_blocks() -> None:
    model = fresh_tiny_model("llama")
    prompt = random_prompts([64], seed=2)[0]
    config = GenerationConfig(num_beams=4, max_new_tokens=3, do_sample=False, eos_token_id=None)
    with LLMEngine(model, config, ContinuousBatchingConfig(block_size=4, num_blocks=200)) as engine:
        engine.add_request(prompt, "b")
        engine.step()
        engine.step()
        beams = [r for r in engine.requests.values() if r.request_id.startswith("b#")]
        assert len(beams) == 4
        used = engine.block_pool.num_blocks - engine.block_pool.num_free_blocks
        assert used < 2 * 64 // 4  # four sequences of 65+ tokens, but the prompt's 16 blocks are held once
        run_engine(engine)


def test_generate_batch_and_the_manager_return_the_best_sequences_with_scores() -> None:
    model = fresh_tiny_model("qwen3")
    config = beam_config(frequent_tokens(model), "never", 1.0)
    outputs = generate_batch(model, PROMPTS, config, progress_bar=False)
    assert_matches(model, config, outputs, prefix="req_")
    with ContinuousBatchingManager(model, config, ContinuousBatchingConfig(block_size=4, num_blocks=256)) as manager:
        manager.add_request(PROMPTS[1], "m", n=RETURN)
        results = {f"m_{j}": manager.get_result(f"m_{j}", timeout=60) for j in range(RETURN)}
        assert [r.generated_tokens for r in results.values()] == reference(model, PROMPTS[1], config)[0]
        manager.add_request(PROMPTS[2], "c", n=RETURN)
        manager.cancel_request("c_0")
        cancelled = [manager.get_result(f"c_{j}", timeout=60) for j in range(RETURN)]
        assert all(r is not None and r.status == RequestStatus.CANCELLED for r in cancelled)


@pytest.mark.parametrize(("options", "message"), [
    (dict(do_sample=True), "beam search does not support do_sample=True (beam sampling)"),
    (dict(logprobs=True), "beam search does not support logprobs"),
    (dict(num_return_sequences=5), "num_return_sequences (5) must be at most num_beams (4)"),
    (dict(max_new_tokens=0), "beam search does not support max_new_tokens=0"),
    (dict(early_stopping="sometimes"), "early_stopping must be True, False or 'never'"),
])
def test_what_beam_search_refuses_is_named(options: dict, message: str) -> None:
    with LLMEngine(fresh_tiny_model("llama"), GenerationConfig(num_beams=4, max_new_tokens=4)) as engine, \
            pytest.raises(ValueError) as error:
        engine.add_request([5, 6, 7], "bad", **options)
    assert message in str(error.value)
