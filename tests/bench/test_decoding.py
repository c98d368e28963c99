"""The throughput benchmark's `Decoding`: its checks, `generate`'s configuration of it, and that every in-process
engine samples with it (top_k=1 samples the argmax: the greedy outputs, whatever the temperature)."""

from __future__ import annotations

import pytest

from contbatch.bench import throughput
from contbatch.bench.decoding import GREEDY, Decoding
from contbatch.cli import main
from tests.helpers import random_prompts, tiny_model


@pytest.mark.parametrize("fields", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.01), dict(top_k=-3)])
def test_out_of_range_settings_are_refused_by_name(fields: dict[str, float]) -> None:
    name = next(iter(fields))
    with pytest.raises(ValueError, match=name):
        Decoding(**fields)  # type: ignore[arg-type]


def test_generate_config_of_greedy_and_sampled_decoding() -> None:
    greedy = GREEDY.generation_config(8, [2, 3], 0)
    assert greedy.do_sample is False and greedy.eos_token_id == [2, 3] and GREEDY.describe() == "greedy"
    sampled = Decoding(temperature=0.7, top_p=0.9, top_k=0)
    config = sampled.generation_config(8, 2, None)
    assert (config.do_sample, config.temperature, config.top_p, config.top_k) == (True, 0.7, 0.9, 0)
    assert sampled.describe() == "sampled (temperature=0.7, top_p=0.9, top_k=0)"


def test_every_in_process_engine_samples_with_the_decoding() -> None:
    model = tiny_model("llama", "cpu")
    prompts = random_prompts([5, 9, 7], seed=4)
    argmax = Decoding(temperature=1.5, top_k=1)
    greedy_runs = [throughput.run_contbatch(model, prompts, 6, None),
                   throughput.run_static_generate(model, prompts, 6, None, 0, batch_size=2)]
    sampled_runs = [throughput.run_contbatch(model, prompts, 6, None, decoding=argmax),
                    throughput.run_static_generate(model, prompts, 6, None, 0, batch_size=2, decoding=argmax)]
    wide = Decoding(temperature=50.0)
    wide_runs = [throughput.run_contbatch(model, prompts, 6, None, decoding=wide),
                 throughput.run_static_generate(model, prompts, 6, None, 0, batch_size=2, decoding=wide)]
    for greedy, sampled, scattered in zip(greedy_runs, sampled_runs, wide_runs, strict=True):
        assert sampled.outputs == greedy.outputs
        assert scattered.outputs != greedy.outputs


def test_bench_refuses_a_bad_setting_before_loading_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--engines", "contbatch", "--top-p", "2"]) == 2
    assert "top_p must be in (0, 1], got 2.0" in capsys.readouterr().err


def test_the_sampling_flags_are_refused_where_they_would_be_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--workload", "beam", "--temperature", "0.7"]) == 2
    assert "apply to the throughput workload and --serve" in capsys.readouterr().err
