"""Tests for contbatch.engine.structured: grammar-constrained sampling with the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contbatch.data.embedded import embedded_model_dir
from contbatch.engine import structured
from contbatch.engine.structured import (
    GrammarCompiler,
    GrammarMatcher,
    StructuredOutput,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)

EOS = 2  # SmolLM2's <|im_end|>
PAD = 40  # logits wider than the tokenizer, and not a multiple of 32
MAX_STEPS = 3000
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tests' tensors are single rows: one thread avoids thread hand-offs on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded_model_dir(), local_files_only=True)


@pytest.fixture(scope="module")
def vocab(tokenizer: PreTrainedTokenizerBase) -> int:
    return len(tokenizer) + PAD


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase, vocab: int) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])


def allowed_ids(matcher: GrammarMatcher, vocab: int) -> set[int]:
    """Return the token ids `matcher` allows next, from a one-row bitmask."""
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab)
    apply_bitmask(logits, bitmask)
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def generate(matcher: GrammarMatcher, vocab: int, seed: int, bias: torch.Tensor | None = None) -> list[int]:
    """Sample from seeded random logits (+ `bias`) under the matcher's bitmask until a stop token; return the tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        logits = torch.randn(1, vocab, generator=generator)
        if bias is not None:
            logits += bias
        apply_bitmask(logits, fill_bitmasks([matcher], vocab))
        token = int(torch.multinomial(torch.softmax(logits[0], dim=-1), 1, generator=generator))
        assert matcher.accept(token)
        tokens.append(token)
        if token in matcher.stop_token_ids:
            assert matcher.is_terminated()
            return tokens
    raise AssertionError(f"no stop token after {MAX_STEPS} steps")


def text_of(tokenizer: PreTrainedTokenizerBase, tokens: list[int]) -> str:
    assert tokens[-1] == EOS and EOS not in tokens[:-1]
    return tokenizer.decode(tokens[:-1])


@pytest.mark.parametrize("seed", range(5))
def test_json_schema_output_validates(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, vocab: int, seed: int
) -> None:
    matcher = compiler.matcher(StructuredOutput(json_schema=SCHEMA))  # type: ignore[arg-type]
    value = json.loads(text_of(tokenizer, generate(matcher, vocab, seed)))
    assert set(value) == {"name", "age", "color", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert type(value["age"]) is int and value["age"] >= 18
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(tag, str) and len(tag) <= 5 for tag in value["tags"])


@pytest.mark.parametrize("seed", range(3))
def test_json_object_output_is_a_dict(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, vocab: int, seed: int
) -> None:
    # Free-form JSON can nest and grow strings for thousands of uniformly random steps: favour closing tokens.
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    bias = torch.zeros(vocab)
    bias[[i for i, piece in enumerate(pieces) if any(c in piece for c in '"}]')] + [EOS]] = 4.0
    text = text_of(tokenizer, generate(compiler.matcher(StructuredOutput(json_object=True)), vocab, seed, bias))
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", range(3))
def test_regex_output_fullmatches(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, vocab: int, seed: int
) -> None:
    pattern = r"\d{3}-[a-z]{2}"
    text = text_of(tokenizer, generate(compiler.matcher(StructuredOutput(regex=pattern)), vocab, seed))
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("seed", range(5))
def test_choice_output_is_one_of_the_choices(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, vocab: int, seed: int
) -> None:
    choices = ["yes", "no", 'he said "hi"', "new\nline", "ünï 😀"]
    spec = StructuredOutput(choice=choices)  # type: ignore[arg-type]
    assert spec.choice == tuple(choices)
    assert text_of(tokenizer, generate(compiler.matcher(spec), vocab, seed)) in choices


def test_every_choice_is_reachable(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase) -> None:
    choices = ("a", "ab", 'q"\\', "ünï 😀")
    for choice in choices:
        matcher = compiler.matcher(StructuredOutput(choice=choices))
        assert all(matcher.accept(token) for token in tokenizer.encode(choice))
        assert matcher.accept(EOS) and matcher.is_terminated()


def advanced(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, text: str) -> GrammarMatcher:
    """Return a JSON-schema matcher that accepted the tokens of `text`."""
    matcher = compiler.matcher(StructuredOutput(json_schema=SCHEMA))  # type: ignore[arg-type]
    assert all(matcher.accept(token) for token in tokenizer.encode(text))
    return matcher


