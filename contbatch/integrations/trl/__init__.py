"""TRL integration (extra `trl`): GRPO training that generates with contbatch on the live model."""

from contbatch.integrations.trl.trainer import ContbatchGRPOTrainer

__all__ = ["ContbatchGRPOTrainer"]
