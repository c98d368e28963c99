"""`contbatch serve`'s engine configuration: the serving token budget on CPU, the flags that override it."""

from __future__ import annotations

import torch

from contbatch import ContinuousBatchingConfig
from contbatch.cli import build_parser
from contbatch.cli.serve import SERVE_MAX_BATCH_TOKENS, serve_config
from contbatch.engine.engine import DEFAULT_MAX_BATCH_TOKENS


def _config(*flags: str, device: str = "cpu") -> ContinuousBatchingConfig:
    return serve_config(build_parser().parse_args(["serve", *flags]), torch.device(device))


def test_serve_takes_the_serving_budget_on_cpu_without_the_flag() -> None:
    assert SERVE_MAX_BATCH_TOKENS["cpu"] == 2048 > DEFAULT_MAX_BATCH_TOKENS["cpu"]
    config = _config("--max-queue-size", "7", "--block-size", "32")
    assert (config.max_batch_tokens, config.max_queue_size, config.block_size) == (2048, 7, 32)


def test_an_explicit_budget_wins() -> None:
    assert _config("--max-batch-tokens", "300").max_batch_tokens == 300


def test_other_devices_keep_the_engine_default() -> None:
    assert _config(device="cuda").max_batch_tokens is None
