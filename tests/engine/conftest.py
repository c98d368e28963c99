"""Fixtures of the engine's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def seeded_global_rng() -> Iterator[None]:
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        yield
