"""The example scripts that the docs tell users to run."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.helpers import TINY_CONFIGS

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_random_weights_model_keeps_the_architecture_and_files_with_seeded_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    TINY_CONFIGS["llama"]().save_pretrained(src)
    (src / "chat_template.jinja").write_text("{{ messages }}")
    monkeypatch.setattr(sys, "argv", ["random_weights_model.py", str(src), str(dst), "--seed", "3"])
    runpy.run_path(str(EXAMPLES / "random_weights_model.py"), run_name="__main__")
    model = AutoModelForCausalLM.from_pretrained(dst, local_files_only=True)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert (dst / "chat_template.jinja").read_text() == "{{ messages }}"
    torch.manual_seed(3)
    again = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]())
    assert torch.equal(model.model.embed_tokens.weight, again.model.embed_tokens.weight), "seeded"


def test_random_weights_model_takes_another_architecture_from_a_config_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst, config = tmp_path / "src", tmp_path / "dst", tmp_path / "qwen2.json"
    TINY_CONFIGS["llama"]().save_pretrained(src)
    (src / "tokenizer_config.json").write_text("{}")
    config.write_text(json.dumps({"model_type": "qwen2", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}))
    monkeypatch.setattr(sys, "argv", ["random_weights_model.py", str(src), str(dst), "--config", str(config)])
    runpy.run_path(str(EXAMPLES / "random_weights_model.py"), run_name="__main__")
    model = AutoModelForCausalLM.from_pretrained(dst, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_hidden_layers == 3
    assert model.config.vocab_size == 300 and (dst / "tokenizer_config.json").read_text() == "{}"


@pytest.mark.parametrize("name", ["qwen2-0.5b.json", "llama-360m.json"])
def test_the_shipped_shapes_are_configs_of_their_architecture(name: str) -> None:
    fields = json.loads((EXAMPLES / "shapes" / name).read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    assert config.vocab_size >= 49152 and config.num_hidden_layers in (24, 32)
