"""Runs every causal LM model type of the installed transformers, built small from its default config, against
`generate`, one subprocess a type: `python tests/model_sweep.py [MODEL_TYPE ...]` prints a JSON line a type
(`[model_type, verdict, detail]`) and a count of the verdicts. A new transformers release can add model types,
or change how one attends: a "mismatch" is a model contbatch answers with wrong tokens instead of refusing it.

Verdicts: "match" (every prompt's greedy tokens equal `generate`'s), "mismatch", "refused" (the requests failed,
the detail is their error), "engine" (building the engine raised), "build" or "reference" (the small config could
not be built, or `generate` itself failed on it: nothing learned), "died" (a crash or the time limit)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from collections import Counter

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, initializer_range=0.2, num_hidden_layers=2, n_embd=64, n_layer=2,
             n_head=4, n_positions=1024, d_model=64, ffn_dim=128, num_layers=2, num_heads=4, head_dim=16,
             kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
             n_routed_experts=4, num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
             bos_token_id=0, eos_token_id=1, pad_token_id=2, decoder_start_token_id=0)
"""The config fields a small model takes, each set where the model type's default config has it."""
LATENT_SIZES = dict(head_dim=SIZES["qk_rope_head_dim"], num_key_value_heads=SIZES["num_attention_heads"])
"""Multi-head latent attention's: `head_dim` is the rotary part, and keys and values take every attention head."""
SECONDS = 150
MEMORY_BYTES = 8 << 30


def verdict(model_type: str) -> list[str]:
    """`[model_type, verdict, detail]` for one model type, in this process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers import PROMPT_LENGTHS, random_prompts, reference_generate, run_prompts

    try:
        default = AutoConfig.for_model(model_type)
        sizes = {k: v for k, v in SIZES.items() if _has(default, k)}
        if _has(default, "kv_lora_rank"):
            sizes.update(LATENT_SIZES)
        config = AutoConfig.for_model(model_type, **sizes)
        model = AutoModelForCausalLM.from_config(config).eval()
    except Exception as error:
        return [model_type, "build", repr(error)[:200]]
    try:
        references = [reference_generate(model, prompt, 8) for prompt in random_prompts(PROMPT_LENGTHS, seed=1)]
    except Exception as error:
        return [model_type, "reference", repr(error)[:200]]
    try:
        results = run_prompts(model, num_blocks=128)
    except Exception as error:
        return [model_type, "engine", repr(error)[:200]]
    errors = [result for result in results.values() if isinstance(result, str)]
    if errors:
        return [model_type, "refused", errors[0][:200]]
    same = [results[str(index)] == reference for index, reference in enumerate(references)]
    distinct = len({token for tokens in references for token in tokens})
    return [model_type, "match" if all(same) else "mismatch", f"{distinct} distinct tokens, {same}"]


def _has(config: object, name: str) -> bool:
    """Whether `config` has the field `name` (a heterogeneous config raises on a per-layer field's global value)."""
    try:
        getattr(config, name)
    except AttributeError:
        return False
    except RuntimeError:
        return True
    return True


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def sweep(model_types: list[str]) -> Counter[str]:
    """Runs `verdict` for each model type in a subprocess of its own; prints each line; counts the verdicts."""
    counts: Counter[str] = Counter()
    for model_type in model_types:
        try:
            done = subprocess.run([sys.executable, __file__, "--one", model_type], capture_output=True, text=True,
                                  timeout=SECONDS, preexec_fn=_limit_memory)
            lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
            row = json.loads(lines[-1]) if lines else [model_type, "died", done.stderr[-200:]]
        except subprocess.TimeoutExpired:
            row = [model_type, "died", f"over {SECONDS} s"]
        print(json.dumps(row), flush=True)
        counts[row[1]] += 1
    return counts


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    if sys.argv[1:2] == ["--one"]:
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
        print(json.dumps(verdict(sys.argv[2])))
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        print(dict(sweep(sys.argv[1:] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))))
