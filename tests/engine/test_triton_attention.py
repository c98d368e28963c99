"""The Triton paged attention kernel (`triton_attention`), run by Triton's interpreter on the CPU: the same contract
and the same float64 reference as the C++ kernel's tests, and greedy parity with `generate` through the engine
when `CONTBATCH_ATTENTION_KERNEL=triton` selects it. On a GPU (`CONTBATCH_TEST_DEVICE=cuda`) the same tests run
the compiled kernel."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from contbatch.engine import attention, triton_attention
from tests.engine.test_decode_kernel import reference
from tests.helpers import TEST_DEVICE, make_engine, random_prompts, reference_generate, run_engine, tiny_model

BLOCK = 16

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="Triton is not installed")


@pytest.fixture(autouse=True)
def triton_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel asked for (on a CPU, `tests/conftest.py` has Triton interpret)."""
    monkeypatch.setenv(triton_attention.KERNEL_ENV, "triton")


def _cache(kv_heads: int, dim: int, num_blocks: int, dtype: torch.dtype,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.randn(kv_heads, num_blocks * BLOCK, dim, generator=generator) * 2
    values = torch.randn(kv_heads, num_blocks * BLOCK, dim, generator=generator)
    return keys.to(dtype), values.to(dtype)


def _run(*args: object) -> torch.Tensor:
    moved = [arg.to(TEST_DEVICE) if isinstance(arg, torch.Tensor) else arg for arg in args]
    return triton_attention.paged_attention(*moved).cpu()  # type: ignore[arg-type]


@pytest.mark.parametrize(("kv_heads", "group", "dim", "softcap"), [
    (3, 3, 64, 0.0),   # SmolLM2's shape
    (2, 1, 128, 0.0),  # no grouping; a head wider than the key tile
    (1, 8, 32, 30.0),  # soft-capped logits (Gemma 2)
    (2, 2, 12, 0.0),   # head_dim below the product's minimum width, not a power of 2
    (1, 5, 40, 0.0),   # a group that is not a power of 2
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_kernel_matches_reference(kv_heads: int, group: int, dim: int, softcap: float, dtype: torch.dtype,
                                  with_sinks: bool) -> None:
    """Decode rows of several lengths, windows starting past 0, a context over several key tiles: float32
    within float32 rounding of the float64 result; bfloat16 within one bfloat16 rounding. With attention sinks
    (gpt-oss) too."""
    generator = torch.Generator().manual_seed(kv_heads * 100 + dim)
    lengths = torch.tensor([1, 7, 8, 9, 16, 17, 40, 203])
    width = int(lengths.max())
    keys, values = _cache(kv_heads, dim, 64, dtype, generator)
    positions = torch.arange(width)
    tables = torch.randint(0, 64, (len(lengths), -(-width // BLOCK)), generator=generator)
    slots = (tables[:, positions // BLOCK] * BLOCK + positions % BLOCK).contiguous()
    first = torch.tensor([0, 0, 3, 0, 9, 1, 0, 150])
    query = torch.randn(len(lengths), kv_heads * group, dim, generator=generator).to(dtype)
    sinks = (torch.randn(kv_heads * group, generator=generator) * 6).float() if with_sinks else None
    got = _run(query, keys, values, slots, lengths, first, dim**-0.5, softcap, 1, None, sinks)
    expected = reference(query, keys, values, slots, lengths, first, dim**-0.5, softcap, sinks=sinks)
    assert got.dtype == dtype and got.shape == query.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("group", "window"), [(3, 0), (4, 5)])
def test_kernel_attends_prefill_rows_causally(group: int, window: int) -> None:
    """Chunks of query rows per request: row i of a chunk starting at s reads positions up to s + i (from
    s + i - window + 1 with a window)."""
    generator = torch.Generator().manual_seed(group + window)
    kv_heads, dim, chunk = 2, 32, 21
    starts = torch.tensor([0, 5, 70])
    width = int(starts.max()) + chunk
    keys, values = _cache(kv_heads, dim, 40, torch.float32, generator)
    tables = torch.stack([torch.randperm(40, generator=generator)[: -(-width // BLOCK)] for _ in starts])
    positions = torch.arange(width)
    slots = (tables[:, positions // BLOCK] * BLOCK + positions % BLOCK).contiguous()
    lengths = (starts.unsqueeze(1) + torch.arange(chunk) + 1).reshape(-1)
    first = (lengths - window).clamp(min=0) if window else torch.zeros_like(lengths)
    query = torch.randn(len(lengths), kv_heads * group, dim, generator=generator)
    got = _run(query, keys, values, slots, lengths, first, dim**-0.5, 0.0, chunk)
    expected = reference(query, keys, values, slots, lengths, first, dim**-0.5, 0.0, chunk)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_attends_a_ragged_batch(dtype: torch.dtype) -> None:
    """Rows naming their request (`row_requests`): requests' rows in any order and number, each row over its
    own range of its request's slots; a row with an empty range (padding) gets zeros."""
    generator = torch.Generator().manual_seed(11)
    kv_heads, group, dim = 3, 3, 64
    keys, values = _cache(kv_heads, dim, 48, dtype, generator)
    tables = torch.stack([torch.randperm(48, generator=generator)[:8] for _ in range(4)])
    positions = torch.arange(8 * BLOCK)
    slots = (tables[:, positions // BLOCK] * BLOCK + positions % BLOCK).contiguous()
    row_requests = torch.tensor([2, 0, 0, 0, 3, 1, 2, 2, 0])
    lengths = torch.tensor([90, 1, 2, 3, 128, 40, 91, 92, 1])
    first = torch.tensor([0, 0, 0, 0, 100, 0, 10, 0, 1])  # the last row's range is empty
    query = torch.randn(len(lengths), kv_heads * group, dim, generator=generator).to(dtype)
    got = _run(query, keys, values, slots, lengths, first, dim**-0.5, 0.0, 1, row_requests)
    expected = reference(query[:-1], keys, values, slots[row_requests[:-1]], lengths[:-1], first[:-1],
                         dim**-0.5, 0.0)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got[:-1].double(), expected, rtol=tolerance, atol=tolerance)
    assert not got[-1].any()


def test_kernel_refuses_slots_for_another_number_of_rows() -> None:
    keys = torch.zeros(1, 64, 16)
    with pytest.raises(ValueError, match=r"slots \(2, 8\) for 6 query rows, 4 per request"):
        triton_attention.paged_attention(torch.zeros(6, 2, 16), keys, keys, torch.zeros(2, 8, dtype=torch.long),
                                         torch.ones(6, dtype=torch.long), torch.zeros(6, dtype=torch.long),
                                         0.25, 0.0, 4)


def test_attention_selects_the_kernel_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert triton_attention.usable_on(TEST_DEVICE)
    monkeypatch.setenv(triton_attention.KERNEL_ENV, "")
    assert not triton_attention.usable_on(TEST_DEVICE)


@pytest.mark.parametrize("model_name", ["llama", "gemma3-hybrid", "gemma2-softcap"])
def test_engine_with_the_kernel_matches_generate(model_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy parity through the engine with every attention call in the kernel (chunked prefill in ragged
    groups, decode, a sliding window and soft-capped logits), and no call left to the other paths."""
    calls: list[bool] = []
    kernel = triton_attention.paged_attention

    def counted(*args: object) -> torch.Tensor:
        calls.append(len(args) == 10)  # a ragged group passes its rows' requests
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "triton_paged_attention", counted)
    monkeypatch.setattr(attention, "paged_decode_kernel", lambda: pytest.fail("the C++ kernel was called"))
    model = tiny_model(model_name)
    prompts, max_new = random_prompts([3, 11, 20], seed=9), [6, 4, 5]
    with make_engine(model, block_size=4, num_blocks=64, max_batch_tokens=16) as engine:
        for index, (prompt, count) in enumerate(zip(prompts, max_new, strict=True)):
            engine.add_request(prompt, request_id=f"r{index}", max_new_tokens=count)
        finished = run_engine(engine)
    assert any(calls) and not all(calls)
    for index, (prompt, count) in enumerate(zip(prompts, max_new, strict=True)):
        assert finished[f"r{index}"].generated_tokens == reference_generate(model, prompt, count), f"r{index}"


class _RecordedLaunch:
    """Stands in for the jitted kernel: records the grid, arguments and compile-time constants of a launch."""

    def __init__(self) -> None:
        self.args: tuple[object, ...] = ()
        self.constants: dict[str, object] = {}

    def __getitem__(self, grid: tuple[int, int]) -> _RecordedLaunch:
        return self

    def __call__(self, *args: object, **constants: object) -> None:
        self.args, self.constants = args, constants


def _triton_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                      torch.int64: "i64"}[value.dtype]
    return "fp32" if isinstance(value, float) else "i32"


_COMPILE_FOR_CUDA = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from contbatch.engine import triton_kernels
kernel = triton.jit(triton_kernels.paged_attention_kernel)
for signature, constants, capability in json.loads(sys.stdin.read()):
    compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", capability, 32))
    print(capability, len(compiled.asm["cubin"]), ".entry paged_attention_kernel" in compiled.asm["ptx"])
"""


def _recorded_launch(dtype: torch.dtype, ragged: bool, softcap: float,
                     monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, str], dict[str, object]]:
    """The Triton signature and constants of the launch `paged_attention` makes for these inputs."""
    from contbatch.engine import triton_kernels

    recorded = _RecordedLaunch()
    monkeypatch.setattr(triton_attention, "_kernel", lambda interpret: recorded)
    keys = torch.zeros(3, 4 * BLOCK, 64, dtype=dtype)
    rows = 5 if ragged else 2
    triton_attention.paged_attention(torch.zeros(rows, 9, 64, dtype=dtype), keys, keys,
                                     torch.zeros(2, 4 * BLOCK, dtype=torch.long), torch.ones(rows, dtype=torch.long),
                                     torch.zeros(rows, dtype=torch.long), 0.125, softcap, 1,
                                     torch.tensor([0, 1, 1, 0, 1]) if ragged else None)
    names = list(inspect.signature(triton_kernels.paged_attention_kernel).parameters)
    signature = {name: _triton_type(value) for name, value in zip(names, recorded.args, strict=False)}
    signature.update(dict.fromkeys(recorded.constants, "constexpr"))
    assert list(signature) == names
    return signature, recorded.constants


def test_kernel_compiles_for_cuda_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launches `paged_attention` makes (float32 decode rows; bfloat16 ragged rows with soft-capping),
    compiled ahead of time by Triton's CUDA backend down to a cubin (PTX, then ptxas: no GPU or driver needed)
    for sm_90 (H100, H200) and sm_80 (A100). The interpreter runs the kernel as Python; this checks that Triton
    lowers it with the argument types and constants a real step passes. In a process of its own: the suite's
    interpreter mode (`TRITON_INTERPRET`) would replace the compiler's language layer."""
    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("Triton has no CUDA backend here")
    launches = []
    for dtype, ragged, softcap, capability in [(torch.float32, False, 0.0, 90), (torch.bfloat16, True, 30.0, 80)]:
        signature, constants = _recorded_launch(dtype, ragged, softcap, monkeypatch)
        assert constants["RAGGED"] is ragged and constants["IEEE"] is (dtype == torch.float32)
        launches.append((signature, constants, capability))
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_CUDA], input=json.dumps(launches), env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [line.split() for line in done.stdout.splitlines()]
    assert [(int(capability), bool(int(size)) and entry == "True") for capability, size, entry in results] == [
        (90, True), (80, True)]
