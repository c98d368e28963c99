"""lm-evaluation-harness itself on the shipped tasks, with the `contbatch` backend against lm-eval's own `hf` backend
(same model directory, float32), plus `contbatch eval` end to end and the backend's conventions."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import contbatch
from contbatch import ContinuousBatchingManager
from contbatch.cli import main
from contbatch.data.embedded import embedded_model_dir
from contbatch.data.lm_eval_tasks import GEN_TASK, MC_TASK, final_answer, load_records, multiple_choice_doc
from contbatch.integrations.lm_eval import TASKS_DIR, ContbatchLM
from contbatch.integrations.lm_eval.conventions import generation_settings, truncate_pair

TOLERANCE = 1e-4
HF_ARGS = {"dtype": "float32", "device": "cpu", "batch_size": 1}
ENGINE_ARGS = {"num_blocks": 512}


def evaluate(model: str, model_args: dict[str, Any], task: str, limit: int, **options: Any) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` on one shipped task (indexed alone: the built-in tasks are not scanned), with
    every sample logged and no bootstrap."""
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], limit=limit,
                                      task_manager=manager, log_samples=True, bootstrap_iters=0, **options)
    assert results is not None
    return results


def both(model_dir: Path | str, task: str, limit: int, model_args: dict[str, Any] | None = None,
         **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same evaluation through the `contbatch` backend and through lm-eval's `hf` backend."""
    shared = {"pretrained": str(model_dir), **(model_args or {})}
    ours = evaluate("contbatch", {**shared, **ENGINE_ARGS}, task, limit, **options)
    reference = evaluate("hf", {**shared, **HF_ARGS}, task, limit, **options)
    return ours, reference


def samples_by_key(results: dict[str, Any], task: str) -> dict[tuple[int, str], dict[str, Any]]:
    return {(sample["doc_id"], sample["filter"]): sample for sample in results["samples"][task]}


def metrics(results: dict[str, Any], task: str) -> dict[str, Any]:
    return {key: value for key, value in results["results"][task].items() if "stderr" not in key}


def assert_same_loglikelihoods(ours: dict[str, Any], reference: dict[str, Any], task: str) -> None:
    """Every document's every choice: loglikelihood within TOLERANCE of `hf`'s and the same greediness."""
    mine, theirs = samples_by_key(ours, task), samples_by_key(reference, task)
    assert mine.keys() == theirs.keys()
    for key, sample in mine.items():
        assert sample["arguments"] == theirs[key]["arguments"]
        for (ll, greedy), (ref_ll, ref_greedy) in zip([r[0] for r in sample["resps"]],
                                                      [r[0] for r in theirs[key]["resps"]], strict=True):
            assert math.isfinite(ll) and abs(ll - ref_ll) <= TOLERANCE, (key, ll, ref_ll)
            assert greedy == ref_greedy, key


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Both backends on one torch thread: on a few shared cores an OpenMP team waits at every barrier for a
    descheduled member, which makes many-small-step runs several times slower and their timings erratic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return embedded_model_dir()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """A tiny random Llama saved with the embedded model's tokenizer (and its chat template)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    directory = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[Any]]]:
    """Every `contbatch.loglikelihood` call's number of pairs, and every manager session start and request."""
    recorded: dict[str, list[Any]] = {"loglikelihood": [], "start": [], "add_request": []}
    score, start, add = contbatch.loglikelihood, ContinuousBatchingManager.start, ContinuousBatchingManager.add_request

    def scoring(model: Any, pairs: Any, **kwargs: Any) -> Any:
        recorded["loglikelihood"].append(len(pairs))
        return score(model, pairs, **kwargs)

    def starting(self: ContinuousBatchingManager) -> None:
        recorded["start"].append(len(recorded["add_request"]))
        start(self)

    def adding(self: ContinuousBatchingManager, *args: Any, **kwargs: Any) -> str:
        recorded["add_request"].append(args[0])
        return add(self, *args, **kwargs)

    monkeypatch.setattr(contbatch, "loglikelihood", scoring)
    monkeypatch.setattr(ContinuousBatchingManager, "start", starting)
    monkeypatch.setattr(ContinuousBatchingManager, "add_request", adding)
    yield recorded


@pytest.fixture(scope="module")
def mc_runs(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    return both(model_dir, MC_TASK, limit=12)


def test_multiple_choice_task_on_the_embedded_model_equals_hf(mc_runs: tuple[dict[str, Any], dict[str, Any]]
                                                              ) -> None:
    ours, reference = mc_runs
    assert metrics(ours, MC_TASK) == metrics(reference, MC_TASK)
    assert ours["results"][MC_TASK]["sample_len"] == 12
    assert_same_loglikelihoods(ours, reference, MC_TASK)


def test_all_loglikelihood_requests_go_to_one_engine_run(tiny_dir: Path, calls: dict[str, list[Any]]) -> None:
    evaluate("contbatch", {"pretrained": str(tiny_dir), **ENGINE_ARGS}, MC_TASK, limit=5)
    assert calls["loglikelihood"] == [5 * 4]


def test_generation_task_on_the_embedded_model_equals_hf(model_dir: Path, calls: dict[str, list[Any]]) -> None:
    """One-shot prompts, so that the model often writes the next "Question:" (a stop sequence) or EOS; the
    others end at max_gen_toks."""
    options = {"num_fewshot": 1, "gen_kwargs": {"max_gen_toks": 40}}
    ours = evaluate("contbatch", {"pretrained": str(model_dir), **ENGINE_ARGS}, GEN_TASK, limit=6, **options)
    assert calls["start"] == [0] and len(calls["add_request"]) == 6
    reference = evaluate("hf", {"pretrained": str(model_dir), **HF_ARGS}, GEN_TASK, limit=6, **options)
    assert metrics(ours, GEN_TASK) == metrics(reference, GEN_TASK)
    mine, theirs = samples_by_key(ours, GEN_TASK), samples_by_key(reference, GEN_TASK)
    assert mine.keys() == theirs.keys() and len(mine) == 6 * 2
    texts = [sample["resps"][0][0] for sample in mine.values()]
    assert texts == [sample["resps"][0][0] for sample in theirs.values()]
    assert "" in texts and any(len(text) > 60 for text in texts)


def test_left_truncation_to_max_length_equals_hf(tiny_dir: Path) -> None:
    """Contexts longer than max_length lose their leftmost tokens, for scoring and for generation, as in `hf`."""
    ours, reference = both(tiny_dir, MC_TASK, limit=4, model_args={"max_length": 40})
    assert_same_loglikelihoods(ours, reference, MC_TASK)
    assert metrics(ours, MC_TASK) == metrics(reference, MC_TASK)
    options = {"num_fewshot": 0, "gen_kwargs": {"max_gen_toks": 8}}
    ours, reference = both(tiny_dir, GEN_TASK, limit=4, model_args={"max_length": 48}, **options)
    texts = [sample["resps"] for sample in ours["samples"][GEN_TASK]]
    assert texts == [sample["resps"] for sample in reference["samples"][GEN_TASK]]


def test_chat_template_prompts_equal_hf(tiny_dir: Path) -> None:
    options = {"apply_chat_template": True, "fewshot_as_multiturn": True, "num_fewshot": 1}
    ours, reference = both(tiny_dir, MC_TASK, limit=3, **options)
    context, _ = ours["samples"][MC_TASK][0]["arguments"][0]
    assert "<|im_start|>user" in context
    assert_same_loglikelihoods(ours, reference, MC_TASK)


def rolling(text: str) -> Instance:
    return Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)


def test_loglikelihood_rolling_equals_a_plain_forward_and_hf_windows(tiny_dir: Path) -> None:
    text = " ".join(record["question"] for record in load_records()[:3])
    backend = ContbatchLM(pretrained=str(tiny_dir), num_blocks=256)
    tokens = [backend.prefix_token_id, *backend.tok_encode(text)]
    assert 4 * 24 < len(tokens) < 512
    reference_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(reference_model(torch.tensor([tokens])).logits[0, :-1].float(), dim=-1)
    expected = logprobs.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).sum().item()
    whole, empty = backend.loglikelihood_rolling([rolling(text), rolling("")], disable_tqdm=True)
    assert abs(whole - expected) <= TOLERANCE and empty == 0.0
    windowed = ContbatchLM(pretrained=str(tiny_dir), max_length=24, num_blocks=256)
    hf = HFLM(pretrained=str(tiny_dir), max_length=24, **HF_ARGS)
    texts = [text, load_records()[5]["question"]]
    ours = windowed.loglikelihood_rolling([rolling(t) for t in texts], disable_tqdm=True)
    theirs = hf.loglikelihood_rolling([rolling(t) for t in texts], disable_tqdm=True)
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(ours, theirs, strict=True))