def test_fill_bitmasks_equals_rows_filled_alone(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, vocab: int
) -> None:
    matchers = [
        advanced(compiler, tokenizer, ""),
        advanced(compiler, tokenizer, '{"name": "ab'),
        advanced(compiler, tokenizer, '{"name": "ab", "age": 3'),
        compiler.matcher(StructuredOutput(regex=r"\d{3}-[a-z]{2}")),
        compiler.matcher(StructuredOutput(choice=("yes", "no"))),
    ]
    batched = fill_bitmasks(matchers, vocab)
    alone = allocate_bitmask(len(matchers), vocab)
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(alone, row)
    assert torch.equal(batched, alone)
    assert len({tuple(row.tolist()) for row in batched}) == len(matchers)


def test_concurrent_compile_and_fill(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, vocab: int) -> None:
    prefixes = ["", '{"name": "', '{"name": "ab", "age": 3', '{"name": "a", "age": 20, "color": "']

    def masks(_: int) -> torch.Tensor:
        return fill_bitmasks([advanced(compiler, tokenizer, prefix) for prefix in prefixes], vocab)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(masks, range(8)))
    assert all(torch.equal(result, results[0]) for result in results)
    assert len({tuple(row.tolist()) for row in results[0]}) == len(prefixes)


def test_apply_bitmask_with_indices(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, vocab: int) -> None:
    matchers = [advanced(compiler, tokenizer, '{"name": "ab", "age": 3'), advanced(compiler, tokenizer, "")]
    bitmask = fill_bitmasks(matchers, vocab)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    original = logits.clone()
    apply_bitmask(logits, bitmask, indices=[3, 1])
    for row, matcher in ((3, matchers[0]), (1, matchers[1])):
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[sorted(allowed_ids(matcher, vocab))] = True
        assert torch.equal(logits[row][allowed], original[row][allowed])
        assert torch.isneginf(logits[row][~allowed]).all()
        assert 0 < int(allowed.sum()) < len(tokenizer)
    assert torch.equal(logits[[0, 2]], original[[0, 2]])


def test_padding_tokens_never_allowed(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, vocab: int
) -> None:
    states = [
        advanced(compiler, tokenizer, ""),
        advanced(compiler, tokenizer, '{"name": "'),
        advanced(compiler, tokenizer, '{"name": "a", "age": 20, "color": "red", "tags": []}'),
        compiler.matcher(StructuredOutput(json_object=True)),
    ]
    for matcher in states:
        assert max(allowed_ids(matcher, vocab)) < len(tokenizer)
        assert not matcher.accept(len(tokenizer)) and not matcher.accept(vocab)
    assert len(allowed_ids(states[1], vocab)) > 10_000


def test_fork_is_independent(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, vocab: int) -> None:
    matcher = advanced(compiler, tokenizer, '{"name": "ab", "age": ')
    forked = matcher.fork()
    before = allowed_ids(forked, vocab)
    assert allowed_ids(matcher, vocab) == before
    assert all(matcher.accept(token) for token in tokenizer.encode('42, "color": "'))
    assert allowed_ids(forked, vocab) == before != allowed_ids(matcher, vocab)
    assert all(forked.accept(token) for token in tokenizer.encode('19, "color": "blue"'))
    assert not matcher.accept(tokenizer.encode("7")[0])


def test_rejected_token_leaves_state_unchanged(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, vocab: int
) -> None:
    matcher = advanced(compiler, tokenizer, '{"name": "ab", "age": ')
    before = allowed_ids(matcher, vocab)
    for rejected in (tokenizer.encode("x")[0], tokenizer.encode('"')[0], EOS):
        assert rejected not in before
        assert not matcher.accept(rejected)
    assert allowed_ids(matcher, vocab) == before
    assert matcher.error is None and not matcher.is_terminated()
    assert all(matcher.accept(token) for token in tokenizer.encode('20, "color": "red", "tags": []}'))


def test_stop_only_when_complete_then_only_stop(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase) -> None:
    vocab = compiler.vocab_size
    matcher = compiler.matcher(StructuredOutput(regex=r"\d{3}-[a-z]{2}"))
    for token in tokenizer.encode("123-a"):
        assert EOS not in allowed_ids(matcher, vocab) and not matcher.is_terminated()
        assert matcher.accept(token)
    assert matcher.accept(tokenizer.encode("b")[0])
    assert matcher.is_complete() and matcher.is_terminated()
    assert allowed_ids(matcher, vocab) == {EOS}
    assert matcher.accept(EOS) and matcher.is_terminated()
    assert allowed_ids(matcher, vocab) == {EOS}
    assert not matcher.accept(tokenizer.encode("1")[0])
    row = fill_bitmasks([matcher], vocab)[0]
    assert int(row[0]) == 1 << EOS and not row[1:].any()


