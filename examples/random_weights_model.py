"""A model directory with another model's architecture and tokenizer but seeded random weights.

Usage: python examples/random_weights_model.py SRC DST [--seed 0] [--config CONFIG_JSON]

SRC is a model directory; only its `config.json` and its tokenizer, chat-template and generation-config files are
read, so a directory holding just those will do. DST receives the same architecture with random weights
(`from_config`, float32 safetensors) and copies of those files. With `--config`, the architecture is that JSON
file's instead (a `config.json` with its `model_type`; `examples/shapes/` holds Qwen2-0.5B's and SmolLM2-360M's),
with SRC's tokenizer: its vocabulary must fit in the config's. For a machine that cannot download or hold the
real weights (a lent GPU with no network), or another model's shape here: `contbatch bench --model DST` then runs
the usual workload there, every engine doing the same work per token. Random weights seldom sample EOS, so
requests run to `max_new_tokens`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
          "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, help="a config.json whose architecture DST takes instead of SRC's")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if args.config is None:
        config = AutoConfig.from_pretrained(args.src, local_files_only=True)
    else:
        fields = json.loads(args.config.read_text())
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(args.dst)
    copied = [name for name in COPIED if (args.src / name).is_file()]
    for name in copied:
        shutil.copy(args.src / name, args.dst / name)
    print(f"{type(model).__name__} with random weights (seed {args.seed}) in {args.dst}; copied {', '.join(copied)}")


if __name__ == "__main__":
    main()
