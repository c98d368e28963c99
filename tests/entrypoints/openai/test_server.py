"""`contbatch serve`, tested with the official `openai` client against a live server on 127.0.0.1."""

from __future__ import annotations

import copy
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.data.embedded import embedded_model_dir
from contbatch.data.prompts import chat_inputs
from contbatch.entrypoints.openai.app import create_app
from contbatch.entrypoints.openai.protocol import LOGPROB_FLOOR
from tests.helpers import run_threads

MODEL = "tiny-llama"


class LiveServer:
    """A uvicorn server in a thread, on a free loopback port."""

    def __init__(self, app: object) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class Served:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, api_key: str | None = None) -> None:
        torch.manual_seed(7)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             initializer_range=0.1)
        self.model = LlamaForCausalLM(config).eval()
        self.model.generation_config.eos_token_id = None
        self.reference_model = copy.deepcopy(self.model)
        self.tokenizer = tokenizer
        self.manager = ContinuousBatchingManager(
            self.model, GenerationConfig(eos_token_id=None),
            ContinuousBatchingConfig(block_size=16, num_blocks=256, max_batch_tokens=256))
        self.manager.start()
        self.live = LiveServer(create_app(self.manager, tokenizer, MODEL, api_key, max_body_bytes=64 * 1024))
        self.client = openai.OpenAI(base_url=f"{self.live.url}/v1", api_key=api_key or "unused", max_retries=0)

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = self.reference_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                                                do_sample=False, attention_mask=torch.ones(1, len(prompt_ids),
                                                                                           dtype=torch.long))
        return out[0, len(prompt_ids):].tolist()

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def wait_until_pool_whole(self) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.manager.stats.num_running == 0 and self.manager.engine.block_pool.is_whole:
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.live.stop()
        self.manager.stop()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="module")
def served(tokenizer: PreTrainedTokenizerBase) -> Iterator[Served]:
    server = Served(tokenizer)
    yield server
    server.close()


def chat_ids(served: Served, content: str) -> list[int]:
    return chat_inputs(served.tokenizer, [content])[0]


def test_models_health_and_metrics(served: Served) -> None:
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    assert httpx.get(f"{served.live.url}/health").status_code == 200
    metrics = httpx.get(f"{served.live.url}/metrics").text
    for name in ("contbatch_requests_running", "contbatch_requests_waiting", "contbatch_prompt_tokens_total",
                 "contbatch_generation_tokens_total", "contbatch_time_to_first_token_seconds",
                 "contbatch_inter_token_latency_seconds", "contbatch_kv_cache_usage_ratio"):
        assert name in metrics


def test_completion_and_chat_match_generate(served: Served) -> None:
    prompt = "The quick brown fox"
    ids = served.tokenizer(prompt)["input_ids"]
    completion = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0)
    assert completion.choices[0].text == served.text(served.greedy(ids, 7))
    assert completion.choices[0].finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(ids), 7)
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                                 max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == served.text(served.greedy(chat_ids(served, "Hi there"), 6))
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6


def test_streaming_equals_non_streaming_and_reports_usage(served: Served) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    stream = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    completion_stream = served.client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0,
                                                         stream=True)
    assert "".join(c.choices[0].text for c in completion_stream) == served.text(
        served.greedy(served.tokenizer("abc")["input_ids"], 5))


def test_stop_strings_cut_exactly_across_tokens(served: Served) -> None:
    ids = served.tokenizer("Once upon a time")["input_ids"]
    text = served.text(served.greedy(ids, 30))
    stop = text[9:13]
    expected = text[: text.find(stop)]
    for stream in (False, True):
        response = served.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30,
                                                    temperature=0, stop=[stop, "never-appears"], stream=stream)
        choices = [c.choices[0] for c in response] if stream else response.choices
        assert "".join(c.text for c in choices) == expected
        assert choices[-1].finish_reason == "stop"
    assert served.wait_until_pool_whole()


def test_n_samples_with_seed_differ_and_reproduce(served: Served) -> None:
    kwargs = dict(model=MODEL, prompt="Sample me", max_tokens=8, temperature=1.0, n=3, seed=11)
    first = served.client.completions.create(**kwargs)
    again = served.client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) > 1 and texts == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 24


