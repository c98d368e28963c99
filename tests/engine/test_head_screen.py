"""The head screen: greedy tokens of a float32 head through an int8 product and float32 logits for the candidates,
equal to the argmax of the float32 logits (of a bfloat16 head, the first argmax of its logits rounded to
bfloat16); and the engine serving only plain greedy steps of models that return the head's output as their
logits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from contbatch.engine import head_buffer, head_screen
from contbatch.engine.cpu_kernels import _cpu_flags, kernel_module
from contbatch.engine.head_screen import build_screen, screen_supported, screen_tokens
from contbatch.engine.packed_weights import packing_applies
from tests.helpers import fresh_tiny_model, make_engine, random_prompts, reference_generate, run_engine, tiny_model

pytestmark = pytest.mark.skipif(not screen_supported(), reason="the head screen needs the kernels and AVX2")
# 7-bit codes run everywhere (AVX2's int8 products); 8-bit ones only where the kernels are built with VNNI.
LEVELS = [63, 127] if head_screen.code_levels() == 127 else [63]


@pytest.fixture
def screened_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the screen's calls: one entry, the number of `screen_tokens` calls so far."""
    calls = [0]
    original = head_screen.screen_tokens

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(head_screen, "screen_tokens", counted)
    yield calls


def _head_and_hidden(vocab: int, k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random head with rows 7 and 11 equal and row 12 within 1e-7 of them, and hidden rows with a few large
    dimensions (as a model's final hidden states have); half the rows point along head row 7."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, k, generator=generator) * 0.1
    weight[11] = weight[7]
    weight[12] = weight[7] + 1e-7 * torch.randn(k, generator=generator)
    hidden = torch.randn(rows, k, generator=generator)
    hidden[:, :3] *= 20
    hidden[: rows // 2] += 30 * weight[7] / weight[7].norm()
    return weight, hidden.contiguous()


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize(("vocab", "k"), [(1000, 64), (1003, 72), (4099, 576)])
def test_tokens_are_the_argmax_of_the_float32_logits(vocab: int, k: int, levels: int) -> None:
    weight, hidden = _head_and_hidden(vocab, k, 64)
    screen = build_screen(weight, levels)
    assert screen is not None
    tokens = screen_tokens(hidden, weight, screen)
    exact = hidden.double() @ weight.double().T
    top2 = exact.topk(2, dim=1)
    clear = top2.values[:, 0] - top2.values[:, 1] > 1e-3
    assert clear.sum() > 10
    assert torch.equal(tokens[clear], exact.argmax(dim=1)[clear])
    assert torch.equal(tokens[clear], (hidden @ weight.T).argmax(dim=1)[clear])
    # rows along head row 7: 7 and 11 tie exactly and 12 is within rounding; the first of the float32 maximum wins
    tied = exact[:, 7] >= exact.amax(dim=1) - 1e-4
    assert tied.sum() > 5
    assert set(tokens[tied].tolist()) <= {7, 12}


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize(("vocab", "k"), [(1003, 72), (4099, 576)])
def test_bfloat16_tokens_are_the_first_argmax_of_the_rounded_logits(vocab: int, k: int, levels: int) -> None:
    """A bfloat16 head: the token is the first largest of the logits rounded to bfloat16, as the head's own product
    gives them. Head row 3 is row 7 scaled down by 0.3%, so for rows along row 7 its float32 logit is smaller but
    often rounds to the same bfloat16 value, and then token 3 (the lower index) wins; rows 7 and 11 tie exactly."""
    weight, hidden = _head_and_hidden(vocab, k, 128)
    weight[3] = weight[7] * (1 - 3e-3)
    weight, hidden = weight.bfloat16(), hidden.bfloat16()
    screen = build_screen(weight, levels)
    assert screen is not None
    tokens = screen_tokens(hidden.float().contiguous(), weight, screen)
    logits = torch.nn.functional.linear(hidden, weight)
    assert torch.equal(tokens, logits.argmax(dim=1))
    wide = hidden.double() @ weight.double().T
    rounded_tie = (tokens == 3) & (wide[:, 3] < wide[:, 7])
    assert rounded_tie.sum() > 3
    assert not bool((tokens == 11).any())  # row 11 ties row 7 exactly: the first wins


def test_bfloat16_ties_made_by_rounding_go_to_the_first_token() -> None:
    """Integer weights and hidden rows on the int8 grid, so the quantisation is exact and the screen's bound far
    narrower than a bfloat16 step; head rows 500-999 are small perturbations of one row, along which the hidden rows
    point, so their distinct exact logits often round to the same bfloat16 value. The token must be the first of the
    rounded maximum (what the head's own product and argmax give), not the exact maximum."""
    generator = torch.Generator().manual_seed(1)
    k = 64
    weight = torch.randint(-127, 128, (2000, k), generator=generator).float()
    weight[torch.arange(2000), torch.randint(0, k, (2000,), generator=generator)] = 127.0
    family = weight[500].clone()
    top = int(family.abs().argmax())
    weight[500:1000] = (family + torch.randint(-2, 3, (500, k), generator=generator)).clamp(-127, 127)
    weight[500:1000, top] = family[top]
    hidden = (family + torch.randint(-20, 21, (96, k), generator=generator)).clamp(-127, 127)
    hidden[:, top] = 127.0
    weight, hidden = (weight / 128).bfloat16(), hidden.bfloat16()
    screen = build_screen(weight)
    assert screen is not None
    tokens = screen_tokens(hidden.float().contiguous(), weight, screen)
    assert torch.equal(tokens, torch.nn.functional.linear(hidden, weight).argmax(dim=1))
    exact = hidden.double() @ weight.double().T
    assert (exact.gather(1, tokens[:, None]).squeeze(1) < exact.amax(dim=1)).sum() > 48


def _reference_codes(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`screen_codes` in float64 tensor operations: (codes, scales, a, c) before rounding a and c to float32."""
    wide = weight.double()
    scales = (wide.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    down = scales.float()
    scales = torch.where(down.double() >= scales, down, torch.nextafter(down, torch.full_like(down, float("inf"))))
    codes = torch.round(wide / scales.double()[:, None]).clamp(-127, 127)
    residual = wide - scales.double()[:, None] * codes
    gamma = weight.shape[1] * 2.0**-24 / (1 - weight.shape[1] * 2.0**-24)
    a = scales.double() * codes.norm(dim=1)
    c = residual.norm(dim=1) + gamma * wide.norm(dim=1)
    return codes.to(torch.int8), scales, a, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_head_and_its_bound_coefficients(dtype: torch.dtype) -> None:
    """The kernel's codes and scales are the float64 reference's exactly; its a and c are at least the reference's
    (the bound stays rigorous) and within a millionth of them. A row with an infinity or a NaN has a NaN scale."""
    weight, _ = _head_and_hidden(1003, 72, 4)
    weight[5] = 0.0
    weight = weight.to(dtype)
    codes, scales, a, c = kernel_module().screen_codes(weight)
    reference = _reference_codes(weight)
    assert torch.equal(codes, reference[0]) and torch.equal(scales, reference[1])
    for value, exact in ((a, reference[2]), (c, reference[3])):
        assert bool((value.double() >= exact).all()) and bool((value.double() <= exact * (1 + 1e-6) + 1e-30).all())
    weight[9, 3], weight[20, 0] = float("inf"), float("nan")
    scales = kernel_module().screen_codes(weight)[1]
    assert (~torch.isfinite(scales)).nonzero().squeeze(1).tolist() == [9, 20]
    assert build_screen(weight) is None


@pytest.mark.parametrize("levels", [63, 127])
def test_hidden_rows_take_codes_of_the_screens_range(levels: int) -> None:
    """`screen_quantize`: codes p + L + 1 with p = round(h / t) in [-L, L], t = max |h| / L, and the residual's and
    the row's norms rounded up; a code range other than 127 or 63 is refused by name."""
    _, hidden = _head_and_hidden(16, 72, 8)
    codes, stats = kernel_module().screen_quantize(hidden, levels)
    t = hidden.double().abs().amax(dim=1) / levels
    p = torch.round(hidden.double() / t[:, None])
    assert torch.equal(codes.long(), p.long() + levels + 1)
    assert int(codes.max()) == 2 * levels + 1 and int(codes.min()) >= 1
    residual = (hidden.double() - t[:, None] * p).norm(dim=1)
    assert torch.allclose(stats[:, 0].double(), t) and bool((stats[:, 1].double() >= residual).all())
    assert bool((stats[:, 2].double() >= hidden.double().norm(dim=1)).all())
    with pytest.raises(RuntimeError, match="must be 127 or 63, got 100"):
        kernel_module().screen_quantize(hidden, 100)


@pytest.mark.skipif(bool({"avx512_vnni", "avx_vnni"} & set(_cpu_flags().partition(":")[2].split())),
                    reason="the CPU has VNNI: oneDNN's int8 products accumulate in int32 whatever the kernels' build")
def test_without_vnni_8_bit_codes_fail_the_self_check_and_7_bit_ones_pass() -> None:
    """On a CPU without VNNI, whose int8 products (AVX2's) sum pairs in int16, a head of equal weights (every code
    127) saturates that sum with 8-bit hidden codes, which the self-check catches; with 7-bit codes (the default
    where the kernels lack VNNI) it is exact."""
    weight = torch.full((256, 64), 0.5)
    weight[1::2] = -0.5
    assert build_screen(weight, 127) is None
    screen = build_screen(weight)
    assert screen is not None and screen.levels == 63


@pytest.mark.skipif(kernel_module() is None or not kernel_module().has_screen_product(),
                    reason="screen_product needs the kernels and AVX2")
@pytest.mark.parametrize(("vocab", "k"), [(1003, 72), (4099, 575)])
def test_the_kernels_int8_product_is_onednns_bit_for_bit(vocab: int, k: int) -> None:
    """`screen_product` over `screen_pack`'s panels (a vocabulary and a k that are not whole panels and quads) gives
    oneDNN's s_j (c . q_j) bit for bit, for 1 to 9 rows (whole tiles of 4 and remainders) of random and extreme
    7-bit codes; a screen of 7-bit codes holds its panels, one of 8-bit codes oneDNN's layout."""
    weight, _ = _head_and_hidden(vocab, k, 4)
    module = kernel_module()
    int8, scales = module.screen_codes(weight)[:2]
    panels, sums = module.screen_pack(int8)
    assert panels.shape == (-(-vocab // 16), -(-k // 4), 64)
    assert torch.equal(sums[:vocab], int8.sum(1, dtype=torch.int32)) and not bool(sums[vocab:].any())
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(-63, 64, (9, k), generator=generator)
    codes[0], codes[1], codes[2] = 63, -63, (torch.arange(k) % 2) * 126 - 63
    shifted = (codes + 64).to(torch.uint8)
    reference = torch.ops.onednn.qlinear_pointwise(shifted, 1.0, 64, torch.ops.onednn.qlinear_prepack(int8, None),
                                                   scales, torch.zeros(vocab, dtype=torch.long), None, 1.0, 0,
                                                   torch.float32, "none", [], "")
    for rows in (1, 4, 5, 9):
        out = torch.full((rows, vocab), 7.0)
        module.screen_product(shifted[:rows].contiguous(), panels, sums, scales, 64, out)
        assert torch.equal(out, reference[:rows])
    assert build_screen(weight, 63).sums is not None  # type: ignore[union-attr]
    assert build_screen(weight, 127) is None or build_screen(weight, 127).sums is None  # type: ignore[union-attr]


def test_a_large_product_goes_into_the_threads_reused_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above `REUSED_OUTPUT_BYTES` the int8 product is computed into the thread's buffer (`head_buffer`), reused by
    later products of any size up to it, and the tokens are those of a fresh product: nothing of an earlier
    product remains."""
    weight, hidden = _head_and_hidden(1003, 72, 64)
    screen = build_screen(weight)
    assert screen is not None
    batches = (hidden, hidden[:20].contiguous(), hidden[40:])
    fresh = [screen_tokens(rows, weight, screen) for rows in batches]
    monkeypatch.setattr(head_buffer, "REUSED_OUTPUT_BYTES", 1003 * 4 * 8)  # more than 8 rows' product
    storages = []
    for rows, expected in zip(batches, fresh, strict=True):
        assert torch.equal(screen_tokens(rows, weight, screen), expected)
        storages.append(head_buffer._local.storages["head"])
    assert storages[0] is storages[1] is storages[2] and storages[0].numel() == 64 * 1003 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_token_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    """The candidates' logits are computed by token, one head row against up to four hidden rows at once, each in
    the order one row alone is summed in: every row's token equals the one it gets alone, in batches of 2 to 64 rows
    (tails of 1-3 rows) whose candidates overlap (half the rows point along head row 7, which rows 11 and 12 tie
    within float32 rounding) and with k = 72 (a scalar tail after the vector chains)."""
    weight, hidden = _head_and_hidden(1003, 72, 64)
    weight, hidden = weight.to(dtype), hidden.to(dtype).float()
    hidden = hidden[torch.randperm(64, generator=torch.Generator().manual_seed(3))].contiguous()
    screen = build_screen(weight)
    assert screen is not None
    alone = torch.cat([screen_tokens(hidden[i:i + 1].contiguous(), weight, screen) for i in range(64)])
    assert len(set(alone.tolist()) & {7, 11, 12}) >= 1 and len(set(alone.tolist())) > 10
    for rows in (2, 3, 5, 9, 64):
        assert torch.equal(screen_tokens(hidden[:rows].contiguous(), weight, screen), alone[:rows])


def test_a_row_that_is_not_finite_gets_no_token() -> None:
    weight, hidden = _head_and_hidden(512, 64, 4)
    hidden[1, 5] = float("nan")
    hidden[2, 0] = float("inf")
    screen = build_screen(weight)
    assert screen is not None
    tokens = screen_tokens(hidden, weight, screen)
    assert tokens[1] == tokens[2] == -1
    assert tokens[0] == (hidden[0] @ weight.T).argmax() and tokens[3] == (hidden[3] @ weight.T).argmax()


def test_a_head_that_is_not_finite_is_not_screened() -> None:
    weight, _ = _head_and_hidden(512, 64, 4)
    weight[3, 3] = float("inf")
    assert build_screen(weight) is None


def test_plain_greedy_steps_are_screened_and_equal_generate(screened_calls: list[int]) -> None:
    model = tiny_model("llama", "cpu")
    prompts = random_prompts([5, 17, 3, 40, 9, 26])
    with make_engine(model, max_batch_tokens=32) as engine:
        for index, prompt in enumerate(prompts):
            engine.add(engine.make_request(prompt, str(index), max_new_tokens=12))
        outputs = run_engine(engine)
        assert engine.model_runner.head_is_final
    assert screened_calls[0] > 0
    for index, prompt in enumerate(prompts):
        assert outputs[str(index)].generated_tokens == reference_generate(model, prompt, 12)


def test_bfloat16_greedy_steps_are_screened_and_equal_the_unscreened_steps(
        screened_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    model = fresh_tiny_model("llama", "cpu").to(torch.bfloat16)
    if not packing_applies(model.get_output_embeddings()):
        pytest.skip("a bfloat16 head is packed (and so screened) only with the panel kernel or bfloat16 arithmetic")
    prompts = random_prompts([5, 17, 3, 40, 9, 26])

    def run() -> dict[str, list[int]]:
        with make_engine(model, max_batch_tokens=32) as engine:
            for index, prompt in enumerate(prompts):
                engine.add(engine.make_request(prompt, str(index), max_new_tokens=12))
            return {key: output.generated_tokens for key, output in run_engine(engine).items()}

    screened = run()
    assert screened_calls[0] > 0
    monkeypatch.setattr(head_screen, "SCREENED_DTYPES", (torch.float32,))
    calls = screened_calls[0]
    assert run() == screened
    assert screened_calls[0] == calls


def test_steps_that_need_logits_are_not_screened(screened_calls: list[int]) -> None:
    model = tiny_model("llama", "cpu")
    prompts = random_prompts([6, 11])
    with make_engine(model) as engine:
        engine.add(engine.make_request(prompts[0], "logprobs", max_new_tokens=6, logprobs=True))
        engine.add(engine.make_request(prompts[1], "penalty", max_new_tokens=6, repetition_penalty=1.3))
        outputs = run_engine(engine)
    assert screened_calls[0] == 0
    assert outputs["logprobs"].generated_tokens == reference_generate(model, prompts[0], 6)
    assert len(outputs["logprobs"].logprobs or []) == 6


def test_a_model_that_transforms_its_logits_is_never_screened(screened_calls: list[int]) -> None:
    model = tiny_model("gemma2-softcap", "cpu")  # logits soft-capped after the head
    prompts = random_prompts([7, 12, 4])
    with make_engine(model) as engine:
        for index, prompt in enumerate(prompts):
            engine.add(engine.make_request(prompt, str(index), max_new_tokens=8))
        outputs = run_engine(engine)
        assert engine.model_runner.head_is_final is False
    assert screened_calls[0] == 0
    for index, prompt in enumerate(prompts):
        assert outputs[str(index)].generated_tokens == reference_generate(model, prompt, 8)


def test_a_compiled_forward_is_screened_too(screened_calls: list[int]) -> None:
    """The head's product is an opaque op in the compiled graph: the screen serves the step inside it."""
    torch._dynamo.reset()
    model = fresh_tiny_model("llama", "cpu")
    prompts = random_prompts([4, 19, 8])
    with make_engine(model, block_size=4, num_blocks=100, use_default_compile_configs=True) as engine:
        for index, prompt in enumerate(prompts):
            engine.add(engine.make_request(prompt, str(index), max_new_tokens=7))
        outputs = run_engine(engine)
        assert engine.model_runner.compiled is not None and engine.model_runner.head_is_final
    assert screened_calls[0] > 0
    for index, prompt in enumerate(prompts):
        assert outputs[str(index)].generated_tokens == reference_generate(model, prompt, 7)


def test_the_self_check_rejects_a_product_that_is_not_the_weights() -> None:
    """`_products_exact` compares oneDNN's product with exact integer products: a packed weight that does not hold
    the int8 codes it is checked against fails it."""
    weight, _ = _head_and_hidden(512, 64, 4)
    screen = build_screen(weight)
    assert screen is not None
    codes = torch.round(weight.double() / screen.scales.double()[:, None]).clamp(-127, 127).to(torch.int8)
    assert head_screen._products_exact(screen, codes)
    codes[3, 5] += 1 if codes[3, 5] < 127 else -1
    assert not head_screen._products_exact(screen, codes)


def test_the_self_checks_reference_is_exact_beyond_float32s_integers() -> None:
    """The self-check's integer products are exact where no float32 product can be: 3,001 columns of 127 x 127 sum
    to 48,403,129, an odd number past 2^25 that float32 cannot hold; over several blocks of head rows and pieces
    of columns."""
    generator = torch.Generator().manual_seed(0)
    k, vocab = 3001, head_screen.CHECK_BLOCK + 904
    codes = torch.stack([torch.full((k,), 127), torch.full((k,), -127),
                         *torch.randint(-127, 128, (3, k), generator=generator)])
    int8 = torch.randint(-127, 128, (vocab, k), generator=generator, dtype=torch.int8)
    int8[::2] = 127
    exact = codes.double() @ int8.double().T
    assert exact[0, 0] == 48_403_129 and float(torch.tensor(48_403_129.0, dtype=torch.float32)) != exact[0, 0]
    assert torch.equal(head_screen._integer_products(codes, int8), exact)
