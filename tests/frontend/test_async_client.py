"""The asyncio client and the frontend's output processing: fan-in of n samples, streaming, cancellation on early
exit, stop strings and text, many concurrent generations on one event loop."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from contbatch import AsyncClient, ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus
from contbatch.data.embedded import embedded_model_dir
from tests.helpers import random_prompts, reference_generate, tiny_model


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def new_manager(tokenizer: PreTrainedTokenizerBase) -> ContinuousBatchingManager:
    return ContinuousBatchingManager(tiny_model("llama"), GenerationConfig(do_sample=False, eos_token_id=None),
                                     ContinuousBatchingConfig(block_size=4, num_blocks=128, max_batch_tokens=64),
                                     tokenizer=tokenizer)


def pool_whole_soon(manager: ContinuousBatchingManager) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if manager.stats.num_running == manager.stats.num_waiting == 0 and manager.engine.block_pool.is_whole:
            return True
        time.sleep(0.01)
    return False


def test_n_choices_stream_interleaved_and_each_matches_generate(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = random_prompts([9], seed=100)[0]
    expected = reference_generate(tiny_model("llama"), prompt, 6)

    async def run() -> dict[int, list]:
        outputs: dict[int, list] = {0: [], 1: [], 2: []}
        async for choice in AsyncClient(manager).generate(prompt, n=3, max_new_tokens=6, do_sample=True, top_k=1,
                                                          detokenize=True):
            outputs[choice.index].append(choice.output)
        return outputs

    with new_manager(tokenizer) as manager:
        outputs = asyncio.run(run())
        assert pool_whole_soon(manager)
    for chunks in outputs.values():
        assert len(chunks) == 6 and chunks[-1].status == RequestStatus.FINISHED
        assert [token for chunk in chunks for token in chunk.new_tokens] == chunks[-1].generated_tokens == expected
        assert "".join(chunk.new_text for chunk in chunks) == chunks[-1].text
        assert chunks[-1].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_leaving_the_loop_early_cancels_every_running_choice(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = random_prompts([5], seed=101)[0]

    async def run() -> int:
        seen = 0
        async for _ in AsyncClient(manager).generate(prompt, n=2, max_new_tokens=500):
            seen += 1
            if seen == 3:
                break
        return seen

    with new_manager(tokenizer) as manager:
        assert asyncio.run(run()) == 3
        assert pool_whole_soon(manager), "the abandoned choices were cancelled and their blocks freed"


def test_many_concurrent_generations_on_one_loop(tokenizer: PreTrainedTokenizerBase) -> None:
    prompts = random_prompts([3, 11, 7, 20, 5, 14, 9, 2], seed=102)

    async def one(client: AsyncClient, prompt: list[int]) -> list[int]:
        final = [choice.output async for choice in client.generate(prompt, max_new_tokens=8, streaming=False)]
        assert len(final) == 1
        return final[0].generated_tokens

    async def run() -> list[list[int]]:
        client = AsyncClient(manager)
        return await asyncio.gather(*(one(client, prompt) for prompt in prompts))

    with new_manager(tokenizer) as manager:
        results = asyncio.run(run())
    assert results == [reference_generate(tiny_model("llama"), prompt, 8) for prompt in prompts]


def test_a_stop_string_ends_the_request_with_the_text_cut_before_it(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = random_prompts([8], seed=103)[0]
    free_run = reference_generate(tiny_model("llama"), prompt, 30)
    full = tokenizer.decode(free_run, skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    with new_manager(tokenizer) as manager:
        manager.add_request(prompt, "s", max_new_tokens=30, stop=[stop])
        output = manager.get_result("s", timeout=60)
        assert pool_whole_soon(manager), "the engine stopped generating for it"
    assert output.status == RequestStatus.FINISHED and output.finish_reason == "stop"
    assert output.text == full[:full.find(stop)]
    assert output.generated_tokens == free_run[:len(output.generated_tokens)]
    assert len(output.generated_tokens) < 30


def test_text_needs_a_tokenizer() -> None:
    manager = ContinuousBatchingManager(tiny_model("llama"), GenerationConfig(do_sample=False))
    with pytest.raises(ValueError, match="tokenizer"):
        manager.add_request([1, 2, 3], stop=["x"])
