"""Structured outputs: per-request grammar constraints enforced with a token bitmask, backed by `llguidance`.

A `StructuredOutput` names one request's constraint (JSON schema, any JSON object, regex or a choice of strings).
A `GrammarCompiler` (one per tokenizer) compiles it into a `GrammarMatcher`, which tracks the tokens generated so
far and writes the allowed set of the next token into a bitmask row: int32 words, bit `t % 32` of word `t // 32`
set when token `t` is allowed (`allocate_bitmask`). `fill_bitmasks` fills one row per matcher with llguidance's
multithreaded executor (the GIL is released); `apply_bitmask` sets the disallowed logits to -inf on any device.

A matcher allows a stop token only where the grammar is complete, and only stop tokens once it is complete and
cannot continue (`is_terminated`). Token ids at or above `len(tokenizer)` (padding of the logits width) are never
allowed. JSON is compact by default (`json.dumps` separators, no free whitespace); a schema may opt into flexible
whitespace with `"x-guidance": {"whitespace_flexible": true}`.

llguidance is imported lazily: this module imports without it, and compiling raises ImportError naming the extra.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from contbatch.engine.device_values import device_tensor

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher
    from transformers import PreTrainedTokenizerBase

INSTALL_HINT = (
    "Structured outputs need the `llguidance` package: install it with `pip install 'contbatch[structured]'` "
    "(or `pip install 'llguidance>=1.9,<1.10'`)."
)
DEFAULT_CACHE_SIZE = 256
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_KINDS = ("json_schema", "json_object", "regex", "choice")
_KIND_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice"}


def _import_llguidance() -> ModuleType:
    """Return the `llguidance` module (with its `hf` submodule loaded); ImportError with INSTALL_HINT if missing."""
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return llguidance


def bitmask_width(vocab_size: int) -> int:
    """Return the number of int32 words of one bitmask row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class StructuredOutput:
    """One request's output constraint: exactly one of the fields is set.

    json_schema: a JSON schema as a JSON string or a dict, which must be a JSON object; stored canonicalised as a
    compact JSON string so the dataclass stays hashable. Keys are not sorted: the output lists an object's
    properties in the schema's `properties` order, so two schemas differing only in that order are different.
    json_object: True for any JSON object. regex: a regular expression (Rust `regex` syntax, no lookarounds or
    backreferences) the whole output must match. choice: the output is exactly one of these strings (a tuple; a
    list is accepted and converted).

    Raises:
        ValueError: not exactly one field set, or a field of the wrong type or value (the message names it).
    """

    json_schema: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        set_fields = [name for name in _KINDS if _is_set(getattr(self, name))]
        if len(set_fields) != 1:
            got = " and ".join(set_fields) if set_fields else "none"
            raise ValueError(f"StructuredOutput needs exactly one of {', '.join(_KINDS)}; got {got}")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _canonical_schema(self.json_schema))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            object.__setattr__(self, "choice", _checked_choice(self.choice))

    @property
    def kind(self) -> str:
        """Return the name of the field that is set: "json_schema", "json_object", "regex" or "choice"."""
        return next(name for name in _KINDS if _is_set(getattr(self, name)))


def _is_set(value: object) -> bool:
    """Return True unless `value` is a field's unset default (None, or False for json_object)."""
    return value is not None and value is not False


