"""The example scripts that the docs tell users to run."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import TINY_CONFIGS

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
