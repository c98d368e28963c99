"""The structured-outputs benchmark: its answer check and one small interleaved run."""

from __future__ import annotations

from contbatch import ContinuousBatchingConfig
from contbatch.bench.structured import is_answer, json_inputs, run_structured
from contbatch.data.embedded import load_model_and_tokenizer


def test_is_answer_accepts_only_the_schemas_objects() -> None:
    assert is_answer('{"reasoning": "2 + 2", "answer": 4}') and is_answer('{"answer": 4.5, "reasoning": ""}')
    assert not is_answer('{"reasoning": "x", "answer": "4"}') and not is_answer('{"reasoning": "x"}')
    assert not is_answer('{"reasoning": "x", "answer": true}') and not is_answer("Answer: 4")
    assert not is_answer('{"reasoning": "x", "answer": 4, "extra": 1}')


def test_a_small_run_reports_both_settings_in_turn() -> None:
    model, tokenizer = load_model_and_tokenizer()
    inputs = json_inputs(tokenizer, 2)
    assert all("JSON" in tokenizer.decode(ids) for ids in inputs)
    runs = run_structured(model, tokenizer, inputs, 12, tokenizer.eos_token_id,
                          ContinuousBatchingConfig(block_size=16, num_blocks=64), rounds=1)
    assert [result.engine for result, _, _ in runs] == ["contbatch, JSON schema off",
                                                          "contbatch, JSON schema enforced"]
    assert all(result.generated_tokens > 0 and 0 <= valid <= 2 for result, valid, _ in runs)
    assert runs[0][2] is None and runs[1][2] is not None and 0 < runs[1][2] < runs[1][0].wall_s
