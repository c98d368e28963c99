"""The weights version: every single-element write through `.data` is detected; what is not is covered by
`mark_weights_updated()`, after which no KV from the old weights is ever reused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.engine.weights import WeightsFingerprint
from tests.helpers import TINY_CONFIGS, make_engine, random_prompts, reference_generate


def fresh_model(name: str) -> torch.nn.Module:
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[name](), attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("name", ["llama", "gemma3-hybrid"])
def test_a_one_ulp_data_write_to_any_element_of_any_parameter_is_detected(name: str) -> None:
    model = fresh_model(name)
    generator = torch.Generator().manual_seed(0)
    with make_engine(model, block_size=4, num_blocks=8) as engine:
        assert not engine.check_weights(), "the first check records the weights"
        version = engine.weights_version
        for parameter_name, parameter in model.named_parameters():
            flat = parameter.data.view(-1)
            middle = int(torch.randint(flat.numel(), (1,), generator=generator))
            for index in sorted({0, middle, flat.numel() - 1}):
                old = flat[index].clone()
                flat[index] = torch.nextafter(old, torch.tensor(float("inf")))
                assert engine.check_weights(), f"{parameter_name}[{index}] changed by one ulp went unseen"
                assert engine.weights_version == version + 1
                flat[index] = old
                assert engine.check_weights() and engine.weights_version == version + 2
                version = engine.weights_version
        assert not engine.check_weights(), "unchanged weights are not a change"


def test_what_the_fingerprint_misses_is_documented_and_covered_by_the_signal() -> None:
    model = fresh_model("llama")
    prompt = random_prompts([40], seed=90)[0]
    manager = ContinuousBatchingManager(model, GenerationConfig(do_sample=False, max_new_tokens=6),
                                        ContinuousBatchingConfig(block_size=8, num_blocks=64))
    with manager:
        manager.add_request(prompt, "before", max_new_tokens=6)
        first = manager.get_result("before", timeout=60)
        manager.add_request(prompt, "cached", max_new_tokens=6)
        assert manager.get_result("cached", timeout=60).num_cached_tokens == 39
        weight = model.model.layers[0].self_attn.q_proj.weight.data
        before = WeightsFingerprint.of(model)
        weight[[0, 1]] = weight[[1, 0]].clone()  # a swap keeps the bit-pattern sum: the documented blind spot
        assert WeightsFingerprint.of(model) == before
        manager.mark_weights_updated()
        manager.add_request(prompt, "after", max_new_tokens=6)
        after = manager.get_result("after", timeout=60)
        assert after.num_cached_tokens == 0, "no KV of the old weights is reused after the signal"
        assert after.weights_version == first.weights_version + 1 == manager.weights_version
    assert after.generated_tokens == reference_generate(model, prompt, 6)
    assert after.generated_tokens != first.generated_tokens
