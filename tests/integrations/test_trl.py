"""`ContbatchGRPOTrainer` inside TRL's real `GRPOTrainer` loop, on a tiny random model with the embedded tokenizer."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase
from trl import GRPOConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, LLMEngine
from contbatch.data.embedded import embedded_model_dir
from contbatch.integrations.trl import ContbatchGRPOTrainer, benchmark
from contbatch.integrations.trl.gsm8k import numeric_answer_reward
from contbatch.integrations.trl.trainer import _collect

PROMPTS = ["What is 2 + 3?", "Name a colour.", "Count to three.", "Say hello."]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def tiny_policy(tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    return LlamaForCausalLM(config)


def distinct_characters(completions: list[str], **_: Any) -> list[float]:
    """A reward that differs between completions, so that advantages (and gradients) are not zero."""
    return [float(len(set(completion))) for completion in completions]


def grpo_args(tmp_path: Path, steps: int, **overrides: Any) -> GRPOConfig:
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        max_steps=steps, learning_rate=5e-2, temperature=0.8, bf16=False, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, seed=3, dataloader_num_workers=0,
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


@pytest.fixture
def add_request_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Every `ContinuousBatchingManager.add_request` call's prompt length and n."""
    calls: list[dict[str, Any]] = []
    original = ContinuousBatchingManager.add_request

    def recording(self: ContinuousBatchingManager, input_ids: Any, *args: Any, **kwargs: Any) -> str:
        calls.append({"prompt": tuple(input_ids), "n": kwargs.get("n", 1)})
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(ContinuousBatchingManager, "add_request", recording)
    yield calls


class CheckedTrainer(ContbatchGRPOTrainer):
    """Checks, on each generation batch before any optimizer step uses it, that the sampling logprobs TRL received
    equal the trainer's own logprobs of those tokens (log_softmax(logits / temperature) of a training-path forward,
    which is contbatch's "processed" distribution when top-k keeps the sampled tokens)."""

    checked = 0

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        width = output["completion_ids"].size(1)
        with torch.no_grad():
            own, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, mask, width, batch_size=8)
        sampled = output["sampling_per_token_logps"]
        real = output["completion_mask"].bool()
        assert torch.isfinite(sampled[real]).all()
        torch.testing.assert_close(sampled[real], own[real], atol=1e-4, rtol=0)
        assert self.contbatch_manager is not None
        assert self.contbatch_manager.engine.is_sleeping == self.release_kv_between_steps
        self.checked += 1
        return output


def test_grpo_training_generates_with_contbatch_and_updates_the_policy(
        tmp_path: Path, tokenizer: PreTrainedTokenizerBase, add_request_calls: list[dict[str, Any]]) -> None:
    model = tiny_policy(tokenizer)
    before = copy.deepcopy(model.state_dict())
    trainer = CheckedTrainer(
        model=model, reward_funcs=distinct_characters, args=grpo_args(tmp_path, steps=3),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 3}), processing_class=tokenizer,
        contbatch_config=ContinuousBatchingConfig(block_size=8, num_blocks=256), release_kv_between_steps=True,
    )
    versions: list[int] = []
    original_run = trainer._run

    def run_and_record(manager: ContinuousBatchingManager, prompt_ids: Any) -> Any:
        outputs = original_run(manager, prompt_ids)
        versions.extend(output.weights_version for output in outputs)
        return outputs

    trainer._run = run_and_record  # type: ignore[method-assign]
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == 3 and len(losses) == 3
    assert all(math.isfinite(loss) for loss in losses)
    changed = [name for name, value in model.state_dict().items() if not torch.equal(value, before[name])]
    assert changed
    assert trainer.checked == 3
    assert len(add_request_calls) == 3 * 2 and all(call["n"] == 4 for call in add_request_calls)
    assert sorted(set(versions)) == [versions[0], versions[0] + 1, versions[0] + 2]
    assert trainer.contbatch_manager is None
    assert model.config._attn_implementation != "contbatch_paged"


def test_grpo_with_lora_and_gradient_checkpointing(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    model = tiny_policy(tokenizer)
    trainer = CheckedTrainer(
        model=model, reward_funcs=distinct_characters,
        args=grpo_args(tmp_path, steps=2, gradient_checkpointing=True),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}), processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        contbatch_config=ContinuousBatchingConfig(block_size=8, num_blocks=256), release_kv_between_steps=False,
    )
    lora = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_B" in name}
    base = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "base_layer" in name}
    seen: list[bool] = []
    original_run = trainer._run

    def run_with_adapters(manager: ContinuousBatchingManager, prompt_ids: Any) -> Any:
        seen.append(any("lora_A" in name for name, _ in manager.model.named_parameters()))
        return original_run(manager, prompt_ids)

    trainer._run = run_with_adapters  # type: ignore[method-assign]
    trainer.train()
    assert seen and all(seen)
    assert trainer.checked == 2  # the second generation ran with trained (non-zero) adapters, matching the trainer
    named = dict(trainer.model.named_parameters())
    assert any(not torch.equal(named[name], value) for name, value in lora.items())
    assert all(torch.equal(named[name], value) for name, value in base.items())


