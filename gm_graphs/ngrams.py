"""n-gram counts (n = 3, 4): tables (w_{t−n+1} … w_{t−1}) → w_t that let context-aware graphmax see further back.

A bigram graph conditions on one token; its powers Ãᵏ marginalise over the
tokens in between instead of conditioning on them. This module counts; the
tables are stored beside the operators (``gm_graphs.storage`` writes and checks
them, ``gm_graphs.build.add_ngrams`` adds them to a built graph) as four
memory-mappable arrays per order, sorted by context:

- ``contexts.npy``  int64, the distinct contexts in base N (N = vocabulary size): for n = 3,
  u·N + v with u = w_{t−2}, v = w_{t−1}; ascending
- ``indptr.npy``    int64, context i's successors are entries indptr[i]:indptr[i+1]
- ``next.npy``      int32, the successor tokens w
- ``counts.npy``    int64, how often (context, w) occurred within one document

Keys (context·N + w) are int64, so n ≤ 4 for vocabularies below 55,000 tokens
(N⁴ < 2⁶³).

Counting keeps at most ``run_entries`` distinct n-grams of an order in memory
when given a work folder: a larger table is written there as sorted runs, which
are merged range by range of contexts into the final arrays (an external merge
sort), so memory does not grow with the corpus' distinct n-grams.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from .corpus import CorpusSpec, ReadStats, expand_corpus, iter_documents
from .errors import OptionError
from .tokenize import BatchEncoder, load_tokenizer

FOLDER = "ngrams"
ORDERS = (3, 4)
_ARRAYS = ("contexts", "indptr", "next", "counts")
_FOLD_AT = 1 << 24  # pending (key, count) pairs before they are folded into the running table
RUN_ENTRIES = 1 << 24  # distinct n-grams of an order held in memory before a sorted run goes to disk (~1 GB peak)


@dataclass
class NgramCounts:
    """n-gram counts of a corpus, grouped by their (n−1)-token context."""

    order: int
    vocab_size: int
    contexts: np.ndarray
    indptr: np.ndarray
    next: np.ndarray
    counts: np.ndarray

    @classmethod
    def from_keys(cls, order: int, keys: np.ndarray, counts: np.ndarray, vocab_size: int) -> "NgramCounts":
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


def _fold(keys: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    k = np.concatenate(keys)
    c = np.concatenate(counts)
    uniq, inverse = np.unique(k, return_inverse=True)
    return uniq, np.bincount(inverse, weights=c, minlength=len(uniq)).astype(np.int64)


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


_DTYPES = {"contexts": np.int64, "indptr": np.int64, "next": np.int32, "counts": np.int64}


def _npy_from_raw(raw: Path, dtype, path: Path) -> None:
    """Turn a raw file of ``dtype`` values into a .npy file: a header, then the bytes copied, never all in memory."""
    count = raw.stat().st_size // np.dtype(dtype).itemsize
    with open(path, "wb") as out, open(raw, "rb") as fh:
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (count,)}
        np.lib.format.write_array_header_1_0(out, header)
        shutil.copyfileobj(fh, out, 1 << 24)
    raw.unlink()


def _merge_runs(runs: list[tuple[np.ndarray, np.ndarray]], order: int, vocab_size: int, out: Path,
                chunk: int) -> NgramCounts:
    """Merge sorted runs (keys, counts) into memory-mapped arrays in ``out``, a range of contexts at a time.

    Ranges start at contexts sampled every chunk/len(runs) entries of each run, so a
    range holds at most ~``chunk`` entries (plus one context's successors per run).
    """
    stride = max(1, chunk // len(runs))
    starts = np.unique(np.concatenate([np.asarray(keys[stride::stride]) // vocab_size for keys, _ in runs]))
    bounds = [None, *(int(c) * vocab_size for c in starts), None]
    out.mkdir(parents=True, exist_ok=True)
    raw = {name: out / f"{name}.raw" for name in _ARRAYS}
    handles = {name: open(raw[name], "wb") for name in _ARRAYS}
    offset = 0
    try:
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            keys, counts = [], []
            for run_keys, run_counts in runs:
                a = 0 if lo is None else int(np.searchsorted(run_keys, lo))
                b = len(run_keys) if hi is None else int(np.searchsorted(run_keys, hi))
                keys.append(np.asarray(run_keys[a:b]))
                counts.append(np.asarray(run_counts[a:b]))
            key, cnt = _fold(keys, counts)
            if not len(key):
                continue
            table = NgramCounts.from_keys(order, key, cnt, vocab_size)
            (table.indptr[:-1] + offset).tofile(handles["indptr"])
            for name in ("contexts", "next", "counts"):
                getattr(table, name).tofile(handles[name])
            offset += table.entries
        np.array([offset], dtype=np.int64).tofile(handles["indptr"])
    finally:
        for fh in handles.values():
            fh.close()
    for name in _ARRAYS:
        _npy_from_raw(raw[name], _DTYPES[name], out / f"{name}.npy")
    return NgramCounts(order, vocab_size, **{name: np.load(out / f"{name}.npy", mmap_mode="r") for name in _ARRAYS})


class _Accumulator:
    """Keys and counts of one order, folded into a running table as they pile up; with a work folder, a
    running table over ``run_entries`` is written there as a sorted run."""

    def __init__(self, work: Path | None, run_entries: int):
        self.keys: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []
        self.pending = 0  # entries added since the last fold
        self.folded = 0  # entries of the running table after the last fold
        self.work, self.run_entries = work, run_entries
        self.runs: list[tuple[Path, Path]] = []

    def add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self.keys.append(keys)
        self.counts.append(counts)
        self.pending += len(keys)
        # in memory, fold once the new entries outnumber the running table too (each fold re-sorts it);
        # with a work folder, every run_entries new entries, so that memory holds at most about twice that
        if self.pending > (max(_FOLD_AT, self.folded) if self.work is None else self.run_entries):
            k, c = _fold(self.keys, self.counts)
            self.keys, self.counts, self.pending, self.folded = [k], [c], 0, len(k)
            if self.work is not None and len(k) > self.run_entries:
                self._write_run(k, c)

    def _write_run(self, keys: np.ndarray, counts: np.ndarray) -> None:
        i = len(self.runs)
        paths = (self.work / f"run{i}-keys.npy", self.work / f"run{i}-counts.npy")
        np.save(paths[0], keys)
        np.save(paths[1], counts)
        self.runs.append(paths)
        self.keys, self.counts, self.pending, self.folded = [], [], 0, 0

    def table(self, order: int, vocab_size: int) -> NgramCounts:
        if not self.keys and not self.runs:
            return NgramCounts.from_keys(order, np.zeros(0, np.int64), np.zeros(0, np.int64), vocab_size)
        if not self.runs:
            return NgramCounts.from_keys(order, *_fold(self.keys, self.counts), vocab_size)
        if self.keys:
            self._write_run(*_fold(self.keys, self.counts))
        runs = [(np.load(k, mmap_mode="r"), np.load(c, mmap_mode="r")) for k, c in self.runs]
        table = _merge_runs(runs, order, vocab_size, self.work, self.run_entries)
        del runs  # the memory maps, before their files go
        for paths in self.runs:
            for path in paths:
                path.unlink()
        return table


def count_ngrams(corpus: CorpusSpec, tokenizer, orders: Sequence[int] = ORDERS, *, text_column: str = "text",
                 clean: bool = False, batch_docs: int = 2048, progress: bool = True, work: Path | None = None,
                 run_entries: int = RUN_ENTRIES) -> dict[int, NgramCounts]:
    """Stream ``corpus`` through the tokenizer once and count its within-document n-grams of each order.

    Without ``work`` the tables are built in memory, which grows with the
    distinct n-grams. With a ``work`` folder (the caller's, on a disk with room
    for the tables twice) an order whose distinct n-grams outgrow ``run_entries``
    is sorted in runs there and merged, and its table is memory-mapped from
    ``work/<n>/``.
    """
    if not isinstance(run_entries, int) or run_entries < 1:
        raise OptionError(f"run_entries must be an integer >= 1, got {run_entries!r}")
    tok = load_tokenizer(tokenizer)
    encoder = BatchEncoder(tok)
    n = encoder.vocab_size
    orders = check_orders(orders, n)
    folders = {order: None if work is None else Path(work) / str(order) for order in orders}
    for folder in folders.values():
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    acc = {order: _Accumulator(folders[order], run_entries) for order in orders}
    for docs in tqdm(iter_documents(expand_corpus(corpus), text_column, clean=clean, batch_docs=batch_docs,
                                    stats=ReadStats()), desc="count n-grams", unit="batch", disable=not progress):
        ids, offsets = encoder.encode(docs)
        ids = ids.astype(np.int64)
        doc = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        for order in orders:
            m = len(ids) - order + 1
            if m <= 0:
                continue
            key = ids[:m].copy()
            for j in range(1, order):
                key = key * n + ids[j:j + m]
            inside = doc[:m] == doc[order - 1:]  # all n tokens belong to one document
            acc[order].add(*np.unique(key[inside], return_counts=True))
    return {order: acc[order].table(order, n) for order in orders}


def merge_ngrams(parts: Sequence[dict[int, NgramCounts]]) -> dict[int, NgramCounts]:
    """Sum the tables of corpus parts counted with one tokenizer; only the orders every part has are kept."""
    orders = set.intersection(*(set(p) for p in parts)) if parts else set()
    merged = {}
    for order in sorted(orders):
        tables = [p[order] for p in parts]
        keys, counts = _fold([t.keys() for t in tables], [np.asarray(t.counts) for t in tables])
        merged[order] = NgramCounts.from_keys(order, keys, counts, tables[0].vocab_size)
    return merged
