"""GRPO on GSM8K with TRL, generating with contbatch on the live policy: the embedded SmolLM2-135M-Instruct, on CPU.

    pip install -e ".[trl]"
    python examples/grpo_trl.py --steps 4

Each step samples `--generations` completions for each of `--prompts` GSM8K questions from the model being trained
(no second copy of the weights, no weight sync), rewards a completion whose last number is the right answer, and
takes one optimizer step. The log shows the reward, the loss and contbatch's weights version, which goes up by one
per optimizer step.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import TrainerCallback
from trl import GRPOConfig

from contbatch.data.embedded import load_model_and_tokenizer
from contbatch.integrations.trl import ContbatchGRPOTrainer
from contbatch.integrations.trl.gsm8k import gsm8k_dataset, numeric_answer_reward


class ShowWeightsVersion(TrainerCallback):
    """Prints contbatch's weights version at each log line."""

    def __init__(self, trainer: ContbatchGRPOTrainer) -> None:
        self.trainer = trainer

    def on_log(self, args: object, state: object, control: object, logs: dict | None = None, **_: object) -> None:
        manager = self.trainer.contbatch_manager
        if logs and "loss" in logs and manager is not None:
            step = self.trainer.state.global_step
            print(f"step {step}: loss {logs['loss']:.4f}, reward {logs.get('reward', 0):.3f}, "
                  f"weights version {manager.weights_version}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="GSM8K questions per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per question")
    parser.add_argument("--max-completion-length", type=int, default=128)
    args = parser.parse_args()
    model, tokenizer = load_model_and_tokenizer(device="cpu", dtype=torch.float32)
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, per_device_train_batch_size=args.prompts * args.generations,
            num_generations=args.generations, max_completion_length=args.max_completion_length, max_steps=args.steps,
            learning_rate=1e-6, temperature=1.0, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
            logging_steps=1,
        )
        trainer = ContbatchGRPOTrainer(model=model, reward_funcs=numeric_answer_reward, args=config,
                                       train_dataset=gsm8k_dataset(args.prompts * args.steps),
                                       processing_class=tokenizer)
        trainer.add_callback(ShowWeightsVersion(trainer))
        trainer.train()


if __name__ == "__main__":
    main()
