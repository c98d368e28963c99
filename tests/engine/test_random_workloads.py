"""Seeded random workloads against greedy `generate`: each seed picks a model family, a block size, a cache from
barely enough for the longest request to roomy, a step budget, prefix caching, the scheduler, async batching and
a prefill cap, and requests with shared prefixes, EOS tokens from their own trajectories, and arrival steps. The
fixed cases elsewhere test each of these; here they meet in combinations nobody listed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from contbatch.frontend.output_processor import OutputCollector
from contbatch.outputs import GenerationOutput, RequestStatus
from tests.helpers import TINY_CONFIGS, VOCAB, make_engine, reference_generate, tiny_model


@dataclass
class Workload:
    """One seed's model family, engine config and requests (prompt, max_new_tokens, EOS or None, arrival step)."""

    family: str
    config: dict[str, object]
    prompts: list[list[int]]
    max_new: list[int]
    arrivals: list[int]
    eos: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of_seed(cls, seed: int) -> Workload:
        rng = random.Random(seed)
        family = rng.choice(sorted(TINY_CONFIGS))
        prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(2)]
        prompts = [(rng.choice(prefixes) if rng.random() < 0.5 else [])
                   + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 50))] for _ in range(rng.randint(1, 10))]
        max_new = [rng.randint(1, 16) for _ in prompts]
        block_size = rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 32, 64, 256])
        blocks = [-(-(len(prompt) + new) // block_size) for prompt, new in zip(prompts, max_new, strict=True)]
        num_blocks = rng.randint(max(blocks), sum(blocks) + 2) if rng.random() < 0.6 else sum(blocks) + 8
        config: dict[str, object] = dict(
            block_size=block_size, num_blocks=num_blocks, max_batch_tokens=rng.choice([1, 2, 3, 7, 16, 33, 64, 512]),
            allow_block_sharing=rng.random() < 0.7, scheduler_type=rng.choice(["fifo", "prefill_first"]),
            use_async_batching=rng.random() < 0.4)
        if rng.random() < 0.3:
            config["max_prefill_tokens_while_decoding"] = rng.randint(1, 20)
        workload = cls(family, config, prompts, max_new, [rng.randint(0, 6) for _ in prompts])
        for index, (prompt, new) in enumerate(zip(prompts, max_new, strict=True)):
            if rng.random() < 0.25 and new > 2:
                trajectory = reference_generate(tiny_model(family), prompt, new)
                workload.eos[index] = trajectory[rng.randrange(len(trajectory))]
        workload.fit_cache()
        return workload

    def fit_cache(self) -> None:
        """Grows `num_blocks` until the engine admits the longest request (a hybrid model's block holds one layer
        group, so the engine, not the seed, knows the count)."""
        while True:
            with make_engine(tiny_model(self.family), **self.config) as engine:
                try:
                    for index, prompt in enumerate(self.prompts):
                        engine.make_request(prompt, f"r{index}", self.max_new[index])
                    return
                except ValueError as error:
                    if "can ever hold" not in str(error):
                        raise
            self.config["num_blocks"] = int(self.config["num_blocks"]) * 3 // 2 + 1  # type: ignore[call-overload]

    def run(self) -> dict[str, GenerationOutput]:
        """Each request added at its arrival step, the engine stepped until idle; the finished outputs by id. Asserts
        the pool is whole afterwards."""
        model = tiny_model(self.family)
        own_attention = model.config._attn_implementation
        collector, step, waiting = OutputCollector(), 0, list(range(len(self.prompts)))
        with make_engine(model, **self.config) as engine:
            while waiting or engine.has_unfinished_requests():
                for index in [index for index in waiting if self.arrivals[index] <= step]:
                    eos = [self.eos[index]] if index in self.eos else None
                    engine.add_request(self.prompts[index], request_id=f"r{index}",
                                       max_new_tokens=self.max_new[index], eos_token_id=eos)
                    waiting.remove(index)
                collector.add(engine.step())
                step += 1
                assert step < 5_000, "the engine stopped making progress"
            engine.check_integrity()
            assert engine.block_pool.is_whole
        assert model.config._attn_implementation == own_attention
        return collector.finished


def _check(seed: int) -> None:
    workload = Workload.of_seed(seed)
    finished = workload.run()
    model = tiny_model(workload.family)
    for index, prompt in enumerate(workload.prompts):
        output = finished[f"r{index}"]
        assert output.status == RequestStatus.FINISHED, (seed, workload, output.error)
        expected = reference_generate(model, prompt, workload.max_new[index], workload.eos.get(index))
        assert output.generated_tokens == expected, (seed, index, workload)


@pytest.mark.parametrize("seed", range(20))
def test_random_workload_matches_generate(seed: int) -> None:
    _check(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20, 100))
def test_more_random_workloads_match_generate(seed: int) -> None:
    _check(seed)
