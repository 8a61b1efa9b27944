"""n-gram tables (n ≥ 3): the counts of (w_{t−n+1} … w_{t−1}) → w_t that let context-aware graphmax see further back.

A bigram graph conditions on one token; its powers Ãᵏ marginalise over the tokens in between instead of
conditioning on them. A table groups its n-grams by their n−1-token context, sorted (the arrays on disk:
docs/format.md); ``gm_graphs.build.ngrams`` counts and stores them.

Keys (context·N + w) are int64, so n ≤ 4 for vocabularies below 55,000 tokens
(N⁴ < 2⁶³).

Counting (``gm_graphs.count.runs``) buffers ``run_entries`` n-grams of an order at a
time; given a work folder, each full buffer is sorted into a run there, and the
runs are merged range by range of contexts into the final arrays (an external
merge sort), so memory does not grow with the corpus' distinct n-grams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gm_graphs.count.bigrams import count_bits, unpack
from gm_graphs.count.runs import repack
from gm_graphs.errors import OptionError

ORDERS = (3, 4)
MAX_ORDER = 63  # an n-gram's key packs its n tokens, at least one bit each, into an int64


@dataclass
class NgramCounts:
    """n-gram counts of a corpus, grouped by their (n−1)-token context.

    The entries of context ``contexts[i]`` (its tokens t₁…tₙ₋₁ as the key Σ tⱼ·N^(n−1−j)) are
    ``indptr[i]:indptr[i + 1]``: the next tokens ``next`` with their ``counts``. ``successors`` looks a
    context up.

    Args:
        order (``int``): n, at least 3.
        vocab_size (``int``): N.
        contexts (``numpy.ndarray`` of int64): the sorted unique context keys.
        indptr (``numpy.ndarray`` of int32 or int64): each context's range of entries, ``len(contexts) + 1`` long.
        next (``numpy.ndarray`` of int32): the next token of each entry, ascending within a context.
        counts (``numpy.ndarray`` of int32 or int64, as indptr): the count of each entry.

    Example::

        >>> import numpy as np
        >>> keys = np.array([(1 * 6 + 2) * 6 + 4, (1 * 6 + 2) * 6 + 5, (1 * 6 + 3) * 6 + 4])
        >>> table = NgramCounts.from_keys(3, keys, np.array([2, 1, 1]), vocab_size=6)
        >>> nxt, counts = table.successors([1, 2])      # (1, 2) is followed by 4 twice and 5 once
        >>> nxt.tolist(), counts.tolist(), table.successors([2, 1]), table.entries
        ([4, 5], [2, 1], None, 3)
    """

    order: int
    vocab_size: int
    contexts: np.ndarray
    indptr: np.ndarray
    next: np.ndarray
    counts: np.ndarray

    @classmethod
    def from_keys(cls, order: int, keys: np.ndarray, counts: np.ndarray, vocab_size: int) -> NgramCounts:
        """From sorted unique keys context·N + w and their counts."""
        ctx = keys // vocab_size
        contexts, starts = np.unique(ctx, return_index=True)
        indptr = np.append(starts, len(keys)).astype(np.int64)
        return cls(order, vocab_size, contexts, indptr, (keys % vocab_size).astype(np.int32), counts.astype(np.int64))

    @property
    def entries(self) -> int:
        return int(self.indptr[-1])

    def keys(self) -> np.ndarray:
        """Every entry's key context·N + w, ascending."""
        ctx = np.repeat(np.asarray(self.contexts), np.diff(self.indptr))
        return ctx * self.vocab_size + np.asarray(self.next, dtype=np.int64)

    def successors(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(next tokens, counts) after ``context`` (its n−1 tokens, oldest first); None if the corpus never has it."""
        if len(context) != self.order - 1:
            raise ValueError(f"an order-{self.order} table takes {self.order - 1} context tokens, got {len(context)}")
        key = 0
        for t in context:
            if not 0 <= t < self.vocab_size:
                return None
            key = key * self.vocab_size + int(t)
        i = int(np.searchsorted(self.contexts, key))
        if i == len(self.contexts) or self.contexts[i] != key:
            return None
        a, b = self.indptr[i], self.indptr[i + 1]
        return self.next[a:b], self.counts[a:b]


def check_orders(orders: Sequence[int], vocab_size: int | None = None) -> tuple[int, ...]:
    """The n-gram orders, sorted and unique; each ≥ 3, and (given the vocabulary) with int64 keys."""
    if isinstance(orders, (int, str)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in orders):
        raise OptionError(f"n-gram orders are a list of integers like (3, 4), got {orders!r}")
    orders = tuple(sorted(set(orders)))
    if not orders or orders[0] < 3 or orders[-1] > MAX_ORDER:
        raise OptionError(f"n-gram orders are 3 or more (the graph itself holds the bigrams) and at most "
                          f"{MAX_ORDER} (a key of n tokens fits in int64), got {list(orders)}; use e.g. --ngrams 3,4")
    if vocab_size is not None and int(vocab_size) ** orders[-1] >= 2 ** 63:
        raise OptionError(f"order {orders[-1]} over a vocabulary of {vocab_size:,} tokens overflows int64 keys; "
                          f"use a lower order")
    return orders


def merge_ngrams(parts: Sequence[dict[int, NgramCounts]]) -> dict[int, NgramCounts]:
    """Sum the tables of corpus parts counted with one tokenizer; only the orders every part has are kept
    (``merge_graphs`` refuses parts whose orders differ, so that nothing is dropped there).

    Args:
        parts (sequence of ``dict[int, NgramCounts]``): the tables of each part, by order.

    Returns:
        ``dict[int, NgramCounts]``: the summed tables, for the orders every part has.

    Example::

        >>> import numpy as np
        >>> a = {3: NgramCounts.from_keys(3, np.array([10, 11]), np.array([1, 2]), vocab_size=3)}
        >>> b = {3: NgramCounts.from_keys(3, np.array([11]), np.array([5]), vocab_size=3),
        ...      4: NgramCounts.from_keys(4, np.array([7]), np.array([1]), vocab_size=3)}
        >>> merged = merge_ngrams([a, b])
        >>> sorted(merged), merged[3].keys().tolist(), merged[3].counts.tolist()
        ([3], [10, 11], [1, 7])
    """
    orders = set.intersection(*(set(p) for p in parts)) if parts else set()
    merged = {}
    for order in sorted(orders):
        tables = [p[order] for p in parts]
        n = tables[0].vocab_size
        bits = count_bits(order, n)
        packed = np.concatenate([repack(t.keys(), np.asarray(t.counts, dtype=np.int64), bits) for t in tables])
        packed.sort()
        merged[order] = NgramCounts.from_keys(order, *unpack(packed, bits), n)
    return merged
