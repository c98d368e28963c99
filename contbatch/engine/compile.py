"""The model's forward under `torch.compile`, with contbatch's paged attention as one opaque custom op.

The stock model is compiled as it is; inside the graph each layer's attention is the op
`contbatch::paged_attention(query, key, value, layer, scaling, sliding_window, softcap, sinks)`, so the graph does
not break at attention. What the op needs beyond its tensors (block tables, slots, the cache) is the step's
`PagedAttentionMetadata`, which the model runner publishes for the duration of the forward (`step_metadata`):
it changes every step and must not become a guard or a constant of the graph.

Two compiled forwards are kept, as transformers keeps them: "decode" (every request computes one token) and
"varlen" (anything else), each from its `CompileConfig`. Shapes are dynamic (`dynamic=True` in the defaults), so
a run compiles a bounded number of graphs whatever its batch sizes: one per path config (paths of equal configs
share it). The model runner pads a step of one token, or of fewer than two logits rows, to two
(`compile_padding`), past the sizes dynamo specialises.
"""

from __future__ import annotations

import itertools
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import CompileConfig, GenerationConfig

from contbatch.engine.ops import define_op
from contbatch.engine.weights import WeightsFingerprint

if TYPE_CHECKING:
    from contbatch.engine.config import ContinuousBatchingConfig

COMPILED_MARKER = "compiled"
_compiles = itertools.count()
SHARED_ATTRIBUTE = "_contbatch_compiled"
_step = threading.local()


@contextmanager
def step_metadata(metadata: Any) -> Iterator[None]:
    """Makes `metadata` the current thread's step metadata for the compiled attention op."""
    _step.metadata = metadata
    try:
        yield
    finally:
        _step.metadata = None


def _paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
                     sliding_window: int, softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    from contbatch.engine.attention import paged_attention_for_layer

    metadata = getattr(_step, "metadata", None)
    if metadata is None:
        raise RuntimeError("contbatch::paged_attention ran outside a contbatch step")
    output = paged_attention_for_layer(layer, query, key, value, metadata, scaling, sliding_window or None,
                                       softcap or None, sinks)
    return output.contiguous()  # the strides the fake promises, whatever layout an attention kernel returned


def _paged_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
                          sliding_window: int, softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[3])


paged_attention_op = define_op(
    "paged_attention",
    "(Tensor query, Tensor key, Tensor value, int layer, float scaling, int sliding_window, float softcap, "
    "Tensor? sinks=None) -> Tensor",
    _paged_attention, _paged_attention_fake,
)
"""contbatch's paged attention of `layer` for the current step (`step_metadata`) as the op
`contbatch::paged_attention`: writes the layer's K/V into the cache and returns [1, tokens, heads, value head size].
`sliding_window` and `softcap` are 0 when unset; `sinks` ([heads] float32) are gpt-oss's attention sinks."""


def default_compile_config() -> CompileConfig:
    """The config `use_default_compile_configs` fills in: inductor, dynamic shapes, weights as graph inputs (a
    weight update needs no new compile). Inductor's freezing (`options={"freezing": True}`: weights folded into
    the graph and prepacked for oneDNN) is supported but not the default: on the README's benchmark it made the
    whole run slower on an AVX2 CPU, and every weight update recompiles."""
    return CompileConfig(dynamic=True, mode="default")


def served_compile_config() -> CompileConfig:
    """`default_compile_config()` for a model whose modules nothing changes while it is compiled, as `contbatch
    serve`'s: before each call dynamo checks guards on the inputs only, none on the model's `nn.Module`
    attributes (`torch.compiler.skip_guard_on_all_nn_modules_unsafe`). On a 2-core Zen 5 a call's guard check
    took 0.13 ms against 0.99 ms, about 2.5% of a 32-request decode step. A module changed after compiling (a
    train/eval switch, an adapter turned on or off, a hook) would then run the graph compiled before the change,
    which is why the library's own default keeps the guards. Where torch lacks the filter, the default config."""
    config = default_compile_config()
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    if skip is not None:
        config.options = {"guard_filter_fn": skip}
    return config


def compile_kwargs(config: CompileConfig) -> dict[str, Any]:
    """`torch.compile` keywords for `config` (torch takes `mode` or `options`, not both: options win). `freezing`
    is left out: inductor decides on it from its global config, which `torch.compile(options=...)` does not
    reach, so `CompiledForward` sets it around its calls instead (`compile_patch`)."""
    kwargs: dict[str, Any] = {"fullgraph": config.fullgraph, "dynamic": config.dynamic, "backend": config.backend}
    options = {key: value for key, value in (config.options or {}).items() if key != "freezing"}
    if options:
        kwargs["options"] = options
    else:
        kwargs["mode"] = config.mode
    return kwargs


@contextmanager
def compile_patch(config: CompileConfig) -> Iterator[None]:
    """The global compile settings of a call of a forward compiled from `config` (compilation happens in the first
    call, and in any recompile): dynamo's `specialize_float`, and inductor's `freezing` as `config.options` asks.
    The forwards' Python floats (norm epsilons, attention scalings, rotary factors) are constants of the model.
    Left symbolic, they are traced as inputs; inductor's pass that turns such floats into tensors then gives up on
    one of them, and dynamo traces and compiles the whole forward a second time (more than half of a compile)."""
    with ExitStack() as stack:
        stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
        if (config.options or {}).get("freezing"):
            import torch._inductor.config as inductor_config

            stack.enter_context(inductor_config.patch(freezing=True))
        yield


