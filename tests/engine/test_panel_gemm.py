"""The panel-packed linear kernel: `F.linear`'s function at every row, column and depth remainder, with and without
bias, each row's result independent of the rest of the batch and of the thread count, and its argument checks; in
float32, and in bfloat16 in both layouts (lines widened to float32, and k pairs through AVX512-BF16 where built)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from contbatch.engine.cpu_kernels import PANEL, pack_panels, pair_panels, panel_gemm

pytestmark = pytest.mark.skipif(panel_gemm() is None, reason="the panel kernel needs AVX2 + FMA and a C++ compiler")
BF16_LAYOUTS = [
    pytest.param(False, id="widened"),
    pytest.param(True, id="pairs", marks=pytest.mark.skipif(not pair_panels(), reason="needs AVX512-BF16")),
]


def test_panels_layout() -> None:
    weight = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    panels = pack_panels(weight)
    assert panels.shape == (2, 3, PANEL) and panels.is_contiguous()
    assert torch.equal(panels[0], weight[:16].T)
    assert torch.equal(panels[1, :, :4], weight[16:].T) and not panels[1, :, 4:].any()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (0, 20, 37), (1, 1, 1), (5, 16, 8), (6, 17, 37), (7, 15, 64), (13, 300, 37), (32, 192, 576), (301, 40, 9),
    (7, 17, 200), (96, 33, 193), (97, 20, 200), (3, 20, 0), (100, 20, 0),
])
def test_same_function_as_f_linear(bias: bool, rows: int, out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    out = panel_gemm()(x, pack_panels(weight), out_features, b)  # type: ignore[misc]
    assert out.shape == (rows, out_features)
    reference = (x.double() @ weight.double().T + (b.double() if b is not None else 0)).float()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4 * in_features ** 0.5)


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(130, 200, generator=generator)
    weight = torch.randn(50, 200, generator=generator)
    panels = pack_panels(weight)
    gemm = panel_gemm()
    whole = gemm(x, panels, 50, None)  # type: ignore[misc]
    for start, stop in ((0, 1), (5, 6), (3, 14), (30, 37), (0, 96), (20, 130)):
        assert torch.equal(gemm(x[start:stop].contiguous(), panels, 50, None), whole[start:stop])  # type: ignore[misc]


def _on_threads(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                counts: tuple[int, ...] = (1, 2)) -> tuple[torch.Tensor, ...]:
    threads = torch.get_num_threads()
    try:
        return tuple(_threaded_product(count, x, panels, out_features) for count in counts)
    finally:
        torch.set_num_threads(threads)


def _threaded_product(count: int, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    torch.set_num_threads(count)
    return panel_gemm()(x, panels, out_features, None)  # type: ignore[misc]


@pytest.mark.parametrize(("rows", "in_features"), [(40, 96), (130, 1536)])
def test_the_result_does_not_depend_on_the_thread_count(rows: int, in_features: int) -> None:
    """Threads take tasks (with AVX-512 two float32 panels, the 18th alone; 1,536 inputs make blocks of 60 rows, so
    130 rows are three blocks) as they come free, in ranges that depend on the thread count: each output is the same
    FMA chain whichever thread computes it."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(18 * PANEL - 3, in_features, generator=generator)
    panels = pack_panels(weight)
    one, *others = _on_threads(x, panels, weight.shape[0], (1, 2, 3, 4))
    assert all(torch.equal(one, other) for other in others)
    torch.testing.assert_close(one, (x.double() @ weight.double().T).float(), rtol=1e-5, atol=1e-4 * in_features ** 0.5)


def test_bad_arguments_are_refused() -> None:
    gemm = panel_gemm()
    panels = pack_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="K of x"):
        gemm(torch.randn(3, 9), panels, 20, None)  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="N does not match"):
        gemm(torch.randn(3, 8), panels, 40, None)  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="contiguous float32"):
        gemm(torch.randn(8, 3).T, panels, 20, None)  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="bias"):
        gemm(torch.randn(3, 8), panels, 20, torch.randn(19))  # type: ignore[misc]


