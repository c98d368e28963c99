"""/v1/completions' four prompt forms, echo with prompt logprobs (checked against a plain forward of a deep copy),
score-only requests (max_tokens=0), the 400s of bad prompts in a list, and lm-evaluation-harness's real
`local-completions` client scoring (context, continuation) pairs against a live server."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contbatch.data.embedded import embedded_model_dir
from contbatch.entrypoints.openai.protocol import LOGPROB_FLOOR
from tests.entrypoints.openai.test_server import MODEL, Served
from tests.helpers import run_threads

ATOL = 1e-5


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    server = Served(AutoTokenizer.from_pretrained(embedded_model_dir()))
    yield server
    server.close()


def random_ids(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (length,), generator=generator).tolist() for length in lengths]


def forward_logprobs(served: Served, ids: list[int]) -> torch.Tensor:
    """Row i: log_softmax (float32) of a plain forward's logits at position i of `ids`."""
    with torch.inference_mode():
        logits = served.reference_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def expected_top(tokenizer: PreTrainedTokenizerBase, row: torch.Tensor, token_id: int, k: int) -> dict[str, float]:
    """OpenAI's legacy top dict of one position: the k most likely tokens plus the chosen one, by string."""
    values, ids = row.topk(k)
    entries: dict[str, float] = {}
    for i, value in [*zip(ids.tolist(), values.tolist(), strict=True), (token_id, row[token_id].item())]:
        key = tokenizer.decode([i])
        entries[key] = max(entries.get(key, value), value)
    return entries


def check_echoed_logprobs(served: Served, logprobs: Any, prompt: list[int], generated: list[int], k: int) -> None:
    """The choice's legacy logprobs hold its prompt then its generated tokens, each against a plain forward."""
    sequence = prompt + generated
    rows = forward_logprobs(served, sequence)
    assert logprobs.tokens == [served.tokenizer.decode([i]) for i in sequence]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = rows[:-1].gather(1, torch.tensor(sequence[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:]), expected, atol=ATOL, rtol=0)
    for position in range(1, len(sequence)):
        top = logprobs.top_logprobs[position]
        want = expected_top(served.tokenizer, rows[position - 1], sequence[position], k)
        assert top.keys() == want.keys()
        assert all(abs(top[key] - want[key]) <= ATOL for key in want)
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    assert all(offsets[i + 1] == offsets[i] + len(logprobs.tokens[i]) for i in range(len(prompt) - 1))


def completion_text(served: Served, prompt: list[int], generated: list[int]) -> str:
    return served.tokenizer.decode(prompt) + served.text(generated)


def test_every_prompt_form_gives_choices_in_prompt_order(served: Served) -> None:
    texts = ["The quick brown fox", "Once upon a time there", "Numbers: 1, 2,"]
    ids = [served.tokenizer(text)["input_ids"] for text in texts]
    greedy = [served.text(served.greedy(prompt, 5)) for prompt in ids]
    assert len(set(greedy)) == len(greedy)
    forms: list[tuple[Any, list[int]]] = [(texts[1], [1]), (texts, [0, 1, 2]), (ids[2], [2]), (ids, [0, 1, 2])]
    for prompt, which in forms:
        response = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, n=2)
        assert [c.index for c in response.choices] == list(range(2 * len(which)))
        assert [c.text for c in response.choices] == [greedy[p] for p in which for _ in range(2)]
        assert response.usage.prompt_tokens == sum(len(ids[p]) for p in which)
        assert response.usage.completion_tokens == 10 * len(which)
    assert served.wait_until_pool_whole()


@pytest.mark.parametrize("k", [1, 3])
def test_echo_logprobs_equal_a_plain_forward(served: Served, k: int) -> None:
    prompts = random_ids([7, 19], seed=k)
    response = served.client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0, echo=True,
                                                logprobs=k)
    assert len(response.choices) == 2
    for prompt, choice in zip(prompts, response.choices, strict=True):
        generated = served.greedy(prompt, 3)
        assert choice.text == completion_text(served, prompt, generated)
        check_echoed_logprobs(served, choice.logprobs, prompt, generated, k)
        assert choice.logprobs.text_offset[len(prompt)] == len(served.tokenizer.decode(prompt))
        assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == 26 and response.usage.completion_tokens == 6


def test_greedy_prompt_tokens_have_the_top_entry_lm_eval_compares(served: Served) -> None:
    """lm-eval's is_greedy: a prompt token equals max(top) exactly when it is the argmax there."""
    head = random_ids([6], seed=11)[0]
    prompt = head + served.greedy(head, 5)
    rows = forward_logprobs(served, prompt)
    is_argmax = [rows[i - 1].argmax().item() == prompt[i] for i in range(1, len(prompt))]
    assert all(is_argmax[-5:]) and not all(is_argmax)
    logprobs = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                                logprobs=1).choices[0].logprobs
    greedy = [lp == max(top.values()) for lp, top in zip(logprobs.token_logprobs[1:len(prompt)],
                                                          logprobs.top_logprobs[1:len(prompt)], strict=True)]
    assert greedy == is_argmax