def _canonical_schema(schema: object) -> str:
    """Return `schema` (a dict or a JSON string of an object) as compact JSON, key order kept; ValueError if not."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON object (a dict or its JSON string), got {schema!r}")
    try:
        return json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema is not JSON-serialisable: {exc}") from exc


def _checked_choice(choice: object) -> tuple[str, ...]:
    """Return `choice` (a list or tuple of strings) as a non-empty tuple; ValueError naming the bad value if not."""
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
        raise ValueError(f"choice must be a list or tuple of strings, got {choice!r}")
    if not choice:
        raise ValueError("choice must not be empty")
    bad = [item for item in choice if not isinstance(item, str)]
    if bad:
        raise ValueError(f"choice must contain only strings, got {bad[0]!r}")
    return tuple(choice)


def _grammar_for(spec: StructuredOutput, llg: ModuleType) -> str:
    """Return the llguidance grammar (a JSON string) of `spec`; ValueError if the library rejects its input."""
    builder = llg.LLMatcher
    try:
        if spec.json_schema is not None:
            return builder.grammar_from_json_schema(spec.json_schema, defaults=_JSON_DEFAULTS)
        if spec.json_object:
            return builder.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_DEFAULTS)
        if spec.regex is not None:
            return builder.grammar_from_regex(spec.regex)
    except ValueError as exc:
        raise ValueError(f"invalid {_KIND_NAMES[spec.kind]}: {exc}") from exc
    assert spec.choice is not None
    return builder.grammar_from_lark("start: " + " | ".join(json.dumps(item) for item in spec.choice))


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one tokenizer; thread-safe; caches compiled grammars (bounded LRU).

    Building it converts the tokenizer (~0.3 s for a 49k vocabulary): make one per model and keep it. Compiling a
    grammar takes ~1 ms for a typical JSON schema (the lexer is then built lazily while matching); a cached spec
    costs a ~10 µs copy.

    Args:
        tokenizer: a fast (Rust `tokenizers`-backed) Hugging Face tokenizer; byte-level BPE is supported.
        vocab_size: the model's logits width (>= len(tokenizer)); the ids from len(tokenizer) on are never allowed.
        stop_token_ids: the ids that end generation (EOS); once the grammar is complete only these are allowed.
            Empty means the tokenizer's `eos_token_id`.
        cache_size: how many compiled specs to keep (least recently used evicted); >= 0.

    Raises:
        ImportError: llguidance is not installed.
        ValueError: a slow tokenizer, vocab_size < len(tokenizer), no stop token, or a stop id outside the vocab.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        llg = _import_llguidance()
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size ({vocab_size}) is smaller than the tokenizer ({len(tokenizer)} tokens)")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        stops = list(dict.fromkeys(int(token) for token in stop_token_ids))
        if not stops and tokenizer.eos_token_id is not None:
            stops = [int(tokenizer.eos_token_id)]
        if not stops:
            raise ValueError("structured outputs need a stop token: pass stop_token_ids (the tokenizer has no EOS)")
        outside = [token for token in stops if not 0 <= token < vocab_size]
        if outside:
            raise ValueError(f"stop token ids {outside} are outside the vocabulary [0, {vocab_size})")
        try:
            self._tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stops)
        except ValueError as exc:
            raise ValueError(f"structured outputs need a fast (Rust `tokenizers`) tokenizer: {exc}") from exc
        self._llg = llg
        self.vocab_size = vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """Return a fresh matcher (nothing accepted yet) for `spec`, compiling it unless cached.

        Raises:
            TypeError: `spec` is not a StructuredOutput.
            ValueError: the spec's JSON schema, regex or choice is invalid, e.g. "invalid JSON schema: ...".
        """
        if not isinstance(spec, StructuredOutput):
            raise TypeError(f"spec must be a StructuredOutput, got {type(spec).__name__}")
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return GrammarMatcher(template.deep_copy(), self.vocab_size, self.stop_token_ids)
        template = self._compile(spec)
        with self._lock:
            if self._cache_size:
                self._cache[spec] = template
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return GrammarMatcher(template.deep_copy(), self.vocab_size, self.stop_token_ids)

    def _compile(self, spec: StructuredOutput) -> LLMatcher:
        """Return an unused llguidance matcher for `spec`; ValueError with the library's message if invalid."""
        grammar = _grammar_for(spec, self._llg)
        compiled = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        error = compiled.get_error()
        if error:
            raise ValueError(f"invalid {_KIND_NAMES[spec.kind]}: {error}")
        return compiled


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: use one matcher from one thread at a time
    (different matchers may be used from different threads, and `fill_bitmasks` fills many in parallel).

    Made by `GrammarCompiler.matcher` or `fork`, not directly.
    """

    def __init__(self, matcher: LLMatcher, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; return False, leaving the state unchanged, if the grammar rejects it.

        A stop token is accepted where the grammar is complete, and (as a no-op) again once terminated.
        """
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            return False
        if self._matcher.validate_tokens([token_id]) == 1:
            return self._matcher.consume_token(token_id)
        return token_id in self.stop_token_ids and self.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed set of the next token into row `row` of `bitmask` (from `allocate_bitmask`).

        Raises:
            ValueError: `bitmask` is not a contiguous CPU int32 [rows, bitmask_width(vocab_size)] tensor, or
                `row` is out of range.
        """
        _check_bitmask(bitmask, self.vocab_size)
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"row {row} is out of range for a bitmask of {bitmask.shape[0]} rows")
        one_row = bitmask.shape[1] * 4
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * one_row, one_row)

    def is_terminated(self) -> bool:
        """Return True once the grammar accepted a stop token, or is complete and only stop tokens remain.

        Also True when the library hit an internal limit (`error` is then set); only stop tokens are allowed.
        """
        return self._matcher.is_stopped()

    def is_complete(self) -> bool:
        """Return True if the output so far satisfies the grammar (a stop token would be allowed now)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """The library's error message if it hit an internal limit (e.g. lexer fuel), else None."""
        return self._matcher.get_error() or None

    def fork(self) -> GrammarMatcher:
        """Return an independent matcher in the same state (advancing either leaves the other unchanged)."""
        return GrammarMatcher(self._matcher.deep_copy(), self.vocab_size, self.stop_token_ids)