def test_bfloat16_panels_interleave_each_line() -> None:
    weight = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3).to(torch.bfloat16)
    panels = pack_panels(weight, pairs=False)
    assert panels.shape == (2, 3, PANEL) and panels.dtype == torch.bfloat16 and panels.is_contiguous()
    order = [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    assert torch.equal(panels[0], weight[:16].T[:, order])
    padded = torch.cat([weight[16:], weight.new_zeros(12, 3)])
    assert torch.equal(panels[1], padded.T[:, order])


def test_bfloat16_pair_panels_hold_k_in_pairs() -> None:
    """Line j of panel p: features 16p .. 16p + 15, each at k = 2j then 2j + 1; zeros past N and past an odd K."""
    weight = torch.arange(20 * 5, dtype=torch.float32).reshape(20, 5).to(torch.bfloat16)
    panels = pack_panels(weight, pairs=True)
    assert panels.shape == (2, 3, 2 * PANEL) and panels.dtype == torch.bfloat16 and panels.is_contiguous()
    assert pack_panels(weight).shape == (panels.shape if pair_panels() else (2, 5, PANEL))
    padded = torch.zeros(32, 6, dtype=torch.bfloat16)
    padded[:20, :5] = weight
    for p, j, feature, k in ((0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 3, 2), (0, 2, 15, 4), (1, 1, 19, 3), (1, 0, 16, 0)):
        assert panels[p, j, 2 * (feature % PANEL) + k % 2] == padded[feature, k]
    assert not panels[:, 2, 1::2].any() and not panels[1, :, 8:].any()
    assert torch.equal(panels[0].reshape(3, PANEL, 2).permute(1, 0, 2).reshape(PANEL, 6), padded[:16])


@pytest.mark.parametrize("pairs", BF16_LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 1, 1), (6, 17, 37), (13, 300, 37), (32, 192, 576), (97, 20, 200), (301, 40, 9), (3, 20, 0), (9, 49, 130),
])
def test_bfloat16_is_the_float32_product_rounded_once(pairs: bool, bias: bool, rows: int, out_features: int,
                                                      in_features: int) -> None:
    """bfloat16 operands, float32 arithmetic (their products are exact), one rounding to bfloat16 at the end: within
    one bfloat16 rounding of the exact result, and equal to its rounding nearly everywhere."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    b = torch.randn(out_features, generator=generator).to(torch.bfloat16) if bias else None
    out = panel_gemm()(x, pack_panels(weight, pairs), out_features, b)  # type: ignore[misc]
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T + (b.double() if b is not None else 0)
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-5 * max(in_features, 1))
    assert (out == exact.to(torch.bfloat16)).double().mean() >= 0.98


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 5, 3), (7, 17, 37), (32, 200, 576), (301, 40, 576), (200, 100, 1000), (13, 3, 0),
])
def test_bfloat16_outputs_are_the_float32_chains_rounded_as_torch_rounds(bias: bool, rows: int, out_features: int,
                                                                         in_features: int) -> None:
    """Widened bfloat16 lines run the float32 kernel's FMA chains; each task rounds its outputs to bfloat16 itself
    (no float32 [rows, out] result): bit for bit the float32 kernel's result through `.to(torch.bfloat16)`, over
    column tails, several row blocks and a bias."""
    generator = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16) * 3
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    b = torch.randn(out_features, generator=generator).to(torch.bfloat16) if bias else None
    gemm = panel_gemm()
    out = gemm(x, pack_panels(weight, pairs=False), out_features, b)  # type: ignore[misc]
    chains = gemm(x.float(), pack_panels(weight.float()), out_features,  # type: ignore[misc]
                  None if b is None else b.float())
    rounded = chains.to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out.view(torch.int16), rounded.view(torch.int16))


@pytest.mark.parametrize("pairs", BF16_LAYOUTS)
def test_a_bfloat16_rows_result_does_not_depend_on_the_batch(pairs: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(130, 200, generator=generator).to(torch.bfloat16)
    panels = pack_panels(torch.randn(50, 200, generator=generator).to(torch.bfloat16), pairs)
    gemm = panel_gemm()
    whole = gemm(x, panels, 50, None)  # type: ignore[misc]
    for start, stop in ((0, 1), (3, 14), (0, 96), (20, 130), (7, 16), (0, 9)):
        assert torch.equal(gemm(x[start:stop].contiguous(), panels, 50, None), whole[start:stop])  # type: ignore[misc]


@pytest.mark.skipif(not pair_panels(), reason="needs AVX512-BF16")
def test_pair_tiles_do_not_depend_on_the_thread_count() -> None:
    """A task is three pair panels: 20 panels are six tasks of three and one of two, whichever threads take them."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(40, 96, generator=generator).to(torch.bfloat16)
    weight = torch.randn(20 * PANEL - 5, 96, generator=generator).to(torch.bfloat16)
    panels = pack_panels(weight, pairs=True)
    one, *others = _on_threads(x, panels, weight.shape[0], (1, 2, 3))
    assert all(torch.equal(one, other) for other in others)


@pytest.mark.skipif(not pair_panels(), reason="needs AVX512-BF16")
def test_pair_panels_are_bfloat16_only() -> None:
    pairs = pack_panels(torch.randn(20, 8).to(torch.bfloat16), pairs=True)
    with pytest.raises(RuntimeError, match="need bfloat16"):
        panel_gemm()(torch.randn(3, 8), pairs.float(), 20, None)  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="K of x"):
        panel_gemm()(torch.randn(3, 10).to(torch.bfloat16), pairs, 20, None)  # type: ignore[misc]


def test_mixed_dtypes_are_refused() -> None:
    gemm = panel_gemm()
    with pytest.raises(RuntimeError, match="of x's dtype"):
        gemm(torch.randn(3, 8).to(torch.bfloat16), pack_panels(torch.randn(20, 8)), 20, None)  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        gemm(torch.randn(3, 8).half(), pack_panels(torch.randn(20, 8).half()), 20, None)  # type: ignore[misc]


def test_the_product_runs_without_the_gil() -> None:
    """While one thread is inside a long product, another thread runs Python: the kernel releases the GIL (a
    server's event loop, or a trainer beside the engine thread, is not stalled for a whole product). With the GIL
    held, the other thread runs no bytecode from the call's start until the kernel returns (it gets the GIL back
    only then, while the calling thread waits to record the end): none in the window checked here."""
    gemm = panel_gemm()
    assert gemm is not None
    x, weight = torch.randn(8192, 576), torch.randn(3072, 576)
    panels = pack_panels(weight)
    gemm(x[:64], panels, 3072, None)
    span: list[float] = []
    done = threading.Event()

    def product() -> None:
        span.append(time.perf_counter())
        gemm(x, panels, 3072, None)
        span.append(time.perf_counter())
        done.set()

    worker = threading.Thread(target=product)
    stamps: list[float] = []
    worker.start()
    while not done.is_set():
        stamps.append(time.perf_counter())
    worker.join()
    start, end = span
    assert end - start > 0.01, "the product is too short to tell"
    assert any(start + (end - start) / 10 < stamp < start + (end - start) / 2 for stamp in stamps)