def test_max_tokens_zero_scores_the_prompt_only(served: Served) -> None:
    prompts = random_ids([5, 12], seed=3)
    response = served.client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=2)
    for prompt, choice in zip(prompts, response.choices, strict=True):
        assert choice.finish_reason == "length" and choice.text == served.tokenizer.decode(prompt)
        assert len(choice.logprobs.tokens) == len(prompt)
        check_echoed_logprobs(served, choice.logprobs, prompt, [], 2)
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == 17
    plain = served.client.completions.create(model=MODEL, prompt="Nothing to add", max_tokens=0)
    assert plain.choices[0].text == "" and plain.choices[0].logprobs is None
    echoed = served.client.completions.create(model=MODEL, prompt="Repeat after me", max_tokens=0, echo=True)
    assert echoed.choices[0].text == "Repeat after me" and echoed.choices[0].logprobs is None
    assert served.wait_until_pool_whole()


def test_echo_without_logprobs_prepends_the_prompt_text(served: Served) -> None:
    ids = served.tokenizer("Echo this")["input_ids"]
    generated = served.text(served.greedy(ids, 4))
    response = served.client.completions.create(model=MODEL, prompt=["Echo this", "Echo this"], max_tokens=4,
                                                temperature=0, echo=True)
    assert [c.text for c in response.choices] == ["Echo this" + generated] * 2


def test_streamed_echo_equals_the_whole_response(served: Served) -> None:
    prompts = random_ids([4, 9], seed=5)
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, echo=True, logprobs=2)
    whole = served.client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    token_logprobs: dict[int, list[float | None]] = {}
    for chunk in served.client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
                token_logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens
        assert token_logprobs[choice.index] == choice.logprobs.token_logprobs


