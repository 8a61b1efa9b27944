"""n-gram tables (n ≥ 3): the counts of (w_{t−n+1} … w_{t−1}) → w_t that let context-aware graphmax see further back.

A bigram graph conditions on one token; its powers Ãᵏ marginalise over the tokens in between instead of
conditioning on them. The tables of consecutive orders are the levels of one trie (``gm_graphs.count.ngram_trie``,
docs/format.md); ``gm_graphs.build.ngram_tables`` counts and stores them.

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
from gm_graphs.count.ngram_trie import Level, LevelStream, LowestOrder, find_context, node_keys, split_contexts
from gm_graphs.count.runs import repack
from gm_graphs.errors import OptionError

ORDERS = (3, 4)
MAX_ORDER = 63  # an n-gram's key packs its n tokens, at least one bit each, into an int64


@dataclass(frozen=True)
class NgramCounts:
    """n-gram counts of a corpus as the order-n level of a trie (``gm_graphs.count.ngram_trie``): each n-gram a
    node under its (n−1)-token context. ``successors`` looks a context up; ``keys`` and ``count_values`` list the
    entries.

    Args:
        order (``int``): n, at least 3.
        vocab_size (``int``): N.
        levels (``tuple`` of ``Level``): the trie's levels of lengths 2 … n (the last holds this table's counts).

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
    levels: tuple

    @classmethod
    def from_keys(cls, order: int, keys: np.ndarray, counts: np.ndarray, vocab_size: int) -> NgramCounts:
        """From sorted unique keys context·N + w and their counts, in memory."""
        parts: dict[int, dict[str, list]] = {d: {} for d in range(2, order + 1)}
        streams = {d: LevelStream(d, vocab_size, d == order,
                                  lambda part, values, d=d: parts[d].setdefault(part, []).append(values))
                   for d in range(2, order + 1)}
        encoder = LowestOrder(order, vocab_size, streams)
        keys = np.asarray(keys, dtype=np.int64)
        encoder.add(*split_contexts(keys, vocab_size), np.asarray(counts, dtype=np.int64))
        encoder.finish()
        levels = []
        for d, s in streams.items():
            arrays = {part: np.concatenate([np.zeros(0, dt), *parts[d].get(part, [])]).astype(dt)
                      for part, dt in s.dtypes.items()}
            levels.append(Level(d, s.parents, arrays))
        return cls(order, vocab_size, tuple(levels))

    @property
    def table(self) -> Level:
        return self.levels[-1]

    @property
    def entries(self) -> int:
        return self.table.nodes

    def keys(self) -> np.ndarray:
        """Every entry's key context·N + w, ascending."""
        return node_keys(list(self.levels), self.order, 0, self.entries, self.vocab_size)

    def count_values(self) -> np.ndarray:
        """Every entry's count, int64, in the order of :meth:`keys`."""
        return self.table.counts(0, self.entries)

    def kernel_views(self) -> tuple:
        """The levels' kernel views (``ngram_trie.find_context`` walks them)."""
        return tuple(level.kernel_view() for level in self.levels)

    def successors(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(next tokens, counts) after ``context`` (its n−1 tokens, oldest first); None if the corpus never has it."""
        if len(context) != self.order - 1:
            raise ValueError(f"an order-{self.order} table takes {self.order - 1} context tokens, got {len(context)}")
        tokens = np.asarray([int(t) if 0 <= t < self.vocab_size else -1 for t in context], dtype=np.int64)
        node = find_context(self.kernel_views(), tokens, 0, self.order - 1, self.vocab_size)
        if node < 0:
            return None
        a, b = self.table.ptrs(node, node + 2)
        if a == b:
            return None
        return np.asarray(self.table.arrays["next"][a:b], dtype=np.int64), self.table.counts(a, b)

    def dense(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(contexts, indptr, next, counts): the distinct context keys ascending, each's range of entries, and the
        entries' next tokens and counts, int64 (the whole table unpacked: for the torch path's searchsorted)."""
        table = self.table
        ptrs = table.ptrs(0, table.parents + 1)
        used = np.flatnonzero(np.diff(ptrs) > 0)
        contexts = node_keys(list(self.levels), self.order - 1, 0, table.parents, self.vocab_size)[used]
        indptr = np.append(ptrs[used], ptrs[-1])
        return contexts, indptr, np.asarray(table.arrays["next"], dtype=np.int64), self.count_values()


def tables_of(levels: Sequence[Level], orders, vocab_size: int) -> dict[int, NgramCounts]:
    """The tables of the counted ``orders`` over one trie's levels 2 …: each table the levels up to its order."""
    return {o: NgramCounts(o, vocab_size, tuple(levels[:o - 1])) for o in sorted(int(o) for o in orders)}


def check_orders(orders: Sequence[int], vocab_size: int | None = None) -> tuple[int, ...]:
    """The n-gram orders, sorted, unique and consecutive; each ≥ 3, and (given the vocabulary) with int64 keys."""
    if isinstance(orders, (int, str)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in orders):
        raise OptionError(f"n-gram orders are a list of integers like (3, 4), got {orders!r}")
    orders = tuple(sorted(set(orders)))
    if not orders or orders[0] < 3 or orders[-1] > MAX_ORDER:
        raise OptionError(f"n-gram orders are 3 or more (the graph itself holds the bigrams) and at most "
                          f"{MAX_ORDER} (a key of n tokens fits in int64), got {list(orders)}; use e.g. --ngrams 3,4")
    if orders != tuple(range(orders[0], orders[-1] + 1)):
        raise OptionError(f"n-gram orders are consecutive (each table hangs under the one below it), got "
                          f"{list(orders)}; use e.g. --ngrams {','.join(map(str, range(orders[0], orders[-1] + 1)))}")
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
        >>> sorted(merged), merged[3].keys().tolist(), merged[3].count_values().tolist()
        ([3], [10, 11], [1, 7])
    """
    orders = set.intersection(*(set(p) for p in parts)) if parts else set()
    merged = {}
    for order in sorted(orders):
        tables = [p[order] for p in parts]
        n = tables[0].vocab_size
        bits = count_bits(order, n)
        packed = np.concatenate([repack(t.keys(), t.count_values(), bits) for t in tables])
        packed.sort()
        merged[order] = NgramCounts.from_keys(order, *unpack(packed, bits), n)
    return merged
