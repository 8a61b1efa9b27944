"""Trigram counts: the table (w_{t−2}, w_{t−1}) → w_t that lets context-aware graphmax see two tokens back.

A bigram graph conditions on one token; its powers Ãᵏ marginalise over the
tokens in between instead of conditioning on them. The trigram table is
stored beside the operators, in ``trigrams/``, as four memory-mappable arrays
sorted by context:

- ``contexts.npy``  int64, the distinct contexts u·N + v (u = w_{t−2}, v = w_{t−1}), ascending
- ``indptr.npy``    int64, context i's successors are entries indptr[i]:indptr[i+1]
- ``next.npy``      int32, the successor tokens w
- ``counts.npy``    int64, how often (u, v, w) occurred within one document

The manifest's ``trigrams`` entry lists the files with their sizes and SHA-256.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .corpus import CorpusSpec, ReadStats, expand_corpus, iter_documents
from .storage import atomic_folder, check_file, file_entry, update_manifest
from .tokenize import BatchEncoder, load_tokenizer

FOLDER = "trigrams"
_ARRAYS = ("contexts", "indptr", "next", "counts")
_MERGE_AT = 1 << 24  # pending (key, count) pairs before they are folded into the running table


@dataclass
class TrigramCounts:
    """Trigram counts of a corpus, grouped by their two-token context."""

    vocab_size: int
    contexts: np.ndarray
    indptr: np.ndarray
    next: np.ndarray
    counts: np.ndarray

    @classmethod
    def from_keys(cls, keys: np.ndarray, counts: np.ndarray, vocab_size: int) -> "TrigramCounts":
        """From sorted unique keys (u·N + v)·N + w and their counts."""
        ctx = keys // vocab_size
        contexts, starts = np.unique(ctx, return_index=True)
        indptr = np.append(starts, len(keys)).astype(np.int64)
        return cls(vocab_size, contexts, indptr, (keys % vocab_size).astype(np.int32), counts.astype(np.int64))

    @property
    def entries(self) -> int:
        return int(self.indptr[-1])

    def successors(self, u: int, v: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(next tokens, counts) after the context (u, v), or None if the corpus never has it."""
        key = u * self.vocab_size + v
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


def count_trigrams(corpus: CorpusSpec, tokenizer, *, text_column: str = "text", clean: bool = False,
                   batch_docs: int = 2048, progress: bool = True) -> TrigramCounts:
    """Stream ``corpus`` through the tokenizer and count its within-document trigrams.

    Memory stays bounded by the number of distinct trigrams (pending batches are
    folded into the running table as they pile up).
    """
    tok = load_tokenizer(tokenizer)
    encoder = BatchEncoder(tok)
    n = encoder.vocab_size
    if float(n) ** 3 >= 2.0 ** 63:
        raise ValueError(f"a vocabulary of {n:,} tokens is too large for int64 trigram keys")
    keys: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    pending = 0
    for docs in tqdm(iter_documents(expand_corpus(corpus), text_column, clean=clean, batch_docs=batch_docs,
                                    stats=ReadStats()), desc="count trigrams", unit="batch", disable=not progress):
        ids, offsets = encoder.encode(docs)
        ids = ids.astype(np.int64)
        doc = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        inside = doc[:-2] == doc[2:]  # the three tokens belong to one document
        batch = ((ids[:-2] * n + ids[1:-1]) * n + ids[2:])[inside]
        k, c = np.unique(batch, return_counts=True)
        keys.append(k)
        counts.append(c)
        pending += len(k)
        if pending > _MERGE_AT:
            k, c = _fold(keys, counts)
            keys, counts, pending = [k], [c], len(k)
    if not keys:
        return TrigramCounts.from_keys(np.zeros(0, np.int64), np.zeros(0, np.int64), n)
    return TrigramCounts.from_keys(*_fold(keys, counts), n)


def add_trigrams(graph, corpus: CorpusSpec, tokenizer, *, text_column: str = "text", clean: bool = False,
                 progress: bool = True) -> TrigramCounts:
    """Count ``corpus``'s trigrams with ``tokenizer`` (the graph's own) and store them in the graph folder.

    Written to a temporary folder that replaces ``trigrams/`` only when complete
    (``storage.atomic_folder``), then recorded in the manifest.
    """
    graph.check_tokenizer(tokenizer)
    table = count_trigrams(corpus, tokenizer, text_column=text_column, clean=clean, progress=progress)
    root = Path(graph.path)
    with atomic_folder(root / FOLDER, overwrite=True) as tmp:
        for name in _ARRAYS:
            np.save(tmp / f"{name}.npy", getattr(table, name))
    entry = {"contexts": len(table.contexts), "entries": table.entries,
             "corpus": [str(f) for f in expand_corpus(corpus)], "clean": clean, "text_column": text_column,
             "files": {name: file_entry(root, root / FOLDER / f"{name}.npy") for name in _ARRAYS}}
    graph.manifest = update_manifest(root, "trigrams", entry)
    graph._trigrams = None  # the next access reads the new table
    return table


def read_trigrams(root: Path, entry: dict, vocab_size: int, verify: bool = True) -> TrigramCounts:
    """The stored table, memory-mapped, after checking each file against the manifest."""
    arrays = {name: np.load(check_file(root, entry["files"][name], verify), mmap_mode="r") for name in _ARRAYS}
    return TrigramCounts(vocab_size, **arrays)