def test_logprobs_and_top_logprobs(served: Served) -> None:
    ids = served.tokenizer("Numbers:")["input_ids"]
    completion = served.client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=4, temperature=0,
                                                  logprobs=3)
    tokens = served.greedy(ids, 4)
    with torch.inference_mode():
        logits = served.reference_model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    logprobs = completion.choices[0].logprobs
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs), expected, atol=1e-4, rtol=1e-4)
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(lp, abs=1e-5)
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True))
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(item.top_logprobs) == 2 for item in content)


def test_logprobs_mode_extra_body(served: Served) -> None:
    """`extra_body={"logprobs_mode": "processed"}` changes the logprobs, not the tokens (same seed), on both
    endpoints; tokens removed by top-k are reported at LOGPROB_FLOOR, never as an invalid JSON infinity."""
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="Importance ratios", max_tokens=6, temperature=1.6, seed=5,
                                  logprobs=2)
    raw = served.client.completions.create(**kwargs).choices[0]
    processed = served.client.completions.create(**kwargs, extra_body={"logprobs_mode": "processed"}).choices[0]
    assert processed.text == raw.text
    raw_lp, processed_lp = raw.logprobs.token_logprobs, processed.logprobs.token_logprobs
    assert all(-50 < lp <= 0 for lp in processed_lp)
    assert max(abs(a - b) for a, b in zip(raw_lp, processed_lp, strict=True)) > 1e-2
    chat_kwargs: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0.5, seed=3, logprobs=True)
    raw_chat = served.client.chat.completions.create(**chat_kwargs).choices[0]
    processed_chat = served.client.chat.completions.create(
        **chat_kwargs, extra_body={"logprobs_mode": "processed"}).choices[0]
    assert processed_chat.message.content == raw_chat.message.content
    assert max(abs(a.logprob - b.logprob) for a, b in zip(raw_chat.logprobs.content, processed_chat.logprobs.content,
                                                          strict=True)) > 1e-2
    certain = served.client.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=3,
                                               extra_body={"logprobs_mode": "processed", "top_k": 1}
                                               ).choices[0].logprobs
    assert certain.token_logprobs == [0.0, 0.0, 0.0]
    assert all(max(top.values()) == 0.0 and min(top.values()) == LOGPROB_FLOOR for top in certain.top_logprobs)
    assert served.wait_until_pool_whole()


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_an_unknown_logprobs_mode_is_a_400_naming_it(served: Served, endpoint: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "logprobs_mode": "foo"}
    body.update({"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    response = httpx.post(f"{served.live.url}/v1/{endpoint}", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and "logprobs_mode" in error["message"] and "'foo'" in error["message"]
    with pytest.raises(openai.BadRequestError, match="'foo'"):
        served.client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"logprobs_mode": "foo"})
    assert httpx.get(f"{served.live.url}/health").status_code == 200


