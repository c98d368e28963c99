"""Greedy tokens from a float32 or bfloat16 output head through an int8 screen.

A greedy decode step needs only the argmax of each logits row, and the head's product is the largest of the step
(49,152 x 576 for the embedded model). oneDNN's int8 product runs at about 3x its float32 one where the CPU has
VNNI, and at about 2.4x on AVX2 alone, where the kernels' own product (`screen_product`) takes about 0.6x oneDNN's
time. The screen quantises the head's rows to int8 (once per weight version) and
each hidden row to integer codes (`code_levels`: [-127, 127] with VNNI; [-63, 63] without, where AVX2's int8
products sum pairs of products in int16, which larger codes could saturate), and gets from the exact integer
product an approximation of every logit with a rigorous bound on its distance to any
float32 evaluation of the logit (`csrc/head_screen.cpp` states it). Only the tokens whose upper bound reaches the
best lower bound can be the argmax; they get a float32 logit, and the first largest is the token: the argmax of the
float32 logits up to the summation order of the product, as with any GEMM library. A bfloat16 head's weights and
hidden rows are exact in float32, and its logits are float32 sums rounded to bfloat16: the screen keeps every token
whose upper bound reaches the bfloat16 value below the best lower bound's rounding, and the token is the first
largest of the candidates' float32 logits rounded to bfloat16.

Within `allow_screen` (the engine's steps, whose logits go straight to sampling), the model runner asks for it
(`screen_request`) for a step whose every sampling row is plain greedy (no sampling,
processors, logprobs, grammar or beams) and which computes no other logits rows. The head's packed product
(`packed_weights`) then calls `screened_product`, which stores the tokens in the request and returns an
uninitialised logits tensor of the right shape: nothing may read it. The runner screens only a model whose forward
returns the head's output itself as its logits, which its first plain greedy step shows (the head's product notes
its output, `note_head_output`): a model that transforms its logits after the head (a soft cap, a scale) is never
screened.

Off where the kernels are not built or the CPU lacks AVX2, where oneDNN's quantised product is missing or fails its
self-check at packing (int32 products checked exactly on extreme inputs of the code range), for heads of other
dtypes, and with `CONTBATCH_HEAD_SCREEN=0`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from contbatch.engine import head_buffer
from contbatch.engine.batch import SamplingTarget
from contbatch.engine.cpu_kernels import kernel_module

logger = logging.getLogger(__name__)
_EPS32 = 2.0**-24
CHECK_ROWS = 16
CHECK_BLOCK = 4096
EXACT_K = 1024
OWN_PRODUCT_LEVELS = 63
"""Codes in a range up to this take the kernels' `screen_product` where it is built (AVX2): on a Zen 3 without
VNNI, 38-40 ms against oneDNN's 59-65 for 128 rows of the embedded model's head, the same values bit for bit. Wider
codes (VNNI builds) would saturate its int16 pair sums; they take oneDNN."""
SCREENED_DTYPES = (torch.float32, torch.bfloat16)
_local = threading.local()
_screens: dict[int, HeadScreen | None] = {}


@dataclass
class HeadScreen:
    """The int8 head of one weight version: `packed` (oneDNN's layout, or with `sums`, each int8 row's sum, the
    panels of the kernels' `screen_product`), per-row `scales` s_j, and the bound's coefficients a_j = s_j |q_j|_2
    and c_j = |r_j|_2 + gamma_K |W_j|_2, rounded up to float32; hidden rows take codes in [-`levels`, `levels`],
    passed to the product as unsigned codes with zero point `levels` + 1."""

    packed: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor
    a: torch.Tensor
    c: torch.Tensor
    levels: int
    sums: torch.Tensor | None = None

    @property
    def zero_point(self) -> int:
        return self.levels + 1


@dataclass
class ScreenRequest:
    """A forward's request to the head's packed product. `screen`: screen (else only note the head's output).
    The product leaves the greedy tokens of every row of its input (when it screened) and its output: the
    placeholder it returned, or the logits it computed."""

    screen: bool
    tokens: torch.Tensor | None = None
    head_output: torch.Tensor | None = None


@contextmanager
def screen_request(screen: bool) -> Iterator[ScreenRequest]:
    """Within the block, the head's packed product on this thread reports to the yielded request, and screens when
    `screen` asks and it can."""
    request = ScreenRequest(screen)
    with head_buffer.thread_value(_local, "request", request):
        yield request


def allow_screen() -> AbstractContextManager[None]:
    """Within the block, `ModelRunner.execute` on this thread may serve plain greedy steps through the screen: its
    caller hands the logits to `sample` only (the engine's steps)."""
    return head_buffer.thread_value(_local, "allowed", True)


def screen_allowed() -> bool:
    """Whether this thread is inside `allow_screen`."""
    return bool(getattr(_local, "allowed", False))


@functools.cache
def screen_supported() -> bool:
    """Whether the screen can run here: the kernels built, a CPU with AVX2 at least (torch's CPU capability),
    oneDNN's quantised linear present, and not disabled by `CONTBATCH_HEAD_SCREEN=0`."""
    return (os.environ.get("CONTBATCH_HEAD_SCREEN", "1") != "0" and kernel_module() is not None
            and torch.backends.cpu.get_cpu_capability() != "DEFAULT"
            and hasattr(torch.ops.onednn, "qlinear_prepack") and torch.backends.mkldnn.is_available())


@functools.cache
def code_levels() -> int:
    """The hidden rows' code range here: 127 where the kernels are built with VNNI (int8 products accumulated in
    int32), else 63 (unsigned codes up to 127, so that a pair of u8 x s8 products stays within int16)."""
    module = kernel_module()
    return 127 if module is not None and module.has_vnni() else 63


def forget(handle: int) -> None:
    """Drops the screen of the head registered under `handle` (its weight changed); the next screened product
    builds it again."""
    _screens.pop(handle, None)


def screened_product(x: torch.Tensor, weight: torch.Tensor, handle: int) -> torch.Tensor | None:
    """The head's output for a screened step: when this thread asked (`screen_request`) and the screen applies to
    `weight` (float32 or bfloat16, screen built for `handle`), stores the greedy token of every row of `x` in the
    request and returns an uninitialised [*x.shape[:-1], vocab] tensor; else None (the caller computes the
    logits)."""
    request: ScreenRequest | None = getattr(_local, "request", None)
    if (request is None or not request.screen or weight.dtype not in SCREENED_DTYPES or x.dtype != weight.dtype
            or not screen_supported()):
        return None
    if handle not in _screens:
        _screens[handle] = build_screen(weight.detach())
    screen = _screens[handle]
    if screen is None:
        return None
    hidden = x.reshape(-1, x.shape[-1]).float().contiguous()
    request.tokens = screen_tokens(hidden, weight.detach(), screen)
    request.head_output = x.new_empty((*x.shape[:-1], weight.shape[0]))
    return request.head_output


def note_head_output(output: torch.Tensor) -> torch.Tensor:
    """Returns `output`, the logits the head's packed product computed, first noting them in this thread's
    request, if any."""
    request: ScreenRequest | None = getattr(_local, "request", None)
    if request is not None and request.head_output is None:
        request.head_output = output
    return output


def screen_tokens(hidden: torch.Tensor, weight: torch.Tensor, screen: HeadScreen) -> torch.Tensor:
    """[rows] int64: the greedy token of each row of `hidden` [rows, K] (float32, contiguous) under the head
    `weight` [V, K] (float32, or bfloat16: the first largest of the logits rounded to bfloat16), -1 for a row that is
    not finite."""
    module = kernel_module()
    codes, stats = module.screen_quantize(hidden, screen.levels)
    scaled = _int8_product(codes, screen, head_buffer.buffer(codes.shape[0], screen.scales.shape[0]))
    return module.screen_tokens(scaled, stats, screen.a, screen.c, hidden, weight.contiguous())


def _int8_product(codes: torch.Tensor, screen: HeadScreen, out: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, V] float32: s_j (q_j . p) for the uint8 `codes` [rows, K] (zero point `screen.zero_point`), by the
    kernels' `screen_product` where the screen holds its panels, else by oneDNN; with `out` (contiguous [rows, V]
    float32), computed into it (oneDNN's "sum" post-op into `out` zeroed: the same values)."""
    zero = screen.zero_point
    if screen.sums is not None:
        own = torch.empty(codes.shape[0], screen.scales.shape[0]) if out is None else out
        kernel_module().screen_product(codes, screen.packed, screen.sums, screen.scales, zero, own)
        return own
    if out is None:
        return torch.ops.onednn.qlinear_pointwise(codes, 1.0, zero, screen.packed, screen.scales,
                                                  screen.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
    return torch.ops.onednn.qlinear_pointwise.binary(codes, 1.0, zero, screen.packed, screen.scales,
                                                     screen.zero_points, out.zero_(), None, 1.0, 0, torch.float32,
                                                     1.0, 0, "sum", 1.0, "none", [], "")


def build_screen(weight: torch.Tensor, levels: int | None = None) -> HeadScreen | None:
    """The screen of a head `weight` [V, K] (float32 or bfloat16; its int8 rows and bound coefficients by
    `csrc/head_screen.cpp`'s `screen_codes`) for hidden codes in [-`levels`, `levels`] (127 or 63; default
    `code_levels()`), or None when its weights are not finite or (logged) its int8 product (the kernels' for 7-bit
    codes where built, else oneDNN's) fails the self-check."""
    module = kernel_module()
    int8, scales, a, c = module.screen_codes(weight.contiguous())
    if not bool(torch.isfinite(scales).all()):
        return None
    levels = levels or code_levels()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    if levels <= OWN_PRODUCT_LEVELS and module.has_screen_product():
        panels, sums = module.screen_pack(int8)
        screen = HeadScreen(panels, scales, zero_points, a, c, levels, sums)
    else:
        screen = HeadScreen(torch.ops.onednn.qlinear_prepack(int8, None), scales, zero_points, a, c, levels)
    if not _products_exact(screen, int8):
        logger.warning("contbatch: the int8 product failed the head screen's check; computing full logits")
        return None
    return screen


def _products_exact(screen: HeadScreen, int8: torch.Tensor) -> bool:
    """Whether oneDNN's product of the packed weight gives s_j (q_j . p) to float32 rounding, for the extreme codes
    of the screen's range L (every p = L, every p = -L, alternating) and random ones: int8 products that saturate
    an int16 sum (AVX2's, with codes past 63) or lose the zero point would fail. Checked both into a fresh tensor and
    into a used one, as `head_buffer.buffer` gives (its earlier contents, here 7s, must not remain)."""
    k, top = int8.shape[1], screen.levels
    generator = torch.Generator().manual_seed(0)
    codes = torch.stack([torch.full((k,), top), torch.full((k,), -top), (torch.arange(k) % 2) * 2 * top - top,
                         *torch.randint(-top, top + 1, (CHECK_ROWS - 3, k), generator=generator)])
    exact = _integer_products(codes, int8) * screen.scales.double()
    shifted = (codes + screen.zero_point).to(torch.uint8)
    used = torch.full(exact.shape, 7.0)
    products = (_int8_product(shifted, screen), _int8_product(shifted, screen, used))
    return all(bool(((scaled.double() - exact).abs() <= 4 * _EPS32 * exact.abs() + 1e-30).all()) for scaled in products)


def _integer_products(codes: torch.Tensor, int8: torch.Tensor) -> torch.Tensor:
    """[rows, V] float64: the exact integer products codes . q_j of `codes` [rows, K] and the int8 rows `int8`
    [V, K], both within [-127, 127]. Float32 products over at most `EXACT_K` columns are exact (every partial sum
    is an integer below 2^24, whatever the order), and their sums in float64 too; `int8` is converted a block of
    `CHECK_BLOCK` rows at a time."""
    rows, k = codes.shape
    left = codes.float()
    exact = torch.zeros(rows, int8.shape[0], dtype=torch.float64)
    for start in range(0, int8.shape[0], CHECK_BLOCK):
        block = int8[start:start + CHECK_BLOCK].float()
        for first in range(0, k, EXACT_K):
            columns = slice(first, first + EXACT_K)
            exact[:, start:start + CHECK_BLOCK] += left[:, columns] @ block[:, columns].T
    return exact


def plain_greedy(targets: Sequence[SamplingTarget]) -> bool:
    """Whether every target takes the argmax of its raw logits and reports nothing else (no sampling, beams,
    processors, logprobs or grammar): the steps the screen may serve."""
    return all(not t.params.do_sample and t.params.num_beams == 1 and not t.params.logprobs
               and not t.params.top_logprobs and not t.params.uses_processors and t.matcher is None
               for t in targets)


def screened_forward(forward: Callable[[], torch.Tensor], rows: int,
                     head_is_final: bool | None) -> tuple[torch.Tensor, torch.Tensor | None, bool | None]:
    """Runs `forward` (returning [>= rows, vocab] logits) of a plain greedy step. `head_is_final`: whether the
    model returns the head's output as its logits (None: not known yet). Returns (logits, tokens, head_is_final):
    where it is known True, the step asks for the screen, and tokens [rows] come back when the screen served it,
    the logits then being its placeholder (never to be read); else the logits are real, from a forward that only
    notes what the head returned (which settles `head_is_final`), or from a second forward without the screen
    when a screened row was not finite."""
    with screen_request(screen=head_is_final is True) as request:
        logits = forward()
    output = request.head_output
    if output is None or output.numel() == 0:  # empty tensors share no storage to compare
        return logits, None, head_is_final
    final = (logits.data_ptr() == output.data_ptr() and logits.dtype == output.dtype
             and logits.shape[-1] == output.shape[-1] and logits.stride()[-2:] == output.stride()[-2:])
    tokens = request.tokens
    if tokens is None:
        return logits, None, final
    if final and len(tokens) >= rows and bool((tokens[:rows] >= 0).all()):
        return logits, tokens[:rows], True
    return forward(), None, final