def test_sampled_generation_follows_its_seed(tiny_dir: Path) -> None:
    backend = ContbatchLM(pretrained=str(tiny_dir), num_blocks=256)
    sampled = {"until": ["Question:"], "do_sample": True, "temperature": 0.9, "seed": 4, "max_gen_toks": 12}
    requests = [Instance(request_type="generate_until", doc={}, arguments=("Question: 2 + 2?\nAnswer:", kwargs),
                         idx=0) for kwargs in (sampled, sampled, {**sampled, "seed": 5})]
    first, again, other = backend.generate_until(requests, disable_tqdm=True)
    assert first == again and first != other
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        backend.generate_until([Instance(request_type="generate_until", doc={}, idx=0,
                                         arguments=("Hi", {"until": [], "no_repeat_ngram_size": 2}))])


def test_bad_model_args_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no_such_flag"):
        ContbatchLM(no_such_flag=1)
    with pytest.raises(ValueError, match="trust_remote_code"):
        ContbatchLM(trust_remote_code=True)


def test_contbatch_eval_is_a_complete_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dir: Path,
                                              mc_runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """`contbatch eval --tasks contbatch_gsm8k_mc --limit 4`, from an unrelated directory: the embedded model, the
    shipped task, lm-eval's results and samples files."""
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--tasks", MC_TASK, "--limit", "4", "--output_path", "out", "--log_samples"]) == 0
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["config"]["model"] == "contbatch"
    assert results["config"]["model_args"]["pretrained"] == str(model_dir)
    in_process = [sample["acc"] for sample in mc_runs[0]["samples"][MC_TASK] if sample["doc_id"] < 4]
    assert results["results"][MC_TASK]["acc,none"] == pytest.approx(sum(in_process) / 4)
    (samples_file,) = (tmp_path / "out").rglob(f"samples_{MC_TASK}_*.jsonl")
    assert len(samples_file.read_text().splitlines()) == 4