def test_concurrent_requests_keep_their_own_sampling_parameters(served: Served) -> None:
    results: dict[str, object] = {}

    def run(name: str, **kwargs: object) -> None:
        results[name] = served.client.completions.create(model=MODEL, prompt="Same prompt", **kwargs)

    ids = served.tokenizer("Same prompt")["input_ids"]
    greedy_text = served.text(served.greedy(ids, 9))
    stop = greedy_text[3:6]
    threads = [
        threading.Thread(target=run, args=("greedy",), kwargs=dict(max_tokens=9, temperature=0)),
        threading.Thread(target=run, args=("stopped",), kwargs=dict(max_tokens=9, temperature=0, stop=stop)),
        threading.Thread(target=run, args=("short",), kwargs=dict(max_tokens=2, temperature=0)),
        threading.Thread(target=run, args=("hot",), kwargs=dict(max_tokens=9, temperature=2.0, top_p=1.0, seed=3)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results["greedy"].choices[0].text == greedy_text
    assert results["stopped"].choices[0].text == greedy_text[: greedy_text.find(stop)]
    assert results["short"].choices[0].text == served.text(served.greedy(ids, 2))
    assert results["short"].usage.completion_tokens == 2
    assert results["hot"].choices[0].text != greedy_text


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b'{"model": "other", "prompt": "x"}', 404, "model_not_found"),
        (b'{"model": "tiny-llama", "prompt": "x", "max_tokens": -5}', 422, "invalid_value"),
        (b'{"model": "tiny-llama", "prompt": "x", "max_tokens": 100000}', 400, "invalid_request"),
        (b'{"model": "tiny-llama", "prompt": "x", "temperature": "hot"}', 422, "invalid_value"),
        (b'{"model": "tiny-llama", "prompt": [1, 2, 99999999]}', 400, "invalid_request"),
        (b'{"model": "tiny-llama"}', 422, "invalid_value"),
        (b'{"model": "tiny-llama", "prompt": "' + b"word " * 600 + b'"}', 400, "invalid_request"),
        (b'{"model": "tiny-llama", "prompt": "' + b"x" * 70000 + b'"}', 413, "request_too_large"),
    ],
    ids=["malformed", "unknown-model", "negative-max", "huge-max", "wrong-type", "bad-token", "missing-prompt",
         "prompt-too-long", "oversized"],
)
def test_bad_requests_get_openai_errors_and_the_engine_lives(served: Served, body: bytes, status: int,
                                                             code: str) -> None:
    response = httpx.post(f"{served.live.url}/v1/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and "type" in error
    assert httpx.get(f"{served.live.url}/health").status_code == 200


def test_api_key_is_required_when_set(tokenizer: PreTrainedTokenizerBase) -> None:
    server = Served(tokenizer, api_key="sesame")
    try:
        assert [m.id for m in server.client.models.list().data] == [MODEL]
        for key in (None, "wrong"):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            response = httpx.get(f"{server.live.url}/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        wrong = openai.OpenAI(base_url=f"{server.live.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt="x", max_tokens=1)
    finally:
        server.close()


def test_64_streaming_clients_with_a_quarter_disconnecting(served: Served) -> None:
    prompts = [f"Client number {i} says" for i in range(64)]
    expected = {i: served.text(served.greedy(served.tokenizer(p)["input_ids"], 12)) for i, p in enumerate(prompts)}
    texts: dict[int, str] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            stream = served.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12 if i % 4 else 400,
                                                      temperature=0, stream=True)
            parts = []
            for chunk in stream:
                parts.append(chunk.choices[0].text)
                if i % 4 == 0 and len(parts) == 2:
                    stream.close()
                    return
            texts[i] = "".join(parts)
        except BaseException as error:
            errors.append(error)

    run_threads(client, 64)
    assert not errors
    assert texts == {i: expected[i] for i in range(64) if i % 4}
    assert served.wait_until_pool_whole(), "disconnected clients must free their blocks"
    assert httpx.get(f"{served.live.url}/health").status_code == 200


def test_health_is_503_once_the_engine_thread_is_dead(tokenizer: PreTrainedTokenizerBase) -> None:
    server = Served(tokenizer)
    try:
        def broken_step() -> list:
            raise RuntimeError("engine bug")

        server.manager.engine.step = broken_step  # type: ignore[method-assign]
        with pytest.raises(openai.InternalServerError):
            server.client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert httpx.get(f"{server.live.url}/health").status_code == 503
    finally:
        server.close()


def test_full_queue_answers_503_at_once(tokenizer: PreTrainedTokenizerBase) -> None:
    torch.manual_seed(8)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    manager = ContinuousBatchingManager(model, GenerationConfig(eos_token_id=None),
                                        ContinuousBatchingConfig(block_size=16, num_blocks=32, max_queue_size=1),
                                        queue_timeout=0.0)
    manager.add_request([1, 2, 3], "queued", max_new_tokens=2)  # not started: it stays waiting
    live = LiveServer(create_app(manager, tokenizer, MODEL))
    try:
        started = time.monotonic()
        response = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert response.status_code == 503 and "queue stayed full" in response.json()["error"]["message"]
        assert time.monotonic() - started < 5
    finally:
        live.stop()
        manager.stop()
