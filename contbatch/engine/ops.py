"""contbatch's operators in torch's `contbatch` namespace, for compiled forwards to call without tracing into them.

`define_op` registers a Python kernel under one schema for every device (`CompositeExplicitAutograd`) with a fake
kernel for tracing. It is what `torch.library.custom_op` does, without custom_op's Python autograd layer around
every call: contbatch's ops run only without grad, and a compiled decode step calls them a few hundred times. On
a 2-core AVX2 CPU a call costs about 5 us over its kernel this way, against about 25 us through `custom_op`
(docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NAMESPACE = "contbatch"
_library = torch.library.Library(NAMESPACE, "FRAGMENT")


def define_op(name: str, schema: str, kernel: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """Defines `contbatch::{name}{schema}` (schema: "(Tensor x, int n) -> Tensor"), computed by `kernel`, shaped
    by `fake` while tracing; returns the op (`torch.ops.contbatch.{name}`). The op must not mutate its inputs."""
    _library.define(f"{name}{schema}")
    _library.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_library)
    return getattr(getattr(torch.ops, NAMESPACE), name)
