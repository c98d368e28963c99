"""/tokenize, /detokenize and /tokenizer_info at the server root (vLLM's shapes), with the embedded model's real
tokenizer, and lm-evaluation-harness's remote tokenizer reading them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from transformers import AutoTokenizer

from contbatch.data.embedded import embedded_model_dir
from tests.entrypoints.openai.test_server import MODEL, Served

TEXTS = ["Hello world, 123!", "  leading spaces and\nnew lines\t", "Ünïcödé — 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    server = Served(AutoTokenizer.from_pretrained(embedded_model_dir()), api_key="sesame")
    yield server
    server.close()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_detokenize_round_trip(served: Served, text: str) -> None:
    for special in (True, False):
        response = httpx.post(f"{served.live.url}/tokenize",
                              json={"model": MODEL, "prompt": text, "add_special_tokens": special})
        assert response.status_code == 200
        body = response.json()
        assert body["tokens"] == served.tokenizer(text, add_special_tokens=special)["input_ids"]
        assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 512
        back = httpx.post(f"{served.live.url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_defaults_to_special_tokens_and_agrees_with_completions(served: Served) -> None:
    text = "The same prompt"
    tokens = httpx.post(f"{served.live.url}/tokenize", json={"prompt": text}).json()["tokens"]
    assert tokens == served.tokenizer(text)["input_ids"]
    completion = served.client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert completion.usage.prompt_tokens == len(tokens)


def test_tokenizer_info_describes_the_tokenizer(served: Served) -> None:
    info = httpx.get(f"{served.live.url}/tokenizer_info").json()
    tokenizer = served.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["eos_token_id"] == tokenizer.eos_token_id
    assert info["bos_token"] == tokenizer.bos_token and info["pad_token"] == tokenizer.pad_token
    assert info["chat_template"] == tokenizer.chat_template and "im_start" in info["chat_template"]
    assert info["max_model_len"] == info["model_max_length"] == 512
    assert info["vocab_size"] == len(tokenizer)


@pytest.mark.parametrize(
    ("path", "body", "status", "named"),
    [
        ("/detokenize", {"tokens": [5, 10**9]}, 400, ["tokens[1]", "1000000000", "vocabulary"]),
        ("/detokenize", {"tokens": [-3]}, 400, ["tokens[0]", "-3"]),
        ("/detokenize", {"tokens": ["a"]}, 422, ["tokens"]),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, ["'other'"]),
        ("/tokenize", {"prompt": 5}, 422, ["prompt"]),
    ],
    ids=["out-of-vocabulary", "negative", "not-an-int", "unknown-model", "not-a-string"],
)
def test_bad_tokenizer_requests_are_named(served: Served, path: str, body: dict, status: int,
                                          named: list[str]) -> None:
    response = httpx.post(f"{served.live.url}{path}", json=body)
    assert response.status_code == status
    message = response.json()["error"]["message"]
    assert all(part in message for part in named), message


def test_lm_eval_remote_tokenizer_reads_the_server(served: Served) -> None:
    """lm-eval's `RemoteTokenizer` (what `local-completions` uses when it detects these routes): encode, decode,
    special ids and the chat template all agree with the tokenizer the server holds. The routes need no API key,
    as vLLM's: lm-eval probes them without one."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    base_url = f"{served.live.url}/v1/completions"
    assert check_remote_tokenizer_support(base_url)
    remote = RemoteTokenizer(base_url, timeout=30)
    tokenizer = served.tokenizer
    for text in TEXTS:
        assert remote.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert remote.decode(remote.encode(text)) == text
    assert remote.eos_token_id == tokenizer.eos_token_id and remote.bos_token_id == tokenizer.bos_token_id
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert remote.apply_chat_template(messages) == tokenizer.apply_chat_template(messages, tokenize=False,
                                                                                 add_generation_prompt=True)
    assert httpx.get(f"{served.live.url}/v1/models").status_code == 401
