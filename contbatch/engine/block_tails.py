"""`BlockTails`: the cached full blocks that follow each cached prefix, with their tokens, so that a prompt whose
cached prefix ends inside a block can still take the leading tokens it shares with a cached block there.

Prefix caching shares whole blocks: a prompt that agrees with a cached one for 24 tokens shares one 16-token block
and computes the other 8 again, in every request (a chat template's system turn, a few-shot preamble, n samples of
one prompt sent as n requests). With this index the manager finds a cached block under the same prefix whose tokens
start with the longest run of the new prompt's next tokens, and the request copies that block (its keys and values,
in every layer) into a block of its own and computes only what follows the run.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from contbatch.engine.block_pool import BlockHash

MIN_SWEEP = 1024

Entry = tuple[tuple[int, ...], BlockHash]


class BlockTails:
    """Cached full blocks by the hash of the prefix before them (None for a sequence's first block), each under
    its tokens, kept sorted so that the longest common run with a query is found at its insertion point.

    The index does not see evictions: `longest_match` skips and forgets blocks that `is_cached` says have left
    the cache, and `add` sweeps all of them whenever the index has doubled since the last sweep, so it holds at
    most about twice as many entries as the prefix cache holds blocks."""

    def __init__(self) -> None:
        self._children: dict[BlockHash | None, list[Entry]] = {}
        self._size = 0
        self._sweep_at = MIN_SWEEP

    def __len__(self) -> int:
        return self._size

    def add(self, parent: BlockHash | None, block_hash: BlockHash, tokens: Sequence[int],
            is_cached: Callable[[BlockHash], bool]) -> None:
        """Records that the cached block `block_hash` holds `tokens` after the prefix `parent`."""
        entries = self._children.setdefault(parent, [])
        entry = (tuple(tokens), block_hash)
        position = bisect.bisect_left(entries, entry)
        if position < len(entries) and entries[position] == entry:
            return
        entries.insert(position, entry)
        self._size += 1
        if self._size > self._sweep_at:
            self._sweep(is_cached)

    def longest_match(self, parent: BlockHash | None, query: Sequence[int],
                      is_cached: Callable[[BlockHash], bool]) -> tuple[BlockHash, int] | None:
        """The cached block after `parent` whose tokens start with the longest run of `query` (at least its first
        token; `query` is shorter than a block), with that run's length; None if no cached block starts so."""
        entries = self._children.get(parent)
        key = (tuple(query),)
        while entries:
            position = bisect.bisect_left(entries, key)
            best, best_length = -1, 0
            for index in (position, position - 1):
                if 0 <= index < len(entries):
                    length = _common_length(entries[index][0], key[0])
                    if length > best_length:
                        best, best_length = index, length
            if best < 0:
                return None
            block_hash = entries[best][1]
            if is_cached(block_hash):
                return block_hash, best_length
            del entries[best]
            self._size -= 1
        if entries is not None:
            del self._children[parent]
        return None

    def clear(self) -> None:
        self._children.clear()
        self._size = 0
        self._sweep_at = MIN_SWEEP

    def _sweep(self, is_cached: Callable[[BlockHash], bool]) -> None:
        for parent in list(self._children):
            kept = [entry for entry in self._children[parent] if is_cached(entry[1])]
            if kept:
                self._children[parent] = kept
            else:
                del self._children[parent]
        self._size = sum(map(len, self._children.values()))
        self._sweep_at = max(MIN_SWEEP, 2 * self._size)


def _common_length(tokens: tuple[int, ...], query: tuple[int, ...]) -> int:
    length = 0
    for a, b in zip(tokens, query, strict=False):
        if a != b:
            break
        length += 1
    return length