def _check_bitmask(bitmask: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless `bitmask` is a contiguous CPU int32 [rows, bitmask_width(vocab_size)] tensor."""
    width = bitmask_width(vocab_size)
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(
            f"bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
        )
    if bitmask.shape[1] != width or not bitmask.is_contiguous():
        raise ValueError(f"bitmask must be contiguous with {width} columns for {vocab_size} tokens")


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """Return a CPU int32 [rows, bitmask_width(vocab_size)] bitmask with every token allowed (all bits set)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: Sequence[int] | None = None) -> None:
    """Set, in place, the logits of the tokens `bitmask` disallows to -inf; other values are untouched.

    Args:
        logits: [N, vocab] floating-point logits on any device. Columns beyond the bitmask's bits are disallowed.
        bitmask: [R, width] int32 bitmask (moved to `logits.device`).
        indices: the distinct logits rows the bitmask rows apply to (bitmask row j -> logits row indices[j]);
            None: bitmask row i -> logits row i, R == N.

    Raises:
        ValueError: shapes, dtypes or indices do not fit.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D floating-point tensor, got {logits.dtype} {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)}")
    rows = list(range(logits.shape[0])) if indices is None else [int(i) for i in indices]
    if len(rows) != bitmask.shape[0]:
        raise ValueError(f"{bitmask.shape[0]} bitmask rows for {len(rows)} logits rows")
    if len(set(rows)) != len(rows) or any(not 0 <= i < logits.shape[0] for i in rows):
        raise ValueError(f"indices must be distinct rows of the {logits.shape[0]} logits rows, got {rows}")
    if not rows:
        return
    disallowed = ~_unpack(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    if indices is None:
        logits.masked_fill_(disallowed, float("-inf"))
        return
    index = device_tensor(rows, logits.device, torch.long)
    selected = logits.index_select(0, index).masked_fill_(disallowed, float("-inf"))
    logits.index_copy_(0, index, selected)


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Return the [R, vocab] bool "allowed" tensor of `bitmask`; tokens beyond its bits are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)


_EXECUTOR: LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> LLExecutor:
    """Return the process-wide llguidance executor (its thread pool is created on first use)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _import_llguidance().LLExecutor()
        return _EXECUTOR


def fill_bitmasks(matchers: Sequence[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """Return a new bitmask whose row j is the allowed set of `matchers[j]`, filled in parallel (GIL released).

    Raises:
        ValueError: a matcher was compiled for another vocab_size, or the same matcher appears twice.
    """
    bitmask = allocate_bitmask(len(matchers), vocab_size)
    if not matchers:
        return bitmask
    if len({id(matcher) for matcher in matchers}) != len(matchers):
        raise ValueError("the same GrammarMatcher appears twice in one fill_bitmasks call")
    for matcher in matchers:
        if matcher.vocab_size != vocab_size:
            raise ValueError(f"a matcher was compiled for vocab_size {matcher.vocab_size}, not {vocab_size}")
    pairs = [(matcher._matcher, row) for row, matcher in enumerate(matchers)]
    _executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))
    return bitmask