def test_several_stop_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [EOS, 0])
    matcher = compiler.matcher(StructuredOutput(choice=("yes",)))
    assert matcher.accept(tokenizer.encode("yes")[0])
    assert allowed_ids(matcher, len(tokenizer)) == {0, EOS}


def test_empty_stop_ids_fall_back_to_tokenizer_eos(tokenizer: PreTrainedTokenizerBase) -> None:
    assert GrammarCompiler(tokenizer, len(tokenizer), []).stop_token_ids == (EOS,)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(json_schema='{"type": "nonsense"}'), "(?s)invalid JSON schema: .*nonsense"),
        (StructuredOutput(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "invalid JSON"),
        (StructuredOutput(regex="(ab"), "(?s)invalid regex: .*unclosed group"),
        (StructuredOutput(regex="[a-"), "invalid regex"),
    ],
)
def test_invalid_grammar_raises(compiler: GrammarCompiler, spec: StructuredOutput, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.matcher(spec)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of .*got none"),
        ({"json_object": True, "regex": "a"}, "got json_object and regex"),
        ({"json_schema": {"type": "object"}, "choice": ("a",)}, "got json_schema and choice"),
        ({"json_schema": "not json"}, "json_schema is not valid JSON"),
        ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object"),
        ({"choice": ()}, "choice must not be empty"),
        ({"choice": []}, "choice must not be empty"),
        ({"choice": "ab"}, "choice must be a list or tuple"),
        ({"choice": ("a", 1)}, "choice must contain only strings"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json_object": 1}, "json_object must be a bool"),
    ],
)
def test_bad_structured_output_raises(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**kwargs)  # type: ignore[arg-type]


def test_schema_is_canonical_and_cached_matchers_are_independent(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    a = StructuredOutput(json_schema={"type": "object", "required": []})  # type: ignore[arg-type]
    b = StructuredOutput(json_schema='{ "type": "object",\n  "required": [] }')
    assert a == b and hash(a) == hash(b) and a.json_schema == '{"type":"object","required":[]}'
    assert a.kind == "json_schema" and StructuredOutput(choice=["x"]).kind == "choice"
    first, second = compiler.matcher(a), compiler.matcher(b)
    fresh = allowed_ids(second, compiler.vocab_size)
    assert first.accept(tokenizer.encode("{")[0])
    assert allowed_ids(second, compiler.vocab_size) == fresh != allowed_ids(first, compiler.vocab_size)


def test_properties_follow_the_schema_order(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase) -> None:
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
        "required": ["zeta", "alpha"],
    }
    matcher = compiler.matcher(StructuredOutput(json_schema=schema))  # type: ignore[arg-type]
    assert all(matcher.accept(token) for token in tokenizer.encode('{"zeta": 1, "alpha": 2}'))
    assert matcher.accept(EOS)
    swapped = compiler.matcher(StructuredOutput(json_schema=schema))  # type: ignore[arg-type]
    assert not all(swapped.accept(token) for token in tokenizer.encode('{"alpha": 2, "zeta": 1}'))


def test_bad_compiler_arguments(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GrammarCompiler(tokenizer, len(tokenizer) - 1, [EOS])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        GrammarCompiler(tokenizer, len(tokenizer), [len(tokenizer)])
    with pytest.raises(TypeError, match="StructuredOutput"):
        GrammarCompiler(tokenizer, len(tokenizer), [EOS]).matcher({"json_object": True})  # type: ignore[arg-type]


def test_fill_bitmasks_rejects_mismatches(compiler: GrammarCompiler, vocab: int) -> None:
    matcher = compiler.matcher(StructuredOutput(json_object=True))
    with pytest.raises(ValueError, match="appears twice"):
        fill_bitmasks([matcher, matcher], vocab)
    with pytest.raises(ValueError, match="vocab_size"):
        fill_bitmasks([matcher], vocab + 32)
    with pytest.raises(ValueError, match="columns"):
        matcher.fill_bitmask(allocate_bitmask(1, vocab + 32), 0)
    assert fill_bitmasks([], vocab).shape == (0, (vocab + 31) // 32)


def test_missing_library_names_the_extra(tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)
    assert StructuredOutput(regex="a").kind == "regex"
    assert allocate_bitmask(2, 70).shape == (2, 3)
    with pytest.raises(ImportError, match=r"contbatch\[structured\]"):
        GrammarCompiler(tokenizer, len(tokenizer), [EOS])


def test_module_imports_without_the_library() -> None:
    """No module-level import of llguidance (it is imported inside functions, or under `if TYPE_CHECKING:`)."""
    tree = ast.parse(Path(structured.__file__).read_text())
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert "torch" in imported and not [name for name in imported if name.startswith("llguidance")]
