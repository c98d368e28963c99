"""`ContbatchLM`: lm-evaluation-harness's model `contbatch`, running every request of a call through one engine run.

lm-eval hands a backend all the requests of one kind at once; `HFLM` then sorts and batches them, `ContbatchLM`
submits them all to contbatch, which batches continuously and shares the KV blocks of common prefixes (the
context of a multiple-choice question is computed once for its choices). Tokenization, truncation, stop
sequences and `max_gen_toks` follow `HFLM` (see `conventions`), so greedy results equal the `hf` backend's.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import jinja2
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix, postprocess_generated_text, resolve_max_length
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

import contbatch
from contbatch import ContinuousBatchingConfig
from contbatch.data.embedded import default_device, load_model_and_tokenizer
from contbatch.integrations.lm_eval import conventions
from contbatch.integrations.lm_eval.generation import GenerationJob, run_generation

logger = logging.getLogger(__name__)

# Prefix caching shares whole blocks: few-shot prompts sharing their examples need blocks shorter than the default.
GENERATION_BLOCK_SIZE = 16
DEFAULT_MAX_LENGTH = 2048


@register_model("contbatch")
class ContbatchLM(TemplateLM):
    """lm-eval's `contbatch` model: `loglikelihood`, `loglikelihood_rolling` and `generate_until` on contbatch.

    Model arguments (`--model_args key=value,...` or `simple_evaluate(model_args={...})`):
        pretrained: a local model directory or `.gguf` file, or a loaded `PreTrainedModel`; default the embedded
            SmolLM2-135M-Instruct. Nothing is downloaded.
        tokenizer: a local tokenizer directory or a tokenizer; default the model's.
        dtype: "float32", "bfloat16", "float16", "auto" or a `torch.dtype`; default (and "auto") float32 on CPU,
            bfloat16 on CUDA.
        device: default CUDA when available, else CPU; a CUDA device on a machine without one falls back to CPU.
        max_length: the most tokens the model reads at once; default the model's positions
            (`max_position_embeddings`, as lm-eval's `resolve_max_length`).
        max_gen_toks: `generate_until`'s default number of new tokens (256, as `hf`).
        add_bos_token, prefix_token_id, chat_template_args: as lm-eval's `hf` backend.
        any `ContinuousBatchingConfig` field (`block_size`, `num_blocks`, `max_batch_tokens`, ...); without
            `block_size`, scoring uses `contbatch.loglikelihood`'s default and generation 16-token blocks.
        batch_size, max_batch_size: accepted and ignored: every request of a call is submitted at once.

    Raises:
        ValueError: an unknown model argument (named), a bad dtype, or `trust_remote_code=True`.
    """

    def __init__(self, pretrained: str | PreTrainedModel | None = None,
                 tokenizer: str | PreTrainedTokenizerBase | None = None, dtype: str | torch.dtype | None = None,
                 device: str | None = None, max_length: int | None = None, max_gen_toks: int = 256,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 chat_template_args: dict[str, Any] | None = None, batch_size: int | str | None = None,
                 max_batch_size: int | None = None, trust_remote_code: bool = False, **engine_kwargs: Any) -> None:
        super().__init__()
        unknown = sorted(set(engine_kwargs) - set(ContinuousBatchingConfig.field_names()))
        if unknown:
            raise ValueError(f"unknown model_args {unknown} for the contbatch backend (see ContbatchLM's docstring "
                             "and ContinuousBatchingConfig's fields)")
        if trust_remote_code:
            raise ValueError("trust_remote_code: the contbatch backend loads local models with transformers' own "
                             "classes only")
        self.engine_kwargs = dict(engine_kwargs)
        self.generation_engine_config = ContinuousBatchingConfig.from_sources(
            ContinuousBatchingConfig(block_size=GENERATION_BLOCK_SIZE), engine_kwargs)
        self.model, self.tokenizer = _load(pretrained, tokenizer, _torch_dtype(dtype), _usable_device(device))
        self._device = self.model.device
        self._max_length = max_length
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.chat_template_args = chat_template_args or {}

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token that conditions a context-less loglikelihood: `prefix_token_id`, else BOS, else EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return int(self._max_length)
        return resolve_max_length(self.model.config, self.tokenizer, default=DEFAULT_MAX_LENGTH)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """`HFLM.tok_encode`: special tokens as the tokenizer adds them (or as `add_bos_token` says), none added
        when the string already starts with the prefix token's text; optionally the last `left_truncate_len`."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return cast(str, self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat as one prompt string (`HFLM.apply_chat_template`: retried without the system turn when the
        template refuses one)."""
        def render(history: list[dict[str, str]]) -> str:
            return cast(str, self.tokenizer.apply_chat_template(
                history, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt, **self.chat_template_args))

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            logger.warning("The chat template failed; retrying without the system turn.")
            return render([message for message in chat_history if message["role"] != "system"])

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **_kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether it is the greedy continuation) per request, all scored in
        one engine run (`contbatch.loglikelihood`) after `HFLM`'s left truncation to `max_length`."""
        if not requests:
            return []
        pairs = [conventions.truncate_pair(context, continuation, self.max_length)
                 for _, context, continuation in requests]
        results = contbatch.loglikelihood(self.model, pairs, progress_bar=not disable_tqdm, **self.engine_kwargs)
        answers = [(float(logprob), bool(greedy)) for logprob, greedy in results]
        for (key, _, _), answer in zip(requests, answers, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The loglikelihood of each whole string after the prefix token, scored in `max_length` windows (lm-eval's
        rolling windows, as `HFLM`); the windows of all the strings go to one engine run."""
        strings = [request.args[0] for request in requests]
        windows = [conventions.rolling_windows(self.tok_encode(string), self.prefix_token_id, self.max_length)
                   for string in strings]
        flat: list[tuple[tuple[str, str] | None, list[int], list[int]]] = [
            (None, context, continuation) for request_windows in windows for context, continuation in request_windows]
        scores = iter(self._loglikelihood_tokens(flat, disable_tqdm=disable_tqdm))
        totals = []
        for string, request_windows in zip(strings, windows, strict=True):
            total = sum((next(scores)[0] for _ in request_windows), 0.0)
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """The continuation of each context, all generated in one engine run: greedy or sampled as its
        `gen_kwargs` say, ending at EOS, a stop sequence (`until`, plus the end-of-text string) or `max_gen_toks`
        new tokens, cut before the first stop sequence (lm-eval's `postprocess_generated_text`)."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        jobs = []
        for context, gen_kwargs in (request.args for request in requests):
            settings = conventions.generation_settings(gen_kwargs, eos, self.max_gen_toks)
            prompt = conventions.truncate_context(self.tok_encode(context), settings.max_new_tokens, self.max_length)
            jobs.append(GenerationJob(prompt, settings))
        outputs = run_generation(self.model, self.tokenizer, self.generation_engine_config, jobs, self._eos_token_ids(),
                                 progress_bar=not disable_tqdm)
        texts = []
        for (context, gen_kwargs), job, tokens in zip((r.args for r in requests), jobs, outputs, strict=True):
            text = postprocess_generated_text(self.tok_decode(tokens), job.settings.until, None)
            texts.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return texts

    def _eos_token_ids(self) -> list[int]:
        """The tokens that end a generation: the model's generation config's EOS tokens and the tokenizer's."""
        configured = self.model.generation_config.eos_token_id
        ids = configured if isinstance(configured, list) else [] if configured is None else [configured]
        return sorted({*ids, self.eot_token_id} - {None})

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records about the model in its results."""
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(self.model.dtype), "model_revision": "", "model_sha": ""}


def _torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must be 'auto' or a floating-point torch dtype name, got {dtype!r}")
    return value


def _usable_device(device: str | None) -> str | None:
    """`device`, or the default device when it names an accelerator this machine lacks (lm-eval's command line
    asks for "cuda:0" unless told otherwise)."""
    if device is None:
        return None
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        logger.warning("device %r is not available; using %s", device, default_device())
        return default_device()
    return device


def _load(pretrained: str | PreTrainedModel | None, tokenizer: str | PreTrainedTokenizerBase | None,
          dtype: torch.dtype | None, device: str | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model in eval mode and its tokenizer, from local files only."""
    if isinstance(pretrained, PreTrainedModel):
        model = pretrained.eval()
        source = tokenizer if tokenizer is not None else model.name_or_path
    else:
        model, own = load_model_and_tokenizer(None if pretrained is None else str(pretrained), dtype, device)
        source = tokenizer if tokenizer is not None else own
    if isinstance(source, PreTrainedTokenizerBase):
        return model, source
    return model, AutoTokenizer.from_pretrained(str(source), local_files_only=True)
