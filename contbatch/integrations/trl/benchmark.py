"""GRPO step timing on GSM8K: `ContbatchGRPOTrainer` vs TRL's `GRPOTrainer` with transformers' continuous batching
vs TRL's plain `generate` path, same model, data, settings and seed.

Each trainer runs in a process of its own (`python -m contbatch.integrations.trl.benchmark --kind ...`), so that its
peak resident memory is its own and no run warms another's caches.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from contbatch.integrations.trl.gsm8k import gsm8k_dataset, numeric_answer_reward
from contbatch.integrations.trl.trainer import ContbatchGRPOTrainer

KINDS = {
    "contbatch": "ContbatchGRPOTrainer",
    "transformers-cb": "GRPOTrainer, use_transformers_continuous_batching=True",
    "generate": "GRPOTrainer, plain generate",
}


@dataclass
class GRPOSettings:
    model_dir: str
    num_prompts: int = 4
    num_generations: int = 8
    max_completion_length: int = 128
    steps: int = 3
    temperature: float = 1.0
    seed: int = 0


@dataclass
class GRPOStepResult:
    """One trainer's run: wall seconds of each optimizer step and of the generation inside it, completion tokens
    generated, mean reward, and the process's peak resident memory."""

    kind: str
    step_s: list[float]
    generation_s: list[float]
    completion_tokens: int
    mean_reward: float
    peak_rss_mib: float

    @property
    def mean_step_s(self) -> float:
        """Mean over the steps after the first (a warm-up), or the only step."""
        timed = self.step_s[1:] or self.step_s
        return sum(timed) / len(timed)

    @property
    def mean_generation_s(self) -> float:
        timed = self.generation_s[1:] or self.generation_s
        return sum(timed) / len(timed)


def run_trainer(kind: str, settings: GRPOSettings) -> GRPOStepResult:
    """Trains `settings.steps` GRPO steps with trainer `kind` in this process and times them."""
    torch.manual_seed(settings.seed)
    model = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir, padding_side="left")
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(
            output_dir=output_dir, per_device_train_batch_size=settings.num_prompts * settings.num_generations,
            num_generations=settings.num_generations, max_completion_length=settings.max_completion_length,
            max_steps=settings.steps, temperature=settings.temperature, learning_rate=1e-6, bf16=False,
            use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=settings.seed,
            use_transformers_continuous_batching=kind == "transformers-cb", dataloader_num_workers=0,
        )
        trainer_class = ContbatchGRPOTrainer if kind == "contbatch" else GRPOTrainer
        reward = cast("Callable[..., list[float | None]]", numeric_answer_reward)
        trainer = trainer_class(model=model, reward_funcs=reward, args=args,
                                train_dataset=gsm8k_dataset(settings.num_prompts * settings.steps),
                                processing_class=tokenizer)
        timer = _StepTimer(trainer)
        trainer.add_callback(timer)
        trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return GRPOStepResult(kind, timer.step_s, timer.generation_s, timer.completion_tokens,
                          sum(rewards) / max(len(rewards), 1),
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


class _StepTimer(TrainerCallback):
    """Times each optimizer step and, by wrapping the trainer's generation hook, the generation inside it."""

    def __init__(self, trainer: Any) -> None:
        self.step_s: list[float] = []
        self.generation_s: list[float] = []
        self.completion_tokens = 0
        self._start = 0.0
        self._generation = 0.0
        generate = trainer._generate_single_turn

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            completion_ids, logprobs = generate(*args, **kwargs)
            self._generation += time.perf_counter() - start
            self.completion_tokens += sum(map(len, completion_ids))
            return completion_ids, logprobs

        trainer._generate_single_turn = timed

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self._start, self._generation = time.perf_counter(), 0.0

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.step_s.append(time.perf_counter() - self._start)
        self.generation_s.append(self._generation)


def compare(kinds: list[str], settings: GRPOSettings) -> list[GRPOStepResult]:
    """Runs each trainer kind in a fresh process, one after another; raises RuntimeError naming a failed kind."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown GRPO trainer kind(s) {sorted(unknown)}; choose among {list(KINDS)}")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for kind in kinds:
            path = Path(scratch) / f"{kind}.json"
            command = [sys.executable, "-m", __name__, "--kind", kind, "--json", str(path),
                       "--settings", json.dumps(asdict(settings))]
            if subprocess.run(command, check=False).returncode != 0 or not path.exists():
                raise RuntimeError(f"the GRPO run of {kind!r} failed (its output is above)")
            results.append(GRPOStepResult(**json.loads(path.read_text())))
    return results


def format_table(results: list[GRPOStepResult], settings: GRPOSettings) -> str:
    """A markdown table of the runs, with each step time's speed-up of contbatch over it."""
    reference = next((r for r in results if r.kind == "contbatch"), results[0])
    lines = [
        f"GRPO on GSM8K: {settings.num_prompts} prompts x {settings.num_generations} generations per step, "
        f"max_completion_length={settings.max_completion_length}, temperature {settings.temperature}, "
        f"{settings.steps} steps (the first is a warm-up and not in the means), float32",
        "",
        "| trainer | s / step | generation s / step | completion tokens | peak RSS MiB | contbatch speed-up |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        lines.append(f"| {KINDS[result.kind]} | {result.mean_step_s:.1f} | {result.mean_generation_s:.1f} | "
                     f"{result.completion_tokens} | {result.peak_rss_mib:.0f} | "
                     f"{result.mean_step_s / reference.mean_step_s:.2f}x |")
    return "\n".join(lines)


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", choices=list(KINDS), required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--settings", required=True, help="GRPOSettings as JSON")
    args = parser.parse_args()
    result = run_trainer(args.kind, GRPOSettings(**json.loads(args.settings)))
    Path(args.json).write_text(json.dumps(asdict(result)))


if __name__ == "__main__":
    _main()