def test_contbatch_eval_help_is_lm_evals(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "contbatch eval" in out and "--num_fewshot" in out and "--include_path" in out


def test_shipped_multiple_choice_documents_are_well_formed() -> None:
    records = load_records()
    assert len(records) == 1319
    for record in records:
        doc = multiple_choice_doc(record)
        values = [int(choice) for choice in doc["choices"]]
        assert len(set(values)) == 4 and values == sorted(values)
        assert values[doc["label"]] == final_answer(record["answer"])
        assert doc == multiple_choice_doc(record)


def test_truncation_and_generation_settings_follow_hf() -> None:
    assert truncate_pair([1, 2, 3, 4], [5, 6], max_length=8) == ([1, 2, 3, 4], [5, 6])
    assert truncate_pair([1, 2, 3, 4], [5, 6], max_length=4) == ([2, 3, 4], [5, 6])
    with pytest.raises(ValueError):
        truncate_pair([1], [2, 3, 4], max_length=2)
    settings = generation_settings({"until": "\n\n", "max_new_tokens": 7, "temperature": 0.0}, "</s>", 256)
    assert (settings.max_new_tokens, settings.until, settings.sampling) == (7, ["\n\n", "</s>"], {"do_sample": False})
    settings = generation_settings({"temperature": 0.5, "top_p": 0.9}, "</s>", 256)
    assert settings.sampling == {"do_sample": True, "temperature": 0.5, "top_p": 0.9}
    assert settings.max_new_tokens == 256
    settings = generation_settings({"do_sample": False, "repetition_penalty": 1.2, "top_p": 0.9}, "</s>", 256)
    assert settings.sampling == {"do_sample": False, "repetition_penalty": 1.2}  # applied greedy too, as generate does
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        generation_settings({"no_repeat_ngram_size": 3}, "</s>", 256)


def test_local_completions_against_contbatch_serve_equals_hf(model_dir: Path,
                                                             mc_runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """The third way: lm-eval's own `local-completions` client (token-id requests, the server's tokenizer through
    /tokenize, 4 concurrent connections) against a contbatch server on the same embedded model. Same metrics as
    `hf` and every choice's loglikelihood within 1e-4; the server's cache is whole afterwards."""
    from contbatch.data.embedded import load_model_and_tokenizer
    from contbatch.entrypoints.openai.app import create_app
    from tests.entrypoints.openai.test_server import LiveServer

    _, reference = mc_runs
    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    manager = ContinuousBatchingManager(model, continuous_batching_config=contbatch.ContinuousBatchingConfig(
        block_size=16, num_blocks=512))
    manager.start()
    live = LiveServer(create_app(manager, tokenizer, "smollm2"))
    try:
        args = {"model": "smollm2", "base_url": f"{live.url}/v1/completions", "num_concurrent": 4,
                "tokenized_requests": True, "max_retries": 1, "timeout": 120}
        ours = evaluate("local-completions", args, MC_TASK, limit=12)
        assert manager.stats.num_running == 0 and manager.engine.block_pool.is_whole
    finally:
        live.stop()
        manager.stop()
    assert metrics(ours, MC_TASK) == metrics(reference, MC_TASK)
    assert_same_loglikelihoods(ours, reference, MC_TASK)


def test_eval_benchmark_runs_both_backends_on_both_tasks_and_reports_the_speed_up(tiny_dir: Path) -> None:
    """`contbatch bench --workload eval`'s runner: each shipped task through contbatch and hf (same documents,
    same requests, same metric: greedy and exact), and a table with contbatch's speed-up over hf's fastest run."""
    from contbatch.integrations.lm_eval import benchmark

    settings = benchmark.EvalBenchSettings(str(tiny_dir), limit=2, hf_batch_sizes=(1, 2))
    runs = benchmark.compare(settings)
    assert [(run.task, run.backend, run.batch_size) for run in runs] == [
        (task, backend, size) for task in (MC_TASK, GEN_TASK)
        for backend, size in (("contbatch", "all at once"), ("hf", "1"), ("hf", "2"))]
    for task in (MC_TASK, GEN_TASK):
        task_runs = [run for run in runs if run.task == task]
        assert len({(run.num_docs, run.num_requests, run.metric) for run in task_runs}) == 1, task_runs
    assert runs[0].num_requests == 8 and runs[3].num_requests == 2
    table = benchmark.format_table(runs, settings)
    ours = runs[0]
    speed_up = min(run.wall_s for run in runs[1:3]) / ours.wall_s
    assert f"| {MC_TASK} (acc,none) | contbatch | all at once | 2 | 8 | {ours.wall_s:.1f} | " in table
    assert f"**{speed_up:.2f}x**" in table


def test_contbatch_bench_workload_eval_writes_the_table(tiny_dir: Path, tmp_path: Path) -> None:
    table = tmp_path / "eval.md"
    assert main(["bench", "--workload", "eval", "--model", str(tiny_dir), "--num-prompts", "1",
                 "--output", str(table)]) == 0
    text = table.read_text()
    assert f"| {MC_TASK} (acc,none) | contbatch | all at once | 1 | 4 |" in text
    assert f"| {GEN_TASK} (exact_match,flexible-extract) | hf | 32 | 1 | 1 |" in text
