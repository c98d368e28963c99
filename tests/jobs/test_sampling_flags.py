"""`contbatch generate`'s sampling flags (`--top-k`, `--min-p`, `--repetition-penalty`, `--stop`): what each does to
a job's completions, checked against `generate` or greedy decoding; bad values refused before anything runs; the
flags recorded for resume, with outputs made before they existed still resumable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from contbatch.cli import build_parser, main
from contbatch.cli.generate import job_parts
from contbatch.data.prompts import as_token_ids
from contbatch.jobs import JobSettings
from tests.jobs.conftest import by_id, job, read_jsonl, write_jsonl

ROWS = [{"question": q} for q in ("What is 2 + 2?", "Name a colour.", "Count to three.", "Say hello.")]
NEW_TOKENS = 12
PENALTY = 0.5  # below 1 it favours the tokens already seen: the random tiny model never repeats itself


def _records(tiny, tmp_path: Path, name: str, **settings: object) -> dict[int, dict[str, object]]:
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    summary = job(tiny, source, tmp_path / f"{name}.jsonl",
                  JobSettings(model="tiny", max_new_tokens=NEW_TOKENS, **settings))
    assert summary.ok and summary.succeeded == len(ROWS)
    return by_id(read_jsonl(tmp_path / f"{name}.jsonl"))


def _completions(records: dict[int, dict[str, object]]) -> dict[int, object]:
    return {key: record["completion"] for key, record in records.items()}


def test_flags_reach_the_job_settings() -> None:
    args = build_parser().parse_args(["generate", "--top-k", "5", "--min-p", "0.1", "--repetition-penalty", "1.2",
                                      "--stop", "\n\n", "--stop", "Answer:"])
    _, settings = job_parts(args)
    assert (settings.top_k, settings.min_p, settings.repetition_penalty) == (5, 0.1, 1.2)
    assert settings.stop == ("\n\n", "Answer:")
    _, plain = job_parts(build_parser().parse_args(["generate"]))
    assert (plain.top_k, plain.min_p, plain.repetition_penalty, plain.stop) == (None, None, None, ())


def test_top_k_1_and_min_p_1_sample_what_greedy_decoding_picks(tiny, tmp_path: Path) -> None:
    greedy = _completions(_records(tiny, tmp_path, "greedy"))
    top_k = _completions(_records(tiny, tmp_path, "top_k", temperature=1.0, top_k=1, seed=3))
    min_p = _completions(_records(tiny, tmp_path, "min_p", temperature=1.0, min_p=1.0, top_k=0, seed=3))
    unrestricted = _completions(_records(tiny, tmp_path, "sampled", temperature=1.0, top_k=0, seed=3))
    assert top_k == greedy
    assert min_p == greedy
    assert unrestricted != greedy, "sampling without the flags should differ from greedy decoding"


def test_repetition_penalty_matches_generate(tiny, tmp_path: Path) -> None:
    model, tokenizer = tiny
    penalised = _completions(_records(tiny, tmp_path, "penalised", repetition_penalty=PENALTY))
    assert penalised != _completions(_records(tiny, tmp_path, "plain")), "the penalty changed nothing"
    for index, row in enumerate(ROWS):
        prompt = as_token_ids(tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}],
                                                            add_generation_prompt=True, tokenize=True))
        ids = torch.tensor([prompt])
        expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=PENALTY,
                                  attention_mask=torch.ones_like(ids))
        text = tokenizer.decode(expected[0, len(prompt):], skip_special_tokens=True)
        assert penalised[index] == text, index


def test_stop_ends_a_completion_before_the_text(tiny, tmp_path: Path) -> None:
    plain = _records(tiny, tmp_path, "plain")
    text = str(plain[0]["completion"])
    cut = len(text) // 2
    stop = text[cut:cut + 3]
    assert len(stop) == 3 and stop.strip(), text
    stopped = _records(tiny, tmp_path, "stopped", stop=(stop, "\x00never"))
    assert stopped[0]["completion"] == text[:text.index(stop)]
    assert stopped[0]["finish_reason"] == "stop"
    for key, record in stopped.items():
        assert stop not in str(record["completion"]), key
        assert str(plain[key]["completion"]).startswith(str(record["completion"])), key


@pytest.mark.parametrize(("flags", "message"), [
    (["--temperature", "0.7", "--top-p", "2"], "top_p must be in"),
    (["--top-k", "-1"], "top_k must be an integer >= 0, got -1"),
    (["--temperature", "0.7", "--min-p", "1.5"], "min_p must be in"),
    (["--repetition-penalty", "0"], "repetition_penalty must be a finite number > 0, got 0.0"),
    (["--stop", ""], "stop strings must be non-empty strings, got ''"),
])
def test_bad_values_are_refused_before_the_job_runs(tmp_path: Path, flags: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "out.jsonl"
    assert main(["generate", "--output", str(output), "--quiet", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not output.exists()


def test_flags_are_recorded_for_resume_and_older_outputs_still_resume(tiny, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    output = tmp_path / "out.jsonl"
    assert job(tiny, source, output, JobSettings(model="tiny", max_new_tokens=4)).ok
    settings_path = tmp_path / "out.jsonl.settings.json"
    recorded = json.loads(settings_path.read_text())
    older = {k: v for k, v in recorded.items() if k not in ("top_k", "min_p", "repetition_penalty", "stop")}
    assert older != recorded
    settings_path.write_text(json.dumps(older))
    assert job(tiny, source, output, JobSettings(model="tiny", max_new_tokens=4)).skipped == 2
    with pytest.raises(ValueError, match=r"other settings \(stop: None -> \['x'\]\)"):
        job(tiny, source, output, JobSettings(model="tiny", max_new_tokens=4, stop=("x",)))
