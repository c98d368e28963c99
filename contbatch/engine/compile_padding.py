"""The inputs of a compiled forward padded so that none of their sizes is 0 or 1.

Dynamo specialises a dimension of size 0 or 1: a step with one token (a lone request decoding), or with fewer
than two logits rows (a single request's prefill chunk), would otherwise compile graphs of its own, each as
costly as the first (the embedded model: 6-19 s). Padded, every step of a run goes through the one graph.

Padding never changes a real token's result:
  - a lone token gets a padding request beside it, as a captured decode graph pads its bucket
    (`StaticDecodeInputs`): token 0 at position 0, its K/V written to and read from the cache's scratch slot,
    never a slot of a block in the pool;
  - missing logits rows repeat the last token's row; the caller keeps only the rows it asked for.
"""

from __future__ import annotations

import torch

from contbatch.engine.attention import PagedAttentionMetadata
from contbatch.engine.cuda_graphs import GraphKey, StaticDecodeInputs

MIN_SIZE = 2


def pad_for_compile(inputs: dict[str, torch.Tensor], metadata: PagedAttentionMetadata
                    ) -> tuple[dict[str, torch.Tensor], PagedAttentionMetadata]:
    """`inputs` ("input_ids" and "position_ids" [1, tokens], "logits_to_keep" [rows]) and `metadata` padded to
    at least `MIN_SIZE` tokens and rows, or themselves when they have as many. The logits of the padded inputs
    begin with the `rows` logits of the unpadded ones."""
    if inputs["input_ids"].shape[1] < MIN_SIZE:
        inputs, metadata = _pad_lone_token(inputs, metadata)
    keep = inputs["logits_to_keep"]
    if len(keep) < MIN_SIZE:
        last = keep.new_full((MIN_SIZE - len(keep),), inputs["input_ids"].shape[1] - 1)
        inputs = {**inputs, "logits_to_keep": torch.cat([keep, last])}
    return inputs, metadata


def _pad_lone_token(inputs: dict[str, torch.Tensor], metadata: PagedAttentionMetadata
                    ) -> tuple[dict[str, torch.Tensor], PagedAttentionMetadata]:
    (group,) = metadata.groups
    key = GraphKey(MIN_SIZE, tuple((layout.length, layout.first is not None) for layout in group.layouts))
    padded = StaticDecodeInputs(key, metadata.cache)
    padded.fill(inputs["input_ids"][0], inputs["position_ids"][0], metadata)
    return {**padded.inputs, "logits_to_keep": inputs["logits_to_keep"]}, padded.metadata
