"""The model stays a normal model while contbatch is attached: training forwards, backward passes, gradient
checkpointing and `generate` on the attached model compute bit for bit what an unattached deep copy computes, also
while the manager's thread runs steps on the same model object."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from tests.helpers import TINY_CONFIGS, make_engine, random_prompts, run_engine

FAMILIES = ["llama", "mistral-sliding", "gemma3-hybrid", "gemma2-softcap"]


def fresh_pair(name: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    """A new tiny model of family `name` and a deep copy taken before anything attaches to it."""
    torch.manual_seed(99)
    attention = "eager" if name.startswith("gemma2") else "sdpa"
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[name](), attn_implementation=attention)
    model.generation_config.eos_token_id = None
    return model, copy.deepcopy(model)


def padded_batch() -> dict[str, torch.Tensor]:
    """Two left-padded rows of different lengths, with labels: padding exercises the model's mask builders."""
    prompts = random_prompts([9, 14], seed=7)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def train_forward(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  dict[str, torch.Tensor]]:
    """Loss, logits and every parameter's gradient of one training forward/backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    output = model(**batch)
    output.loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    return output.loss.detach(), output.logits.detach(), grads


def assert_same_training(attached: PreTrainedModel, reference: PreTrainedModel) -> None:
    batch = padded_batch()
    loss, logits, grads = train_forward(attached, batch)
    ref_loss, ref_logits, ref_grads = train_forward(reference, batch)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


@pytest.mark.parametrize("name", FAMILIES)
def test_training_forward_on_attached_model_is_bit_identical(name: str) -> None:
    model, reference = fresh_pair(name)
    engine = make_engine(model, block_size=4, num_blocks=64)
    assert model.config._attn_implementation == "contbatch_paged"
    assert_same_training(model, reference)
    model.eval()
    engine.add_request(random_prompts([6])[0], "r", max_new_tokens=4)
    assert len(run_engine(engine)["r"].generated_tokens) == 4


@pytest.mark.parametrize("name", ["llama", "gemma3-hybrid"])
def test_gradient_checkpointing_on_attached_model_is_bit_identical(name: str) -> None:
    model, reference = fresh_pair(name)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    make_engine(model, block_size=4, num_blocks=64)
    assert_same_training(model, reference)


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_on_attached_model_is_bit_identical(name: str) -> None:
    model, reference = fresh_pair(name)
    make_engine(model, block_size=4, num_blocks=64)
    batch = padded_batch()
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    outputs = []
    for m in (model, reference):
        m.eval()
        with torch.no_grad():
            outputs.append(m.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                      generation_config=config, output_scores=True, return_dict_in_generate=True))
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    for scores, ref_scores in zip(outputs[0].scores, outputs[1].scores, strict=True):
        assert torch.equal(scores, ref_scores)


def test_training_while_the_manager_runs_steps_on_the_same_model() -> None:
    """The manager's thread runs steps while this thread trains: both see their own attention."""
    model, reference = fresh_pair("llama")
    model.eval()
    prompts = random_prompts([5, 9, 12, 7] * 4, seed=3)
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = {}
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            out = reference.generate(torch.tensor([prompt]), generation_config=config, pad_token_id=0)
            expected[f"r{i}"] = out[0, len(prompt):].tolist()
    manager = ContinuousBatchingManager(model, config, ContinuousBatchingConfig(block_size=4, num_blocks=256))
    manager.start()
    stepped = threading.Event()
    manager.engine.model_runner.execute = _signal_after(manager.engine.model_runner.execute, stepped)
    try:
        for i, prompt in enumerate(prompts):
            manager.add_request(prompt, request_id=f"r{i}")
        assert stepped.wait(60)
        checks = 0
        while len(manager.engine.requests) and checks < 5:
            assert_same_training(model, reference)
            checks += 1
        assert checks >= 1
        model.eval()
        results = {output.request_id: output.generated_tokens for output in
                   (manager.get_result(timeout=60) for _ in prompts)}
        assert manager.engine.block_pool.is_whole
    finally:
        manager.stop()
    assert results == expected


def _signal_after(function, event: threading.Event):  # type: ignore[no-untyped-def]
    def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = function(*args, **kwargs)
        event.set()
        return result
    return wrapped


def test_a_model_contbatch_never_attached_gets_a_clear_error() -> None:
    model, reference = fresh_pair("llama")
    make_engine(model, block_size=4, num_blocks=64)
    assert reference.config._attn_implementation == "sdpa"
    reference.config._attn_implementation = "contbatch_paged"
    with pytest.raises(RuntimeError, match="did not attach"):
        reference(torch.tensor([[1, 2, 3]]))