@pytest.mark.parametrize(("setting", "message"), [
    ({"generation_kwargs": {"no_repeat_ngram_size": 2}}, r"generation_kwargs\['no_repeat_ngram_size'\]"),
    ({"generation_kwargs": {"num_beams": 2}}, r"generation_kwargs\['num_beams'\]"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path: Path, tokenizer: PreTrainedTokenizerBase,
                                                  setting: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ContbatchGRPOTrainer(model=tiny_policy(tokenizer), reward_funcs=distinct_characters,
                             args=grpo_args(tmp_path, steps=1, **setting),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer)


def test_min_p_and_repetition_penalty_reach_the_engine(tmp_path: Path, tokenizer: PreTrainedTokenizerBase,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = ContbatchGRPOTrainer(
        model=tiny_policy(tokenizer), reward_funcs=distinct_characters,
        args=grpo_args(tmp_path, steps=1, min_p=0.2, repetition_penalty=1.3),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
        contbatch_config=ContinuousBatchingConfig(block_size=8, num_blocks=256), release_kv_between_steps=False,
    )
    params: list[Any] = []
    original = LLMEngine.add

    def recording(self: LLMEngine, request: Any) -> None:
        params.append(request.params)
        original(self, request)

    monkeypatch.setattr(LLMEngine, "add", recording)
    prompt_ids = [tokenizer(text)["input_ids"] for text in PROMPTS[:2]]
    try:
        completions, logprobs = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    finally:
        trainer.close_contbatch()
    assert len(completions) == 2 and all(completions) and all(math.isfinite(lp) for row in logprobs for lp in row)
    assert params and all(p.min_p == 0.2 and p.repetition_penalty == 1.3 for p in params)


def test_numeric_answer_reward() -> None:
    answers = ["Natalia sold 48/2 = 24 clips.\n#### 72", "#### 1,000"]
    chat = [[{"role": "assistant", "content": "So the answer is 72."}], [{"role": "assistant", "content": "1,000"}]]
    assert numeric_answer_reward(chat, answers) == [1.0, 1.0]
    assert numeric_answer_reward(["It is 71", "no idea"], answers) == [0.1, 0.0]


def test_a_failed_completion_raises_naming_it_and_leaves_the_engine_clean(
        tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    trainer = ContbatchGRPOTrainer(
        model=tiny_policy(tokenizer), reward_funcs=distinct_characters, args=grpo_args(tmp_path, steps=1),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
        contbatch_config=ContinuousBatchingConfig(block_size=8, num_blocks=256), release_kv_between_steps=False,
    )
    short, too_long = [5, 6, 7], [5] * 600
    try:
        with pytest.raises(ValueError, match=r"grpo-0-1.*600 tokens"):
            trainer._generate_single_turn([short, short, too_long], None, {}, 2)
        completions, logprobs = trainer._generate_single_turn([short, short], None, {}, 2)
        assert [len(c) for c in completions] == [len(lp) for lp in logprobs] and all(completions)
        engine = trainer.contbatch_manager.engine
        assert not engine.requests and engine.block_pool.is_whole
    finally:
        trainer.close_contbatch()


def test_a_cancelled_completion_raises_instead_of_reaching_the_loss(tokenizer: PreTrainedTokenizerBase) -> None:
    """A request cancelled before its completion (generation stopped from another thread) is an error, not a
    cut-short completion to train on. Submitted before the engine starts, the cancellation comes first."""
    manager = ContinuousBatchingManager(tiny_policy(tokenizer), None,
                                        ContinuousBatchingConfig(block_size=8, num_blocks=64))
    request_id = manager.add_request([5, 6, 7], request_id="grpo-0-0", max_new_tokens=8)
    manager.cancel_request(request_id)
    manager.start()
    try:
        with pytest.raises(RuntimeError, match="'grpo-0-0' ended CANCELLED"):
            _collect(manager, {request_id: 0})
    finally:
        manager.stop()


@pytest.mark.parametrize("kind", ["contbatch", "generate"])
def test_the_grpo_benchmark_times_steps_and_generation(tmp_path: Path, tokenizer: PreTrainedTokenizerBase,
                                                       kind: str) -> None:
    """`contbatch bench --workload grpo-trl`'s in-process runner, on a tiny model saved with the embedded tokenizer."""
    model_dir = tmp_path / "tiny"
    tiny_policy(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    settings = benchmark.GRPOSettings(str(model_dir), num_prompts=1, num_generations=2, max_completion_length=4,
                                      steps=2)
    result = benchmark.run_trainer(kind, settings)
    assert len(result.step_s) == len(result.generation_s) == 2
    assert all(0 < generation < step for generation, step in zip(result.generation_s, result.step_s, strict=True))
    assert 0 < result.completion_tokens <= 2 * 2 * 4 and result.peak_rss_mib > 0
    table = benchmark.format_table([result], settings)
    assert benchmark.KINDS[kind] in table and f"{result.mean_step_s:.1f}" in table


def test_the_grpo_benchmark_refuses_an_unknown_trainer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'vllm'"):
        benchmark.compare(["vllm"], benchmark.GRPOSettings(str(tmp_path)))
