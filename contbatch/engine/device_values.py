"""Small host values (row indices, per-row parameters) put on the device without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_tensor(values: float | Sequence[int] | Sequence[float], device: torch.device,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`. On a GPU, `torch.tensor(values, device=...)` copies
    synchronously: the host would wait for every kernel queued before it, the forward in flight included, and
    could not launch the next step meanwhile (`handoff`). This copy does not wait (from pageable memory the CUDA
    runtime stages a small copy and returns). On a CPU it is the host tensor itself."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
