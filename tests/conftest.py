"""Settings every test process needs before torch loads, and the parametrized `model_name` fixture. Nothing here
imports torch: pytest-xdist's controller loads this file before it starts the workers, and runs no test itself.
The shared helpers are in `helpers.py`."""

from __future__ import annotations

import os

import pytest

# Triton (the GPU attention kernel's tests) runs under its interpreter on a CPU; it reads this when first imported.
if os.environ.get("CONTBATCH_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test`) each worker gets its share of the cores as torch threads, and so do the servers and
# jobs the tests start: an OpenMP team larger than that waits at every barrier for members the other workers have
# descheduled (the tiny models' tests took 1.5x as long on 2 cores with 2 threads a worker).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

# The tiny model families of `helpers.TINY_CONFIGS`, each a case of every test that takes `model_name`.
TINY_FAMILIES = ("deepseek-mla", "gemma2-softcap", "gemma3-hybrid", "llama", "mistral-sliding", "qwen2", "qwen3")


def pytest_configure(config: pytest.Config) -> None:
    if _WORKERS > 1 and hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(params=TINY_FAMILIES)
def model_name(request: pytest.FixtureRequest) -> str:
    return request.param
