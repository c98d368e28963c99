"""The telemetry benchmark: each mode runs the same workload, the "on" modes really export to the collector
stand-in, and the summary compares the modes."""

from __future__ import annotations

from contbatch import ContinuousBatchingConfig
from contbatch.bench.telemetry import MODES, run_otel
from tests.helpers import fresh_tiny_model, random_prompts


def test_every_mode_runs_the_workload_and_the_on_modes_export() -> None:
    inputs = random_prompts([5, 9, 7], seed=6)
    results, lines = run_otel(fresh_tiny_model("llama"), inputs, 6, None,
                              ContinuousBatchingConfig(block_size=4, num_blocks=64), rounds=2)
    assert [r.engine for r in results] == [
        f"contbatch, {mode} (round {index + 1})" for index, order in enumerate((MODES, (*MODES[1:], MODES[0])))
        for mode in order]
    assert all(r.generated_tokens == 3 * 6 for r in results)
    assert lines[0].startswith("otel off: mean ") and "cost" not in lines[0]
    assert lines[1].startswith("otel on: mean ") and "cost against otel off" in lines[1]
    assert lines[2].startswith("otel on, detailed traces: mean ") and "cost against otel off" in lines[2]
    assert lines[3] == "outputs identical in every mode: yes"
    assert "to /v1/traces" in lines[4] and "to /v1/metrics" in lines[4]
