"""The cost of structured outputs: the same GSM8K prompts, asking for a JSON answer, generated with and without
a JSON schema enforced, runs interleaved in one process."""

from __future__ import annotations

import json
import time
from typing import cast

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contbatch import ContinuousBatchingConfig, StructuredOutput
from contbatch.api import generate_batch
from contbatch.bench.throughput import BenchResult
from contbatch.bench.workloads import questions_after
from contbatch.engine.generation_config import as_ids
from contbatch.engine.structured import GrammarCompiler, apply_bitmask, fill_bitmasks

ANSWER_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["reasoning", "answer"],
    "properties": {"reasoning": {"type": "string", "maxLength": 600}, "answer": {"type": "number"}},
}
JSON_INSTRUCTION = ('Solve the problem. Reply with one JSON object and nothing else: {"reasoning": "<your steps>", '
                    '"answer": <the final number>}.')


def json_inputs(tokenizer: PreTrainedTokenizerBase, num_requests: int) -> list[list[int]]:
    """GSM8K questions with a system prompt asking for a JSON answer, chat-templated."""
    return questions_after(tokenizer, JSON_INSTRUCTION, num_requests)


def is_answer(text: str) -> bool:
    """Whether `text` is a JSON object with a string `reasoning` and a numeric `answer` and nothing else."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"reasoning", "answer"} and isinstance(value["reasoning"], str)
            and isinstance(value["answer"], (int, float)) and not isinstance(value["answer"], bool))


def grammar_seconds(compiler: GrammarCompiler, spec: StructuredOutput, outputs: list[list[int]],
                    vocab_size: int) -> float:
    """The time the grammar work of a run takes alone: its outputs replayed step by step as the engine runs
    them (one batched bitmask fill and one masking of [active, vocab] logits per step, then each active
    output's token accepted). Host drift between runs cannot bias it, nor can outputs of other lengths."""
    matchers = [compiler.matcher(spec) for _ in outputs]
    logits = torch.zeros((len(outputs), vocab_size))
    start = time.perf_counter()
    for step in range(max(map(len, outputs), default=0)):
        active = [i for i, tokens in enumerate(outputs) if len(tokens) > step]
        bitmask = fill_bitmasks([matchers[i] for i in active], vocab_size)
        apply_bitmask(logits, bitmask, active)
        for i in active:
            matchers[i].accept(outputs[i][step])
    return time.perf_counter() - start


def run_structured(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, inputs: list[list[int]],
                   max_new_tokens: int, eos: int | list[int], config: ContinuousBatchingConfig,
                   rounds: int = 2) -> list[tuple[BenchResult, int, float | None]]:
    """`rounds` runs of each setting, off then on, interleaved (after one untimed warm-up of each); every result
    with how many of its outputs are valid answers (`is_answer`) and, for an enforced run, the seconds its
    grammar work takes replayed alone (`grammar_seconds`; None for the others)."""
    generation = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos)
    schema = StructuredOutput(json_schema=ANSWER_SCHEMA)
    for constraint in (None, schema):
        generate_batch(model, inputs[:2], generation, config, progress_bar=False, max_new_tokens=4,
                       tokenizer=tokenizer, structured_output=constraint)
    results = []
    for _ in range(rounds):
        for constraint in (None, schema):
            start = time.perf_counter()
            outputs = generate_batch(model, inputs, generation, config, progress_bar=False, tokenizer=tokenizer,
                                     structured_output=constraint)
            wall = time.perf_counter() - start
            texts = [cast(str, tokenizer.decode(o.generated_tokens, skip_special_tokens=True))
                     for o in outputs.values()]
            name = f"contbatch, JSON schema {'enforced' if constraint else 'off'}"
            result = BenchResult(name, wall, sum(len(o.generated_tokens) for o in outputs.values()),
                                 sum(map(len, inputs)))
            grammar = None
            if constraint is not None:
                vocab_size = cast(torch.nn.Embedding, model.get_input_embeddings()).num_embeddings
                compiler = GrammarCompiler(tokenizer, vocab_size, as_ids(eos))
                grammar = grammar_seconds(compiler, constraint, [o.generated_tokens for o in outputs.values()],
                                          compiler.vocab_size)
            results.append((result, sum(is_answer(text) for text in texts), grammar))
    return results
