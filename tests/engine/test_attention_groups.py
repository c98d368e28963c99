"""How a step's multi-token requests attend: in one ragged group where a kernel attends them (the CPU kernel, the
Triton kernel), else split into padded attention groups (CPU: padding bounded)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig
from contbatch.api import generate_batch
from contbatch.engine.attention_groups import MAX_PADDING
from contbatch.engine.attention_groups import padding_bounded_sets as _padding_bounded_sets
from contbatch.engine.engine import LLMEngine
from contbatch.engine.scheduler import SchedulerOutput
from tests.helpers import random_prompts, reference_generate, tiny_model


def _sets(counts: list[int], starts: list[int], max_padding: float | None) -> list[list[int]]:
    counts_t, starts_t = torch.tensor(counts), torch.tensor(starts)
    members = (counts_t > 1).nonzero().squeeze(1)
    return [members_set.tolist() for members_set in _padding_bounded_sets(members, counts_t, starts_t,
                                                                           max_padding)]


def test_exact_groups() -> None:
    counts, starts = [1, 100, 90, 10, 50, 1, 48], [5, 16, 16, 0, 0, 9, 0]
    assert _sets(counts, starts, 1.25) == [[1, 2], [4, 6], [3]]
    assert _sets(counts, starts, None) == [[1, 2, 3, 4, 6]]
    assert _sets([1, 1], [3, 4], 1.25) == []
    assert _sets([7], [0], 1.25) == [[0]]


def test_every_request_once_and_padding_bounded() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        counts = torch.randint(1, 200, (12,), generator=generator).tolist()
        starts = torch.randint(0, 300, (12,), generator=generator).tolist()
        sets = _sets(counts, starts, MAX_PADDING)
        assert sorted(index for group in sets for index in group) == [i for i, c in enumerate(counts) if c > 1]
        for group in sets:
            own = sum(counts[i] * (starts[i] + counts[i]) for i in group)
            padded = len(group) * max(counts[i] for i in group) * max(starts[i] + counts[i] for i in group)
            assert len(group) == 1 or padded <= MAX_PADDING * own


def test_mixed_lengths_keep_parity() -> None:
    model = tiny_model("llama")
    prompts = random_prompts([3, 40, 37, 9, 64, 2, 18], seed=11)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None)
    outputs = generate_batch(model, prompts, config, ContinuousBatchingConfig(block_size=8, max_batch_tokens=96),
                             progress_bar=False)
    for index, prompt in enumerate(prompts):
        assert outputs[f"req_{index}"].generated_tokens == reference_generate(model, prompt, 6)


def _groups_of_each_step(lengths: list[int], ragged: bool) -> list[tuple[list[int], list[bool]]]:
    """For each step of a run on prompts of `lengths` (steps with prompt tokens in one ragged group or in padded
    groups): its requests' token counts and its groups' `whole_batch`."""
    engine = LLMEngine(tiny_model("llama", "cpu"),
                       GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=None),
                       ContinuousBatchingConfig(block_size=8, max_batch_tokens=64))
    engine.model_runner.ragged = ragged
    seen: list[tuple[list[int], list[bool]]] = []
    prepare = engine.model_runner.prepare

    def recording(scheduler_output: SchedulerOutput) -> Any:
        prepared = prepare(scheduler_output)
        seen.append(([len(entry.token_ids) for entry in scheduler_output.requests],
                     [group.whole_batch for group in prepared.groups]))
        return prepared

    engine.model_runner.prepare = recording  # type: ignore[method-assign]
    for index, prompt in enumerate(random_prompts(lengths, seed=3)):
        engine.add_request(prompt, f"r{index}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    return seen


def test_a_step_of_one_unpadded_group_attends_without_gather() -> None:
    """Padded groups (where no kernel attends a ragged step): decode steps and a lone prefill form one group over
    the whole batch in order (`whole_batch`: the layer output is the group's); a padded group does not. With the
    CPU kernel (the default here) every step is one whole-batch group, ragged where it has prompt tokens."""
    assert _groups_of_each_step([20, 21], False) == [([20, 21], [False]), ([1, 1], [True]), ([1, 1], [True])]
    assert _groups_of_each_step([12], False) == [([12], [True]), ([1], [True]), ([1], [True])]
    assert _groups_of_each_step([20, 21], True) == [([20, 21], [True]), ([1, 1], [True]), ([1, 1], [True])]


def test_attention_output_is_contiguous_in_steps_of_several_groups(monkeypatch: Any) -> None:
    """The compiled op's fake promises a contiguous [1, tokens, heads, head_dim]: every step's output has it,
    those that scatter several groups' outputs included (inductor asserts the strides). The query comes in
    contiguous as [1, heads, tokens, head_dim], as it does on a GPU (a CPU forward hands over a transposed
    view of [tokens, heads, head_dim])."""
    from contbatch.engine import attention, model_runner

    real = attention.paged_attention_for_layer
    groups_seen: list[int] = []

    def checked(*args: Any, **kwargs: Any) -> torch.Tensor:
        layer, query, *rest = args
        output = real(layer, query.contiguous(), *rest, **kwargs)
        groups_seen.append(len(rest[2].groups))
        assert output.is_contiguous(), output.stride()
        return output

    monkeypatch.setattr(attention, "paged_attention_for_layer", checked)
    monkeypatch.setattr(model_runner, "attends_ragged", lambda *args: False)
    model = tiny_model("llama")
    prompts = random_prompts([3, 40, 7, 25], seed=31)
    outputs = generate_batch(model, prompts, GenerationConfig(do_sample=False, eos_token_id=None),
                             ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=32),
                             progress_bar=False, max_new_tokens=5)
    assert max(groups_seen) > 1
    for prompt, output in zip(prompts, outputs.values(), strict=True):
        assert output.generated_tokens == reference_generate(model, prompt, 5)


def test_kernel_row_ranges_are_the_masks_keys() -> None:
    """Each real query row of a padded group reads exactly the keys its mask allows, full attention and sliding
    window alike (the window's layout starting past 0); a padding row reads one key."""
    from contbatch.engine.attention_groups import attention_group

    counts, starts = torch.tensor([5, 1, 3, 4]), torch.tensor([0, 9, 14, 2])
    block_tables = torch.arange(2 * 4 * 6).view(2, 4, 6)
    group = attention_group(torch.tensor([0, 2, 3]), counts, starts, torch.tensor([0, 5, 6, 9]), block_tables, 4,
                            (None, 3))
    for layout, window in zip(group.layouts, (None, 3), strict=True):
        mask = layout.mask(group.query_positions, window)[:, 0].reshape(-1, layout.length)
        lengths, first = layout.row_ranges(group.query_positions, window, group.real_queries)
        assert group.real_queries is not None
        padding = torch.ones(len(lengths), dtype=torch.bool).index_fill_(0, group.real_queries, False)
        for row in range(len(lengths)):
            keys = mask[row].nonzero().squeeze(1).tolist()
            assert (lengths[row] - first[row] == 1) if padding[row] else keys == list(range(first[row], lengths[row]))
    assert group.layouts[1].first is not None


@pytest.mark.parametrize("ragged", [True, False])
def test_prefill_groups_go_through_the_cpu_kernel(ragged: bool, monkeypatch: Any) -> None:
    """On CPU the steps with prompt tokens attend through the kernel with parity: in one ragged call a layer (the
    default), or in padded groups of several queries a request."""
    from contbatch.engine import attention, cpu_kernels, model_runner

    kernel = cpu_kernels.paged_decode_kernel()
    assert kernel is not None
    calls: list[tuple[int, bool]] = []

    def counted(*args: Any) -> torch.Tensor:
        calls.append((args[8], len(args) == 10))
        return kernel(*args)

    monkeypatch.setattr(attention, "paged_decode_kernel", lambda: counted)
    if not ragged:
        monkeypatch.setattr(model_runner, "attends_ragged", lambda *args: False)
    model = tiny_model("llama", "cpu")
    prompts = random_prompts([3, 40, 37, 9, 64, 2, 18], seed=11)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None)
    outputs = generate_batch(model, prompts, config, ContinuousBatchingConfig(block_size=8, max_batch_tokens=96),
                             progress_bar=False)
    if ragged:
        assert any(is_ragged for _, is_ragged in calls) and all(count == 1 for count, _ in calls)
    else:
        assert not any(is_ragged for _, is_ragged in calls)
        assert max(count for count, _ in calls) > 1 and min(count for count, _ in calls) == 1
    for index, prompt in enumerate(prompts):
        assert outputs[f"req_{index}"].generated_tokens == reference_generate(model, prompt, 6)
