"""`contbatch serve`'s engine configuration: the serving token budget, the prompts' share of a step while requests
decode and the compile on CPU, the flags that override them, and the warm-up done before the server listens (its
compile, and its refusal of a model contbatch cannot run)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import (
    AutoTokenizer,
    BloomConfig,
    BloomForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.cli import build_parser
from contbatch.cli.common import engine_config
from contbatch.cli.serve import (
    SERVE_COMPILE,
    SERVE_MAX_BATCH_TOKENS,
    SERVE_PREFILL_TOKENS_WHILE_DECODING,
    WarmUpFailed,
    commit_cache_before_serving,
    serve_config,
    warm_up_before_serving,
)
from contbatch.data.embedded import embedded_model_dir
from contbatch.engine.compile import SHARED_ATTRIBUTE, served_compile_config
from contbatch.engine.config import DEFAULT_MAX_BATCH_TOKENS
from tests.helpers import tiny_model


def _config(*flags: str, device: str = "cpu") -> ContinuousBatchingConfig:
    return serve_config(build_parser().parse_args(["serve", *flags]), torch.device(device))


def test_serve_takes_the_serving_budget_on_cpu_without_the_flag() -> None:
    assert SERVE_MAX_BATCH_TOKENS["cpu"] == 2048 > DEFAULT_MAX_BATCH_TOKENS["cpu"]
    config = _config("--max-queue-size", "7", "--block-size", "32")
    assert (config.max_batch_tokens, config.max_queue_size, config.block_size) == (2048, 7, 32)


def test_an_explicit_budget_wins() -> None:
    assert _config("--max-batch-tokens", "300").max_batch_tokens == 300


def test_other_devices_keep_the_engine_default() -> None:
    assert _config(device="cuda").max_batch_tokens is None


def test_serve_bounds_prefill_while_decoding_on_cpu_unless_told_otherwise() -> None:
    assert SERVE_PREFILL_TOKENS_WHILE_DECODING == {"cpu": 128}
    assert _config().max_prefill_tokens_while_decoding == 128
    assert _config("--max-prefill-tokens-while-decoding", "64").max_prefill_tokens_while_decoding == 64
    assert _config(device="cuda").max_prefill_tokens_while_decoding is None


def test_the_flag_reaches_every_command_and_none_bounds_nothing() -> None:
    args = build_parser().parse_args(["generate", "--max-prefill-tokens-while-decoding", "32"])
    assert engine_config(args).max_prefill_tokens_while_decoding == 32
    assert engine_config(build_parser().parse_args(["generate"])).max_prefill_tokens_while_decoding is None


def test_serve_compiles_on_cpu_unless_told_not_to() -> None:
    assert SERVE_COMPILE == {"cpu": True}
    assert _config().use_default_compile_configs is True
    assert _config("--no-compile").use_default_compile_configs is False
    served = served_compile_config()
    assert _config().varlen_compile_config == _config().decode_compile_config == served
    assert served.options == {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    assert _config("--no-compile").decode_compile_config is None
    assert _config("--compile", device="cuda").use_default_compile_configs is True
    assert not _config(device="cuda").use_default_compile_configs
    for command in (["generate", "--input", "in.jsonl"], ["bench"]):
        assert not engine_config(build_parser().parse_args(command)).use_default_compile_configs


def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + ord(char) % 300 for char in text]


def test_the_warm_up_compiles_every_graph_the_server_then_meets() -> None:
    """After the warm-up, a lone request and a batch of requests (prefill and decode steps of one and of several
    requests) through the served manager compile nothing more, and their greedy tokens are `generate`'s."""
    model = _tiny_model()
    assert warm_up_before_serving(model, _Tokenizer(), ContinuousBatchingConfig()) is None
    assert SHARED_ATTRIBUTE not in model.__dict__
    config = _config("--block-size", "16", "--num-blocks", "64")
    seconds = warm_up_before_serving(model, _Tokenizer(), config)
    assert seconds is not None and seconds > 0
    (compiled,) = model.__dict__[SHARED_ATTRIBUTE].values()
    assert set(compiled.compile_seconds) == {"varlen", "decode"}
    graphs = counters["stats"]["unique_graphs"]
    prompts = [[5 + i + j for j in range(4 + 3 * i)] for i in range(5)]
    manager = ContinuousBatchingManager(model, GenerationConfig(eos_token_id=None), config)
    manager.start()
    try:
        outputs = [manager.get_result(manager.add_request(prompts[0], max_new_tokens=4), timeout=120)]
        ids = [manager.add_request(prompt, max_new_tokens=6) for prompt in prompts[1:]]
        outputs += [manager.get_result(request_id, timeout=120) for request_id in ids]
    finally:
        manager.stop(keep_for_next_session=True)
    assert counters["stats"]["unique_graphs"] == graphs
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output is not None
        reference = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=len(output.generated_tokens), do_sample=False, eos_token_id=None)
        assert output.generated_tokens == reference[0, len(prompt):].tolist()
    assert manager.engine.block_pool.is_whole


def _bloom(vocab_size: int) -> PreTrainedModel:
    """A tiny BLOOM: its layers run their own attention code, which contbatch cannot compute exactly."""
    torch.manual_seed(0)
    config = BloomConfig(vocab_size=vocab_size, hidden_size=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return BloomForCausalLM(config).eval()


def test_a_failed_warm_up_request_names_its_error() -> None:
    """Eager (no compile) too: the warm-up runs whatever the config, and a model contbatch cannot run fails it."""
    with pytest.raises(WarmUpFailed, match=r"a warm-up request failed: UnsupportedModelError: BloomForCausalLM: "
                                           r"0 of its 2 layers ran contbatch's paged attention"):
        warm_up_before_serving(_bloom(320), _Tokenizer(), ContinuousBatchingConfig())


def test_serve_exits_instead_of_listening_for_a_model_it_cannot_run(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    _bloom(len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "contbatch.cli", "serve", "--model", str(tmp_path), "--no-compile",
                           "--port", str(port)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 2
    assert ("contbatch serve: error: a warm-up request failed: UnsupportedModelError: BloomForCausalLM: 0 of its 2 "
            "layers") in done.stderr
    assert "Uvicorn running" not in done.stderr


def test_serve_commits_the_resident_cache_before_listening_unless_told_not_to(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["serve"]).commit_cache is True
    assert build_parser().parse_args(["serve", "--no-commit-cache"]).commit_cache is False
    manager = ContinuousBatchingManager(tiny_model("llama", "cpu"), GenerationConfig(do_sample=False, max_new_tokens=2),
                                        ContinuousBatchingConfig(block_size=16, num_blocks=48))
    commit_cache_before_serving(manager)
    assert "committed 48 KV cache blocks" in capsys.readouterr().err
    assert manager.commit_cache() == 0, "every resident block is committed already"
