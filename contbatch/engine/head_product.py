"""The output head's product through oneDNN without a fresh mapping for a large output.

A head's output above `head_buffer.REUSED_OUTPUT_BYTES` is a fresh mapping whose every page faults when first
written. oneDNN's float32 product cannot write into a given tensor, so the large output is assembled from smaller
products, each under the threshold (so glibc's heap reuses their memory), copied into the thread's buffer (inside
`head_buffer.reusing_logits`) or into one fresh output:

- a head whose row chunks would hold at least `HEAD_CHUNK_MIN_ROWS` rows (a vocabulary of up to 65,536 in
  float32) runs in row chunks over its one packed copy (`chunked_product`);
- a larger vocabulary is packed in column slices of at most `SLICE_COLUMNS` (`SlicedHead`), each a separate oneDNN
  copy of its rows of the weight, and every product runs slice by slice (`sliced_product`), so each slice's output
  stays small while the weight is still read once a product. Row chunks there would read the whole weight once a
  chunk of 55 rows (Qwen2's 151,936-token vocabulary at 128 rows).

On a Zen 5, 128 rows of Qwen2's head took 81 ms in slices against 100 ms as one product (whose 78 MB output
faulted 19,000 pages) and 95 ms in row chunks; 512 rows 311 against 391 and 367; 32 rows 27.0 against 26.6
(docs/performance.md, "a thirty-third session"). Slicing the output columns leaves each value's sum over k as it
is; row chunks leave a row's values as one product's where oneDNN blocks k alike for fewer rows (the embedded
model's head, Qwen2's); elsewhere they may differ in the last bits, as between batches of other sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contbatch.engine import head_buffer

HEAD_CHUNK_MIN_ROWS = 128
SLICE_COLUMNS = 8192


@dataclass(frozen=True)
class SlicedHead:
    """A head's weight packed for oneDNN in column slices: `packed[i]` holds output columns from `i * width` up to
    `(i + 1) * width` (the last one up to the vocabulary's end)."""

    width: int
    packed: tuple[torch.Tensor, ...]


def slices_head(vocab: int, dtype: torch.dtype) -> bool:
    """Whether a head of `vocab` outputs in `dtype` is packed in slices: its row chunks (`chunked_product`) would hold
    fewer than `HEAD_CHUNK_MIN_ROWS` rows, and it is wider than one slice."""
    return vocab > SLICE_COLUMNS and _chunk_rows(vocab, dtype.itemsize) < HEAD_CHUNK_MIN_ROWS


def pack_slices(weight: torch.Tensor) -> SlicedHead:
    """`weight` [vocab, K] packed for oneDNN in equal column slices of at most `SLICE_COLUMNS`."""
    vocab = weight.shape[0]
    count = -(-vocab // SLICE_COLUMNS)
    width = -(-vocab // count)
    packed = tuple(torch.ops.mkldnn._reorder_linear_weight(weight[start:start + width].contiguous(), None)
                   for start in range(0, vocab, width))
    return SlicedHead(width, packed)


def sliced_product(x: torch.Tensor, head: SlicedHead, bias: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """The head's product of `x` [rows, K]: in the thread's buffer where `head_buffer.logits_buffer` gives one, else
    a fresh tensor; computed slice by slice, in row chunks that keep each slice's output under the threshold."""
    out = head_buffer.logits_buffer(x.shape[0], vocab, x.dtype)
    if out is None:
        out = x.new_empty((x.shape[0], vocab))
    return _assembled(x, head.packed, head.width, bias, out, max(1, _chunk_rows(head.width, x.element_size())))


def chunked_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                    vocab: int) -> torch.Tensor | None:
    """oneDNN's head product of `x` [rows, K] in `head_buffer.logits_buffer`, in chunks of rows whose own outputs
    stay under `head_buffer.REUSED_OUTPUT_BYTES`, each copied into the buffer; None (not computed) where there is no
    buffer, or where a chunk would be under `HEAD_CHUNK_MIN_ROWS` rows (each chunk reads the whole weight again:
    Qwen2's head in chunks of 55 made sampled decode steps 3% slower). 512 rows of the embedded model's head (a
    prompt-logprobs step) took 65 ms so against 81 ms as one product on a Zen 5 (in bfloat16, 34 against 39 ms)."""
    step = _chunk_rows(vocab, x.element_size())
    out = head_buffer.logits_buffer(x.shape[0], vocab, x.dtype) if step >= HEAD_CHUNK_MIN_ROWS else None
    return None if out is None else _assembled(x, (packed,), vocab, bias, out, step)


def _assembled(x: torch.Tensor, parts: tuple[torch.Tensor, ...], width: int, bias: torch.Tensor | None,
               out: torch.Tensor, step: int) -> torch.Tensor:
    """`out` [rows, vocab] filled with oneDNN's products of `x` [rows, K], `step` rows at a time, by the packed
    `parts`, each holding `width` output columns (the last one up to the vocabulary's end)."""
    for first in range(0, x.shape[0], step):
        rows = x[first:first + step].contiguous()
        for start, packed in zip(range(0, out.shape[1], width), parts, strict=True):
            part_bias = None if bias is None else bias[start:start + width]
            out[first:first + step, start:start + width].copy_(
                torch.ops.mkldnn._linear_pointwise(rows, packed, part_bias, "none", [], ""))
    return out


def _chunk_rows(columns: int, itemsize: int) -> int:
    """The most rows whose output of `columns` stays below `head_buffer.REUSED_OUTPUT_BYTES` (one of exactly that
    size, with the allocator's few bytes of header, is already a fresh mapping)."""
    return (head_buffer.REUSED_OUTPUT_BYTES - 1) // (columns * itemsize)
