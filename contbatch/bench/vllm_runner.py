"""Run one throughput workload through vLLM (CPU build) and write the generated ids back as JSON.

A standalone script for the separate `.venv-peers` environment (`make bench-peers`), run by file path as
`python vllm_runner.py REQUEST.json RESULT.json`. It imports only the standard library and (inside `main`)
vllm, never contbatch, which is not installed in that environment; `contbatch.bench.vllm_peer` launches it.

Request (JSON object):
    model: local Hugging Face checkpoint directory.
    dtype: "float32", "bfloat16" or "float16".
    max_new_tokens: tokens to generate at most per prompt (> 0).
    eos_token_ids: token ids that end a request (greedy decoding stops at the first, which is kept).
    prompts: token-id prompts (non-empty lists of ints).
    kv_cache_gib: KV-cache size in GiB (an int > 0; vLLM's `VLLM_CPU_KVCACHE_SPACE`).
    warmup_prompts, warmup_new_tokens: the untimed warm-up (the first prompts, few tokens).
    warm_pass: true to warm up with the whole workload instead, vLLM's prefix cache reset before the timed call.
    enforce_eager: true to skip vLLM's torch.compile (default false: vLLM-CPU compiles with inductor).
    temperature, top_p, top_k: sampling (default 0.0, 1.0, 0: greedy); vLLM's meaning (top_k 0: no cut).
    samples: completions per prompt (default 1; vLLM's `n`, its prompt computed once and shared).
    block_size: tokens per block of vLLM's KV cache (default null: vLLM's own, 128 on a CPU in 0.32).

Result (JSON object): outputs (per prompt, in input order, its `samples` completions' generated ids, EOS
included), generate_s (wall seconds of the timed `LLM.generate` call only: model load, compilation and the
warm-up are excluded), load_s (seconds to construct `vllm.LLM`, compilation included), warmup_s, cached_tokens
(prompt tokens of the timed call that vLLM took from its prefix cache, summed over prompts), block_size (of
vLLM's KV cache, in tokens; null where the engine does not say), vllm_version and torch_version.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

_REQUIRED = {"model": str, "dtype": str, "max_new_tokens": int, "eos_token_ids": list, "prompts": list,
             "kv_cache_gib": int}
_DEFAULTS: dict[str, Any] = {"warmup_prompts": 2, "warmup_new_tokens": 4, "enforce_eager": False,
                             "warm_pass": False, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "samples": 1,
                             "block_size": None}
DTYPES = ("float32", "bfloat16", "float16")


def parse_request(text: str) -> dict[str, Any]:
    """Parse and check the request JSON `text`; return it with defaults filled in.

    Raises:
        ValueError: a field is missing, of the wrong type or out of range.
    """
    request = json.loads(text)
    if not isinstance(request, dict):
        raise ValueError("the request must be a JSON object")
    for key, kind in _REQUIRED.items():
        if not isinstance(request.get(key), kind) or isinstance(request.get(key), bool):
            raise ValueError(f"request field {key!r} must be a {kind.__name__}, got {request.get(key)!r}")
    if request["dtype"] not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {request['dtype']!r}")
    if request["max_new_tokens"] < 1 or request["kv_cache_gib"] < 1:
        raise ValueError("max_new_tokens and kv_cache_gib must be >= 1")
    if not all(isinstance(token, int) for token in request["eos_token_ids"]):
        raise ValueError("eos_token_ids must be a list of ints")
    for key in ("enforce_eager", "warm_pass"):
        if not isinstance(request.get(key, False), bool):
            raise ValueError(f"request field {key!r} must be a bool, got {request[key]!r}")
    _check_sampling({**_DEFAULTS, **request})
    samples = request.get("samples", 1)
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ValueError(f"request field 'samples' must be an int >= 1, got {samples!r}")
    block_size = request.get("block_size")
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1):
        raise ValueError(f"request field 'block_size' must be null or an int >= 1, got {block_size!r}")
    prompts = request["prompts"]
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty lists of ints")
    return {**_DEFAULTS, **request}


def _check_sampling(request: dict[str, Any]) -> None:
    """Raises ValueError when the request's temperature, top_p or top_k is of the wrong type or out of range."""
    temperature, top_p, top_k = request["temperature"], request["top_p"], request["top_k"]
    if not all(isinstance(value, int | float) and not isinstance(value, bool) for value in (temperature, top_p)):
        raise ValueError(f"temperature and top_p must be numbers, got {temperature!r} and {top_p!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature!r} and {top_p!r}")


def sampling_kwargs(request: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for at most `max_tokens` tokens that stop at (and keep) the
    first of the request's EOS ids, as contbatch and transformers do; no detokenization. Greedy at temperature
    0 (seed 0); else sampled with the request's temperature, top_p and top_k, drawing from the engine's seed (0):
    vLLM-CPU 0.32 fails a sampled request that has a seed of its own ("CPU Generator does not use offset")."""
    kwargs = {"n": int(request["samples"]), "temperature": float(request["temperature"]), "max_tokens": max_tokens,
              "stop_token_ids": list(request["eos_token_ids"]), "ignore_eos": False, "detokenize": False}
    if request["temperature"] == 0:
        return {**kwargs, "temperature": 0.0, "seed": 0}
    return {**kwargs, "top_p": float(request["top_p"]), "top_k": int(request["top_k"])}


def format_result(outputs: list[list[int]], generate_s: float, load_s: float, warmup_s: float,
                  versions: dict[str, str], cached_tokens: int = 0, block_size: int | None = None) -> str:
    """The result JSON text: the generated ids (prompt by prompt in input order, each prompt's samples in a
    row), the timings in seconds, the prompt tokens taken from the prefix cache and the KV cache's block size."""
    return json.dumps({"outputs": outputs, "generate_s": generate_s, "load_s": load_s, "warmup_s": warmup_s,
                       "cached_tokens": cached_tokens, "block_size": block_size, **versions})


def run(request: dict[str, Any]) -> str:
    """Load the model in vLLM, warm up (a whole untimed pass with `warm_pass`), time one `LLM.generate` over all
    prompts; return the result JSON text."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(request["kv_cache_gib"])
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    sized = {} if request["block_size"] is None else {"block_size": request["block_size"]}
    llm = LLM(model=request["model"], tokenizer=request["model"], dtype=request["dtype"], seed=0,
              enforce_eager=request["enforce_eager"], **sized)
    load_s = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    params = SamplingParams(**sampling_kwargs(request, request["max_new_tokens"]))
    warmup = SamplingParams(**sampling_kwargs(request, request["warmup_new_tokens"]))
    start = time.perf_counter()
    if request["warm_pass"]:
        llm.generate(prompts, params, use_tqdm=False)
        llm.reset_prefix_cache()
    else:
        llm.generate(prompts[: request["warmup_prompts"]], warmup, use_tqdm=False)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    outputs = [list(sample.token_ids) for result in results for sample in result.outputs]
    cached = sum(result.num_cached_tokens or 0 for result in results)
    versions = {"vllm_version": vllm.__version__, "torch_version": torch.__version__}
    cache_config = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
    return format_result(outputs, generate_s, load_s, warmup_s, versions, cached,
                         getattr(cache_config, "block_size", None))


def main(argv: list[str]) -> int:
    """`vllm_runner.py REQUEST.json RESULT.json`: run the request, write the result; return the exit status."""
    if len(argv) != 2:
        print("usage: vllm_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as handle:
        request = parse_request(handle.read())
    result = run(request)
    with open(argv[1], "w", encoding="utf-8") as handle:
        handle.write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
