"""The shared-prompt policy forward of `ContbatchGRPOTrainer` against TRL's own `_get_per_token_logps_and_entropies`:
same log-probabilities, entropies and gradients on TRL's batch layout, with and without activation checkpointing,
for fewer tokens through the model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from trl import GRPOConfig, GRPOTrainer

from contbatch import ContinuousBatchingConfig
from contbatch.data.embedded import embedded_model_dir
from contbatch.integrations.trl import ContbatchGRPOTrainer
from contbatch.integrations.trl.shared_prompt import prompt_groups

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
MODELS: dict[str, Callable[[int], PreTrainedModel]] = {
    "llama": lambda vocab: LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **COMMON)),
    "mistral-sliding": lambda vocab: MistralForCausalLM(MistralConfig(vocab_size=vocab, sliding_window=4, **COMMON)),
    "gemma2-softcap": lambda vocab: Gemma2ForCausalLM(Gemma2Config(
        vocab_size=vocab, head_dim=16, sliding_window=4, final_logit_softcapping=5.0, **COMMON)),
}
PROMPT_LENGTHS = [9, 1, 5, 9, 5, 3, 1, 9, 3]
COMPLETION_LENGTHS = [7, 3, 0, 2, 6, 7, 1, 4, 5]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def make_trainer(tmp_path: Path, tokenizer: PreTrainedTokenizerBase, family: str,
                 attach: bool = True) -> ContbatchGRPOTrainer:
    """A trainer on a tiny model, attached to contbatch as after its first generation when `attach`."""
    torch.manual_seed(0)
    model = MODELS[family](len(tokenizer))
    if family == "gemma2-softcap":
        model.set_attn_implementation("eager")
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                        max_completion_length=8, temperature=0.7, bf16=False, use_cpu=True, report_to="none",
                        save_strategy="no", dataloader_num_workers=0)
    trainer = ContbatchGRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                   args=config, train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}),
                                   processing_class=tokenizer,
                                   contbatch_config=ContinuousBatchingConfig(block_size=8, num_blocks=16))
    if attach:
        trainer._manager()
    return trainer


def trl_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """TRL's layout: prompts (three distinct ones, repeated, interleaved) left-padded, then completions
    right-padded, one of them empty."""
    generator = torch.Generator().manual_seed(1)
    prompts = {length: torch.randint(3, vocab, (length,), generator=generator) for length in set(PROMPT_LENGTHS)}
    width, prompt_width = max(COMPLETION_LENGTHS), max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), prompt_width + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(PROMPT_LENGTHS, COMPLETION_LENGTHS, strict=True)):
        ids[row, prompt_width - p:prompt_width] = prompts[p]
        ids[row, prompt_width:prompt_width + c] = torch.randint(3, vocab, (c,), generator=generator)
        mask[row, prompt_width - p:prompt_width + c] = 1
    return ids, mask, width


def tokens_through(model: PreTrainedModel) -> list[int]:
    """Appends, at each call of the first layer's MLP, its tokens."""
    counted: list[int] = []
    model.model.layers[0].mlp.register_forward_hook(lambda _m, args, _o: counted.append(args[0].shape[:-1].numel()))
    return counted


@pytest.mark.parametrize(("family", "checkpointing"), [
    ("llama", False), ("llama", True), ("mistral-sliding", True), ("gemma2-softcap", False)])
def test_shared_prompt_forward_equals_trls_forward_and_gradients(tmp_path: Path, tokenizer: PreTrainedTokenizerBase,
                                                                 family: str, checkpointing: bool) -> None:
    trainer = make_trainer(tmp_path, tokenizer, family)
    model = trainer.model
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable()
    ids, mask, width = trl_batch(len(tokenizer))
    weights = torch.randn(ids.size(0), width, generator=torch.Generator().manual_seed(2))
    counted = tokens_through(model)
    results = {}
    for name, forward in {"trl": GRPOTrainer._get_per_token_logps_and_entropies,
                          "shared": ContbatchGRPOTrainer._get_per_token_logps_and_entropies}.items():
        model.zero_grad()
        counted.clear()
        logps, entropies, aux = forward(trainer, model, ids, mask, width, compute_entropy=True)
        ((logps * weights).sum() + entropies.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (logps.detach(), entropies.detach(), grads, sum(counted))
        assert aux is None
    trl, shared = results["trl"], results["shared"]
    torch.testing.assert_close(shared[0], trl[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared[1], trl[1], atol=1e-5, rtol=1e-5)
    assert shared[2].keys() == trl[2].keys() and len(trl[2]) == len(list(model.parameters()))
    for name, grad in trl[2].items():
        torch.testing.assert_close(shared[2][name], grad, atol=1e-5 * float(grad.abs().max()), rtol=1e-4)
    assert (shared[0][torch.tensor(COMPLETION_LENGTHS)[:, None] <= torch.arange(width)] == 0).all()
    prompts_once = sum(p - 1 for p in set(PROMPT_LENGTHS) if p > 1)
    rows_per_prompt = {p: [c for q, c in zip(PROMPT_LENGTHS, COMPLETION_LENGTHS, strict=True) if q == p]
                       for p in set(PROMPT_LENGTHS)}
    completions = sum(len(cs) * (1 + max(1, max(cs))) for cs in rows_per_prompt.values())
    assert trl[3] == ids.numel() and shared[3] == prompts_once + completions < ids.numel()
    assert model.is_activation_checkpointing == checkpointing
    trainer.close_contbatch()


def test_chunks_of_batch_size_without_grad(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    trainer = make_trainer(tmp_path, tokenizer, "llama")
    ids, mask, width = trl_batch(len(tokenizer))
    with torch.no_grad():
        whole, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)
        chunked, entropies, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width,
                                                                           batch_size=2)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    assert entropies is None
    trainer.close_contbatch()


def test_unattached_models_reentrant_checkpointing_and_other_layouts_run_trls_forward(
        tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    trainer = make_trainer(tmp_path, tokenizer, "llama", attach=False)
    model = trainer.model
    ids, mask, width = trl_batch(len(tokenizer))
    counted = tokens_through(model)
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(model, ids, mask, width)
        assert sum(counted) == ids.numel()
        trainer._manager()
        counted.clear()
        trainer._get_per_token_logps_and_entropies(model, ids, mask, width)
        assert sum(counted) < ids.numel()
        trainer.args.gradient_checkpointing_kwargs = {"use_reentrant": True}
        counted.clear()
        trainer._get_per_token_logps_and_entropies(model, ids, mask, width)
        assert sum(counted) == ids.numel()
    trainer.close_contbatch()
    holes = mask.clone()
    holes[0, -width] = 0
    assert prompt_groups(ids, holes, width) is None
    assert prompt_groups(ids, mask, width) is not None
    assert [group.rows for group in prompt_groups(ids, mask, width) or []] == [[0, 3, 7], [1, 6], [2, 4], [5, 8]]
