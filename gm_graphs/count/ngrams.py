"""n-gram counts (n = 3, 4): tables (w_{t−n+1} … w_{t−1}) → w_t that let context-aware graphmax see further back.

A bigram graph conditions on one token; its powers Ãᵏ marginalise over the
tokens in between instead of conditioning on them. This module counts; the
tables are stored beside the operators (``gm_graphs.format.graph_files`` writes and checks
them, ``gm_graphs.build.graphs.add_ngrams`` adds them to a built graph) as four
memory-mappable arrays per order, sorted by context:

- ``contexts.npy``  int64, the distinct contexts in base N (N = vocabulary size): for n = 3,
  u·N + v with u = w_{t−2}, v = w_{t−1}; ascending
- ``indptr.npy``    int32, context i's successors are entries indptr[i]:indptr[i+1]
- ``next.npy``      int32, the successor tokens w
- ``counts.npy``    int32, how often (context, w) occurred within one document

(indptr and counts are int64 in a table of 2³¹ n-grams or more: ``storage.ngram_dtypes``.)

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
from pathlib import Path

import numpy as np

from gm_graphs.corpus.read import CorpusSpec, expand_corpus
from gm_graphs.count.bigrams import count_bits, unpack
from gm_graphs.errors import OptionError
from gm_graphs.count.onepass import count_pass
from gm_graphs.count.runs import SortedRuns, repack
from gm_graphs.tokenize.encoder import BatchEncoder, load_tokenizer
from gm_graphs.format.writer import Hasher, write_ngrams

FOLDER = "ngrams"
ORDERS = (3, 4)
_ARRAYS = ("contexts", "indptr", "next", "counts")
RUN_ENTRIES = 1 << 24  # n-grams of an order buffered (8 bytes each) before they are sorted into a run


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
    if not orders or orders[0] < 3:
        raise OptionError(f"n-gram orders are 3 or more (the graph itself holds the bigrams), got {list(orders)}; "
                          f"use e.g. --ngrams 3,4")
    if vocab_size is not None and float(vocab_size) ** orders[-1] >= 2.0 ** 63:
        raise OptionError(f"order {orders[-1]} over a vocabulary of {vocab_size:,} tokens overflows int64 keys; "
                          f"use a lower order")
    return orders


def count_ngrams(corpus: CorpusSpec, tokenizer, orders: Sequence[int] = ORDERS, *, text_column: str = "text",
                 clean: bool = False, batch_docs: int = 2048, progress: bool = True, work: Path | None = None,
                 run_entries: int = RUN_ENTRIES) -> dict[int, NgramCounts]:
    """Stream ``corpus`` through the tokenizer once and count its within-document n-grams of each order.

    Without ``work`` the tables are built in memory, which grows with the
    distinct n-grams. With a ``work`` folder (the caller's, on a disk with room
    for the tables twice) each order is sorted in runs of ``run_entries``
    n-grams there and merged, and its table is memory-mapped from ``work/<n>/``.

    Args:
        corpus (``str``, ``os.PathLike`` or an iterable of them): corpus files or globs (:func:`expand_corpus`).
        tokenizer: a loaded tokenizer or anything :func:`load_tokenizer` takes.
        orders (sequence of ``int``, defaults to ``NGRAM_ORDERS``, (3, 4)): the n-gram orders, each ≥ 3.
        text_column (``str``, defaults to ``"text"``): the column or JSONL key holding the text.
        clean (``bool``, defaults to ``False``): unescape HTML entities and drop ``<br />`` tags.
        batch_docs (``int``, defaults to 2048): documents tokenized per batch.
        progress (``bool``, defaults to ``True``): show a progress bar.
        work (``pathlib.Path`` or ``None``, defaults to ``None``): a folder for the sorted runs and tables;
            ``None``: in memory.
        run_entries (``int``, defaults to ``NGRAM_RUN_ENTRIES``): n-grams of an order buffered before a sorted run.

    Returns:
        ``dict[int, NgramCounts]``: a table per order.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> from gm_graphs import word_tokenizer
        >>> tok = word_tokenizer("the cat dog sat ran".split())     # any transformers tokenizer, or "smollm2"
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> _ = (folder / "reviews.txt").write_text("the cat sat\\nthe dog sat\\nthe cat ran\\n")
        >>> tables = count_ngrams(folder / "reviews.txt", tok, orders=(3,), progress=False)
        >>> nxt, counts = tables[3].successors([1, 2])     # after "the cat": "sat" (4) once, "ran" (5) once
        >>> nxt.tolist(), counts.tolist()
        ([4, 5], [1, 1])
    """
    if not isinstance(run_entries, int) or run_entries < 1:
        raise OptionError(f"run_entries must be an integer >= 1, got {run_entries!r}")
    tok = load_tokenizer(tokenizer)
    encoder = BatchEncoder(tok)
    n = encoder.vocab_size
    orders = check_orders(orders, n)
    runs = {order: SortedRuns(order, n, run_entries, None if work is None else Path(work) / str(order) / "runs")
            for order in orders}
    count_pass(expand_corpus(corpus), encoder, runs, text_column=text_column, clean=clean, batch_docs=batch_docs,
               progress=progress, desc="count n-grams")
    if work is None:
        return {order: NgramCounts.from_keys(order, *runs[order].merged(), n) for order in orders}
    return {order: write_table(Path(work), order, n, runs[order]) for order in orders}


def write_table(root: Path, order: int, vocab_size: int, runs: SortedRuns, folder: str = ".",
                hasher: Hasher | None = None) -> NgramCounts | dict:
    """Merge ``runs`` into ``root/folder/<order>/*.npy`` and delete them. With a ``hasher``: the manifest entry
    (its hashes as Futures); without: the table, memory-mapped."""
    try:
        entry = write_ngrams(root, folder, order, vocab_size, runs.ranges(), hasher, runs.windows)
    finally:
        runs.remove()
    if runs.folder is not None and runs.folder.is_dir():
        runs.folder.rmdir()
    if hasher is not None:
        return entry
    out = root / folder / str(order)
    return NgramCounts(order, vocab_size, **{part: np.load(out / f"{part}.npy", mmap_mode="r") for part in _ARRAYS})


def merge_ngrams(parts: Sequence[dict[int, NgramCounts]]) -> dict[int, NgramCounts]:
    """Sum the tables of corpus parts counted with one tokenizer; only the orders every part has are kept.

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