@dataclass
class CompiledForward:
    """The compiled forwards of one model: `paths` maps "decode" / "varlen" to the `CompileConfig` of each path
    that is compiled (a path absent runs eagerly). `compile_seconds[path]` is the wall time of that path's first
    call (compilation included), as `contbatch bench` reports it. `weights` is the fingerprint of the weights a
    frozen graph was compiled with (None until then)."""

    forward: Callable[..., Any]
    paths: dict[str, CompileConfig]
    compile_seconds: dict[str, float] = field(default_factory=dict)
    weights: WeightsFingerprint | None = None
    _compiled: dict[str, Callable[..., Any]] = field(default_factory=dict)

    def function(self, path: str) -> Callable[..., Any] | None:
        """The compiled forward of `path`, or None when that path runs eagerly."""
        if path not in self.paths:
            return None
        if path not in self._compiled:
            if self.freezes_weights and self.weights is None:
                self.weights = WeightsFingerprint.of(self.forward.__self__)  # type: ignore[attr-defined]
            forward = _fresh_code(self.forward) if self.freezes_weights else self.forward
            self._compiled[path] = torch.compile(forward, **compile_kwargs(self.paths[path]))
        return self._compiled[path]

    def __call__(self, path: str, **inputs: Any) -> Any:
        """Runs the compiled forward of `path` (which must be compiled) on `inputs`."""
        function = self.function(path)
        if function is None:
            raise ValueError(f"path {path!r} is not compiled")
        first = path not in self.compile_seconds
        start = time.perf_counter()
        with compile_patch(self.paths[path]):
            output = function(**inputs)
        if first:
            self.compile_seconds[path] = time.perf_counter() - start
        return output

    @property
    def freezes_weights(self) -> bool:
        """Whether a compiled path folds the weights into its graph (inductor's `freezing`)."""
        return any((config.options or {}).get("freezing") for config in self.paths.values())

    def reset(self) -> None:
        """Drops the compiled functions (after a weight update: frozen graphs hold the old weights); the next call
        of each path compiles again."""
        self._compiled.clear()
        self.compile_seconds.clear()
        self.weights = None


def _fresh_code(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling `forward`, with a code object of its own. Dynamo keeps compiled graphs on the code
    object it compiles: after `reset`, a graph compiled from `model.forward`'s own code could be found again,
    with the old frozen weights in it. The old graphs go when their function does."""
    def call(**inputs: Any) -> Any:
        return forward(**inputs)

    code = call.__code__.replace(co_name=f"contbatch_forward_{next(_compiles)}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def shared_compiled_forward(model: torch.nn.Module, paths: dict[str, CompileConfig]) -> CompiledForward:
    """The `CompiledForward` of `model` for `paths`, shared by every engine on the model (`generate_batch` builds
    an engine per call: it must not compile again). Kept on the model object (`_contbatch_compiled`), so it lives
    as long as the model. Frozen graphs whose weights changed since they were compiled are dropped first."""
    key = repr(sorted((name, config.to_dict()) for name, config in paths.items()))
    shared: dict[str, CompiledForward] = model.__dict__.setdefault(SHARED_ATTRIBUTE, {})
    compiled = shared.setdefault(key, CompiledForward(model.forward, paths))
    if compiled.weights is not None and not compiled.weights.matches(model):
        compiled.reset()
    return compiled


def compile_paths(varlen: CompileConfig | None, decode: CompileConfig | None, use_defaults: bool,
                  fallback: CompileConfig | None = None) -> dict[str, CompileConfig]:
    """The paths to compile, each from the first of (transformers' order): its explicit config; with
    `use_defaults`, `default_compile_config()`; `fallback` (the generation config's, `generation_compile_config`).
    A path with none of them is absent: it runs eagerly."""
    paths = {name: config for name, config in (("varlen", varlen), ("decode", decode)) if config is not None}
    for name in ("varlen", "decode"):
        if name in paths:
            continue
        if use_defaults:
            paths[name] = default_compile_config()
        elif fallback is not None:
            paths[name] = fallback
    return paths


def generation_compile_config(config: GenerationConfig) -> CompileConfig | None:
    """The compile config a resolved generation config gives the paths that have none of their own: its
    `compile_config`, unless it sets `disable_compile` (which turns off `generate`'s own compilation too)."""
    return None if config.disable_compile else config.compile_config


def engine_compile_paths(config: ContinuousBatchingConfig, generation_config: GenerationConfig
                         ) -> dict[str, CompileConfig]:
    """The paths an engine with `config` and the resolved `generation_config` compiles (`compile_paths`, the
    generation config's `compile_config` as the fallback)."""
    return compile_paths(config.varlen_compile_config, config.decode_compile_config,
                         config.use_default_compile_configs, generation_compile_config(generation_config))
