"""The CPU kernels: paged attention (decode and prefill rows) against attention computed with plain torch ops on
gathered K/V, and the K/V row write against `index_copy_`."""

from __future__ import annotations

import pytest
import torch

from contbatch.engine import cpu_features
from contbatch.engine.cpu_kernels import greedy_tokens, kernel_module, kv_row_writer, paged_decode_kernel, target_arch
from contbatch.engine.kv_cache import KVCacheSpec, PagedKVCache

BLOCK = 16


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
              lengths: torch.Tensor, first: torch.Tensor, scale: float, softcap: float,
              queries_per_request: int = 1, sinks: torch.Tensor | None = None,
              weights: torch.dtype | None = None) -> torch.Tensor:
    """[R, H, D] attention of each query row r over positions first[r]..lengths[r]-1 of its request's slots
    (request r // queries_per_request), in float64; with `sinks` [H], each head's sink logit joins its softmax
    and its probability is dropped (gpt-oss); with `weights`, each exp(logit - the largest) is rounded to that
    dtype before it weighs the value rows, and the sum is divided by the softmax's denominator after (the order of
    the AMX kernel's value pass)."""
    batch, heads, _ = query.shape
    group = heads // keys.shape[0]
    out = torch.empty(query.shape, dtype=torch.float64)
    for b in range(batch):
        rows = slots[b // queries_per_request, int(first[b]):int(lengths[b])]
        k = keys[:, rows].double().repeat_interleave(group, 0)
        v = values[:, rows].double().repeat_interleave(group, 0)
        logits = torch.einsum("hd,hnd->hn", query[b].double(), k) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if sinks is not None:
            logits = torch.cat([logits, sinks.double()[:, None]], dim=-1)
        if weights is None:
            out[b] = torch.einsum("hn,hnd->hd", logits.softmax(-1)[:, :rows.numel()], v)
            continue
        exps = (logits - logits.max(-1, keepdim=True).values).exp()
        rounded = exps[:, :rows.numel()].to(weights).double()
        out[b] = torch.einsum("hn,hnd->hd", rounded, v) / exps.sum(-1, keepdim=True)
    return out


def weights_dtype(dtype: torch.dtype, group: int, dim: int) -> torch.dtype | None:
    """The dtype the kernel rounds exp(logit - the largest) to before it weighs the value rows: bfloat16 where a
    bfloat16 cache's value pass runs AMX tiles (attention_values.h: at most 16 query heads a kv head, head_dim a
    multiple of 32 and at most 64), none (float32) elsewhere."""
    module = kernel_module()
    tiles = module is not None and module.attention_bfloat16_scores() == "tiles"
    return torch.bfloat16 if dtype == torch.bfloat16 and tiles and group <= 16 and dim in (32, 64) else None


@pytest.mark.parametrize(("kv_heads", "group", "dim", "softcap"), [
    (3, 3, 64, 0.0),   # SmolLM2's shape: the vectorised path (16 lanes where the CPU has AVX-512, else 8)
    (2, 1, 128, 0.0),
    (1, 8, 32, 30.0),  # soft-capped logits (Gemma 2); with 16 lanes, scores of 3 + 3 + 2 heads per key pass
    (2, 2, 12, 0.0),   # head_dim not a multiple of 8: the scalar path
    (1, 5, 40, 0.0),   # 8 lanes only; query heads in register groups of 4 then 1; columns 2 vectors then 1
    (2, 2, 24, 0.0),   # 8 lanes only; columns 4 vectors at a time then 1 at a time
    (1, 7, 80, 0.0),   # with 16 lanes: scores of 3 + 3 + 1 heads, columns 4 vectors then 1
    (2, 4, 96, 0.0),   # bfloat16 pairs: three registers a row; AMX tiles: three tiles of key rows a score
    (1, 17, 32, 0.0),  # more query heads than an AMX tile of scores holds (16): bfloat16 pairs for every score
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_kernel_matches_reference(kv_heads: int, group: int, dim: int, softcap: float, dtype: torch.dtype,
                                  with_sinks: bool) -> None:
    """float32 within float32 rounding of the float64 result; bfloat16 (cache, query and output; float32
    arithmetic inside, the value rows' weights rounded to bfloat16 where the value pass runs AMX tiles) within one
    bfloat16 rounding of the float64 result on the same bfloat16 values (and weights). With
    sinks, some far above a row's logits (the row's output then near 0) and some far below."""
    kernel = paged_decode_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(kv_heads * 100 + dim)
    lengths = torch.tensor([1, 7, 8, 9, 16, 17, 40, 203])
    width = int(lengths.max())
    num_blocks = 64
    keys = torch.randn(kv_heads, num_blocks * BLOCK, dim, generator=generator) * 2
    values = torch.randn(kv_heads, num_blocks * BLOCK, dim, generator=generator)
    positions = torch.arange(width)
    tables = torch.randint(0, num_blocks, (len(lengths), -(-width // BLOCK)), generator=generator)
    slots = (tables[:, positions // BLOCK] * BLOCK + positions % BLOCK).contiguous()
    first = torch.tensor([0, 0, 3, 0, 9, 1, 0, 150])  # sliding windows start past 0
    query = torch.randn(len(lengths), kv_heads * group, dim, generator=generator)
    scale = dim**-0.5
    query, keys, values = query.to(dtype), keys.to(dtype), values.to(dtype)
    sinks = (torch.randn(kv_heads * group, generator=generator) * 6).float() if with_sinks else None
    got = kernel(query, keys, values, slots, lengths, first, scale, softcap, 1, sinks=sinks)
    expected = reference(query, keys, values, slots, lengths, first, scale, softcap, sinks=sinks,
                         weights=weights_dtype(dtype, group, dim))
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_query_rows_and_heads_at_any_stride(dtype: torch.dtype) -> None:
    """A query laid out [heads, rows, dim] (the model's layout) and read through a transposed view gives the result
    of its contiguous copy, bit for bit, in the query's dtype."""
    kernel = paged_decode_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 64 * BLOCK, 64, generator=generator).to(dtype)
    values = torch.randn(3, 64 * BLOCK, 64, generator=generator).to(dtype)
    slots = torch.randperm(64 * BLOCK, generator=generator)[: 5 * 40].view(5, 40)
    lengths, first = torch.tensor([1, 16, 17, 33, 40]), torch.zeros(5, dtype=torch.long)
    query = torch.randn(9, 5, 64, generator=generator).to(dtype).transpose(0, 1)
    assert not query.is_contiguous()
    got = kernel(query, keys, values, slots, lengths, first, 0.125, 0.0, 1)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, kernel(query.contiguous(), keys, values, slots, lengths, first, 0.125, 0.0, 1))


def test_bfloat16_scores_take_the_widest_path_of_the_build() -> None:
    """AMX tiles where the build targets this CPU and it has AMX, bfloat16 pairs where it has AVX512-BF16 only,
    float32 lanes in a build for AVX2 or AVX-512 without BF16, scalar code below that."""
    module = kernel_module()
    assert module is not None
    flags = set(cpu_features.cpuinfo_line(("flags",)).split())
    arch = target_arch()
    if arch == "native":
        expected = "tiles" if cpu_features.cpu_has_amx() else "pairs" if "avx512_bf16" in flags else "lanes"
    else:
        expected = {"x86-64-v4": "lanes", "x86-64-v3": "lanes", "x86-64": "scalar"}.get(arch)
    if expected is None or not {"avx2", "fma"} <= flags:
        pytest.skip(f"no expectation for -march={arch} on this CPU")
    assert module.attention_bfloat16_scores() == expected


@pytest.mark.parametrize(("kv_heads", "group", "dim", "window"), [(3, 3, 64, 0), (2, 2, 24, 0), (1, 4, 32, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_attends_prefill_rows_causally(kv_heads: int, group: int, dim: int, window: int,
                                             dtype: torch.dtype) -> None:
    """Chunks of query rows per request (`queries_per_request`), row i of a chunk starting at position s reading
    positions up to s + i (from s + i - window + 1 with a window): each row as attention over exactly its keys.
    One long chunk beside short ones: the threads' split by work must still cover every row once."""
    kernel = paged_decode_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(dim + window)
    starts, chunk = torch.tensor([0, 5, 90]), 37
    num_blocks = 40
    width = int(starts.max()) + chunk
    keys = (torch.randn(kv_heads, num_blocks * BLOCK, dim, generator=generator) * 2).to(dtype)
    values = torch.randn(kv_heads, num_blocks * BLOCK, dim, generator=generator).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[: -(-width // BLOCK)] for _ in starts])
    positions = torch.arange(width)
    slots = (tables[:, positions // BLOCK] * BLOCK + positions % BLOCK).contiguous()
    lengths = (starts.unsqueeze(1) + torch.arange(chunk) + 1).reshape(-1)
    first = (lengths - window).clamp(min=0) if window else torch.zeros_like(lengths)
    query = torch.randn(len(lengths), kv_heads * group, dim, generator=generator).to(dtype)
    got = kernel(query, keys, values, slots, lengths, first, dim**-0.5, 0.0, chunk)
    expected = reference(query, keys, values, slots, lengths, first, dim**-0.5, 0.0, chunk,
                         weights=weights_dtype(dtype, group, dim))
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(3, 3, 64), (2, 2, 24), (2, 2, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_attends_a_ragged_batch(kv_heads: int, group: int, dim: int, dtype: torch.dtype) -> None:
    """Rows naming their request (`row_requests`): rows of any request in any order and number, each over its own
    range of its request's slots (a decode row, a prefill chunk's causal rows, a window), as the reference reads
    them with each row's request's slots; bitwise what the same rows give one request at a time."""
    kernel = paged_decode_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(dim)
    keys = (torch.randn(kv_heads, 48 * BLOCK, dim, generator=generator) * 2).to(dtype)
    values = torch.randn(kv_heads, 48 * BLOCK, dim, generator=generator).to(dtype)
    tables = torch.stack([torch.randperm(48, generator=generator)[:8] for _ in range(4)])
    positions = torch.arange(8 * BLOCK)
    slots = (tables[:, positions // BLOCK] * BLOCK + positions % BLOCK).contiguous()
    row_requests = torch.tensor([2, 0, 0, 0, 3, 1, 2, 2])
    lengths = torch.tensor([90, 1, 2, 3, 128, 40, 91, 92])
    first = torch.tensor([0, 0, 0, 0, 100, 0, 10, 0])
    query = torch.randn(len(lengths), kv_heads * group, dim, generator=generator).to(dtype)
    got = kernel(query, keys, values, slots, lengths, first, dim**-0.5, 0.0, 1, row_requests)
    expected = reference(query, keys, values, slots[row_requests], lengths, first, dim**-0.5, 0.0,
                         weights=weights_dtype(dtype, group, dim))
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    alone = [kernel(query[r:r + 1], keys, values, slots[int(row_requests[r])][None].contiguous(), lengths[r:r + 1],
                    first[r:r + 1], dim**-0.5, 0.0, 1) for r in range(len(lengths))]
    assert torch.equal(got, torch.cat(alone))
    with pytest.raises(RuntimeError, match="row 0 names request 4 of 4"):
        kernel(query, keys, values, slots, lengths, first, dim**-0.5, 0.0, 1, row_requests + 2 * (row_requests > 1))


@pytest.mark.parametrize(("group", "dim"), [(3, 64), (2, 24), (4, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_runs_of_a_requests_rows_equal_each_row_alone(group: int, dim: int, dtype: torch.dtype) -> None:
    """Consecutive rows of one request with one first position are attended as runs of up to 16 rows
    (`attention_runs.h`): 37 causal rows (runs of 16, 16 and 5), rows of another request between, rows whose
    first positions differ (a window: runs of one) and rows of one first position in no order of length. Each
    row's output is bitwise that row alone, and the reference's within the dtype's tolerance."""
    kernel = paged_decode_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(group * dim)
    keys = (torch.randn(2, 40 * BLOCK, dim, generator=generator) * 2).to(dtype)
    values = torch.randn(2, 40 * BLOCK, dim, generator=generator).to(dtype)
    slots = (torch.randperm(40, generator=generator)[:36].view(3, 12, 1) * BLOCK + torch.arange(BLOCK)).view(3, -1)
    causal = torch.arange(150, 187)
    lengths = torch.cat([causal, torch.tensor([9, 190]), torch.arange(60, 66), torch.tensor([33, 170, 2, 99])])
    row_requests = torch.cat([torch.zeros(37, dtype=torch.long), torch.tensor([1, 1]), torch.full((6,), 2),
                              torch.full((4,), 2)])
    first = torch.cat([torch.zeros(39, dtype=torch.long), torch.arange(6) + 20, torch.zeros(4, dtype=torch.long)])
    query = torch.randn(len(lengths), 2 * group, dim, generator=generator).to(dtype)
    got = kernel(query, keys, values, slots.contiguous(), lengths, first, dim**-0.5, 0.0, 1, row_requests)
    alone = [kernel(query[r:r + 1], keys, values, slots[int(row_requests[r])][None].contiguous(), lengths[r:r + 1],
                    first[r:r + 1], dim**-0.5, 0.0, 1) for r in range(len(lengths))]
    assert torch.equal(got, torch.cat(alone))
    expected = reference(query, keys, values, slots[row_requests], lengths, first, dim**-0.5, 0.0,
                         weights=weights_dtype(dtype, group, dim))
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_output_does_not_depend_on_the_threads(dtype: torch.dtype) -> None:
    """A step mixing decode rows with a prefill chunk's rows is cut into chunks by cost and the threads take them in
    turn: the outputs are bitwise the same whatever the number of threads, and each row's equals that row alone."""
    kernel = paged_decode_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(7)
    keys = torch.randn(3, 80 * BLOCK, 64, generator=generator).to(dtype)
    values = torch.randn(3, 80 * BLOCK, 64, generator=generator).to(dtype)
    slots = (torch.randperm(80, generator=generator)[:60].view(5, 12, 1) * BLOCK + torch.arange(BLOCK)).view(5, -1)
    chunk = torch.arange(120, 180)
    row_requests = torch.cat([torch.tensor([0, 1, 2, 3]), torch.full((len(chunk),), 4)])
    lengths = torch.cat([torch.tensor([190, 3, 77, 150]), chunk + 1])
    first = torch.zeros_like(lengths)
    query = torch.randn(len(lengths), 9, 64, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append(kernel(query, keys, values, slots.contiguous(), lengths, first, 0.125, 0.0, 1,
                                  row_requests))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    alone = [kernel(query[r:r + 1], keys, values, slots[int(row_requests[r])][None].contiguous(), lengths[r:r + 1],
                    first[r:r + 1], 0.125, 0.0, 1) for r in (0, 3, 4, len(lengths) - 1)]
    assert torch.equal(outputs[0][[0, 3, 4, len(lengths) - 1]], torch.cat(alone))
    expected = reference(query, keys, values, slots[row_requests], lengths, first, 0.125, 0.0,
                         weights=weights_dtype(dtype, 3, 64))
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(outputs[0].double(), expected, rtol=tolerance, atol=tolerance)


def test_kernel_refuses_slots_for_another_number_of_rows() -> None:
    kernel = paged_decode_kernel()
    assert kernel is not None
    keys = torch.zeros(1, 64, 16)
    with pytest.raises(RuntimeError, match="slots for 6 query rows, 4 per request, got 2 rows"):
        kernel(torch.zeros(6, 2, 16), keys, keys, torch.zeros(2, 8, dtype=torch.long), torch.ones(6, dtype=torch.long),
               torch.zeros(6, dtype=torch.long), 0.25, 0.0, 4)


def test_kernel_runs_on_every_torch_thread() -> None:
    """ATen's `parallel_for` is inline under OpenMP: built without `-fopenmp`, the kernel runs on one thread."""
    module = kernel_module()
    assert module is not None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert module.parallel_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("dtype", "dim"), [
    (torch.float32, 64),   # whole 32-byte vectors: non-temporal stores
    (torch.bfloat16, 48),  # 96-byte rows: non-temporal stores
    (torch.float32, 6),    # 24-byte rows: plain copies
])
def test_row_writer_matches_index_copy(dtype: torch.dtype, dim: int) -> None:
    writer = kv_row_writer()
    assert writer is not None
    generator = torch.Generator().manual_seed(dim)
    cache = torch.randn(3, 400, dim, generator=generator).to(dtype)
    expected = cache.clone()
    slots = torch.randperm(400, generator=generator)[:37]
    rows = torch.randn(37, 3, dim, generator=generator).to(dtype).transpose(0, 1)  # as a layer hands them over
    expected.index_copy_(1, slots, rows)
    writer(cache, rows, slots)
    assert torch.equal(cache, expected)


def test_row_writer_refuses_a_slot_outside_the_cache() -> None:
    writer = kv_row_writer()
    assert writer is not None
    cache = torch.zeros(2, 32, 8)
    with pytest.raises(RuntimeError, match="slot 32 is outside the cache's 32"):
        writer(cache, torch.ones(2, 2, 8), torch.tensor([3, 32]))
    assert not cache.any()


def test_cache_write_goes_through_the_row_writer_and_stores_what_index_copy_would() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    cache = PagedKVCache(spec, num_blocks=8, block_size=4, device=torch.device("cpu"))
    assert cache._row_writer is not None
    slots = torch.tensor([5, 0, 17, 30])
    key, value = torch.randn(4, 2, 16).transpose(0, 1), torch.randn(2, 4, 16)
    cache.write(1, slots, key, value)
    assert torch.equal(cache.keys[1][:, slots], key) and torch.equal(cache.values[1][:, slots], value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 7, 31, 32, 33, 1000, 49152])
def test_greedy_tokens_match_torch_argmax(width: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(9, width, generator=generator).to(dtype)  # half precision: many ties after rounding
    logits[1] = 0.5  # a row of ties: the first index
    logits[2, width // 2:] = float("inf")
    logits[3] = float("-inf")
    logits[4, -1] = float("nan")  # NaN counts as the maximum
    logits[5, width // 3] = float("nan")
    logits[5, -1] = float("nan")
    logits[6, 0], logits[6, -1] = -0.0, 0.0
    logits[6, 1:-1] = -1.0
    assert kernel_module() is not None
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits[:, : max(width - 1, 1)]), logits[:, : max(width - 1, 1)].argmax(-1))