def test_concurrent_clients_with_tokenized_prompts(served: Served) -> None:
    prompts = random_ids([3 + 2 * i for i in range(12)], seed=21)
    results: dict[int, Any] = {}

    def client(i: int) -> None:
        pair = prompts[2 * i: 2 * i + 2]
        results[i] = served.client.completions.create(model=MODEL, prompt=pair, max_tokens=i % 2, temperature=0,
                                                      echo=True, logprobs=1)

    run_threads(client, 6)
    assert sorted(results) == list(range(6))
    for i, response in results.items():
        for prompt, choice in zip(prompts[2 * i: 2 * i + 2], response.choices, strict=True):
            generated = served.greedy(prompt, 1) if i % 2 else []
            check_echoed_logprobs(served, choice.logprobs, prompt, generated, 1)
    assert served.wait_until_pool_whole()


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"prompt": [[5, 6]], "logprobs": 21, "echo": True}, ["logprobs", "20", "21"]),
        ({"prompt": [[5, 6]], "prompt_logprobs": 21, "max_tokens": 0}, ["prompt_logprobs", "20", "21"]),
        ({"prompt": [[5, 6], list(range(100, 700))], "echo": True, "max_tokens": 0},
         ["prompt[1]", "600 tokens", "512 positions"]),
        ({"prompt": [[5, 6], [7] * 500], "echo": True, "max_tokens": 16}, ["prompt[1]", "512 positions"]),
        ({"prompt": [[5, 6], [], [7]]}, ["prompt[1]", "empty"]),
        ({"prompt": ["fine", ""]}, ["prompt[1]", "empty"]),
        ({"prompt": [[5, 6], [7, 8], [9, 10**7]], "echo": True, "logprobs": 1}, ["prompt[2]", "10000000",
                                                                                  "vocabulary"]),
        ({"prompt": [-1, 5]}, ["-1", "vocabulary"]),
    ],
    ids=["logprobs-above-20", "prompt-logprobs-above-20", "echo-longer-than-positions", "prompt-and-tokens-too-long",
         "empty-in-list", "empty-string-in-list", "out-of-vocabulary-in-list", "negative-id"],
)
def test_a_bad_prompt_is_a_400_naming_it_and_nothing_runs(served: Served, body: dict[str, Any], named: list[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    client = served.live.server.config.app.state.contbatch.async_client
    submitted: list[Any] = []
    submit = client.submit
    monkeypatch.setattr(client, "submit", lambda *args, **kwargs: submitted.append(args) or submit(*args, **kwargs))
    response = httpx.post(f"{served.live.url}/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error"
    assert all(part in error["message"] for part in named), error["message"]
    assert submitted == []
    assert served.manager.stats.num_running == 0 and served.manager.stats.num_waiting == 0
    assert httpx.get(f"{served.live.url}/health").status_code == 200


def test_lm_eval_local_completions_scores_against_a_plain_forward(served: Served) -> None:
    """lm-eval's own `local-completions` model (tokenized requests, its default; the remote tokenizer it
    detects on the server) scores (context, continuation) pairs: each (logprob, is_greedy) is a plain forward's.
    lm-eval is imported here, so the other tests of this module run without it."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.utils import check_remote_tokenizer_support

    pairs = [("The capital of France is", " Paris"), greedy_pair(served), ("Question: 2 + 2 =", " 4"),
             ("A B C", " D E F G"), ("Tokens of a longer context, with punctuation;", " and a reply.")]
    base_url = f"{served.live.url}/v1/completions"
    assert check_remote_tokenizer_support(base_url)
    lm = LocalCompletionsAPI(base_url=base_url, model=MODEL, batch_size=2, max_retries=1, timeout=60)
    assert lm.tokenizer_backend == "remote" and lm.tokenized_requests
    results = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                               disable_tqdm=True)
    expected = [reference_score(served, *pair) for pair in pairs]
    assert any(greedy for _, greedy in expected) and not all(greedy for _, greedy in expected)
    assert [greedy for _, greedy in results] == [greedy for _, greedy in expected]
    for (logprob, _), (want, _) in zip(results, expected, strict=True):
        assert math.isfinite(logprob) and logprob > LOGPROB_FLOOR
        assert logprob == pytest.approx(want, abs=1e-4)
    contexts = ["Once upon a time", "Question: 2 + 2 =", "A B C"]
    options = {"until": ["never-appears"], "max_gen_toks": 6}
    generated = lm.generate_until([Instance("generate_until", {}, (context, dict(options)), i)
                                   for i, context in enumerate(contexts)], disable_tqdm=True)
    assert generated == [served.text(served.greedy(served.tokenizer(c, add_special_tokens=False)["input_ids"], 6))
                         for c in contexts]


def greedy_pair(served: Served) -> tuple[str, str]:
    """A (context, continuation) whose continuation is the model's greedy one and tokenizes back to the same ids
    after the context (so lm-eval's split scores exactly the greedy tokens)."""
    tokenizer = served.tokenizer
    for context in ("Once upon a time", "The weather today", "In the beginning", "Hello, my name is", "def f(x):"):
        context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        for length in (3, 2, 1):
            continuation = tokenizer.decode(served.greedy(context_ids, length))
            whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
            if continuation.strip() and whole == context_ids + served.greedy(context_ids, length):
                return context, continuation
    raise AssertionError("no greedy continuation tokenizes back to itself")


def reference_score(served: Served, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's split (the whole text encoded, the context's tokens first, no special tokens) scored by a plain
    forward: the continuation's summed logprob and whether each of its tokens is the argmax."""
    whole = served.tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    start = len(served.tokenizer(context, add_special_tokens=False)["input_ids"])
    rows = forward_logprobs(served, whole)
    scored = range(start, len(whole))
    logprob = sum(rows[j - 1, whole[j]].item() for j in scored)
    return logprob, all(rows[j - 1].argmax().item() == whole[j] for j in scored)


def test_several_prompts_share_one_failure_free_engine(served: Served) -> None:
    """A list of prompts whose choices run interleaved with another client's request."""
    prompts = random_ids([30, 31, 32, 33], seed=9)
    other: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: other.update(r=served.client.completions.create(
        model=MODEL, prompt="Meanwhile", max_tokens=20, temperature=0)))
    thread.start()
    response = served.client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, temperature=0, echo=True,
                                                logprobs=1)
    thread.join(timeout=60)
    for prompt, choice in zip(prompts, response.choices, strict=True):
        check_echoed_logprobs(served, choice.logprobs, prompt, served.greedy(prompt, 2), 1)
    assert other["r"].choices[0].text == served.text(served.greedy(served.tokenizer("Meanwhile")["input_ids"], 20))


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_prompt_logprobs_field_equals_a_plain_forward(served: Served, stream: bool) -> None:
    """vLLM's extra `prompt_logprobs=k`: per prompt token None (the first) or {id: logprob, rank, decoded_token}
    for the token and the k most likely, beside echo's legacy logprobs asking a different k; streamed, the
    first chunk of the choice carries it."""
    prompt = random_ids([9], seed=21)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1, "prompt_logprobs": 3,
            "stream": stream}
    response = httpx.post(f"{served.live.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        choice = chunks[0]["choices"][0]
        assert all("prompt_logprobs" not in chunk["choices"][0] for chunk in chunks[1:])
    else:
        choice = response.json()["choices"][0]
    entries = choice["prompt_logprobs"]
    rows = forward_logprobs(served, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        row, token = rows[position - 1], prompt[position]
        values, ids = row.topk(3)
        expected = {i: (v, rank) for rank, (i, v) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), 1)}
        expected.setdefault(token, (row[token].item(), None))
        got = entries[position]
        assert {int(key) for key in got} == set(expected)
        for key, value in got.items():
            logprob, rank = expected[int(key)]
            assert abs(value["logprob"] - logprob) <= ATOL and value["rank"] == rank
            assert value["decoded_token"] == served.tokenizer.decode([int(key)])
    assert len(choice["logprobs"]["top_logprobs"][1]) <= 2, "echo's legacy dict keeps its own k=1 (+ the token)"
    assert served.wait_until_pool_whole()
