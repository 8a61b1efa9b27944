"""Exact bigram counts within documents, mergeable across chunks, files and machines.

A bigram (s, d) is stored as the key ``s * N + d`` in a sorted array with an
int64 count beside it. Partial counts merge associatively and commutatively
(a sorted merge that adds counts), so a corpus can be counted in any split
and merged into byte-identical results.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import scipy.sparse as sp

from .numba_cache import ensure_cache_dir

ensure_cache_dir()  # before the cached kernels below are defined


@numba.njit(cache=True)
def _merge_sorted(ka, ca, kb, cb):
    out_k = np.empty(ka.size + kb.size, dtype=ka.dtype)
    out_c = np.empty(ka.size + kb.size, dtype=np.int64)
    i = j = n = 0
    while i < ka.size and j < kb.size:
        if ka[i] < kb[j]:
            out_k[n] = ka[i]
            out_c[n] = ca[i]
            i += 1
        elif kb[j] < ka[i]:
            out_k[n] = kb[j]
            out_c[n] = cb[j]
            j += 1
        else:
            out_k[n] = ka[i]
            out_c[n] = ca[i] + cb[j]
            i += 1
            j += 1
        n += 1
    while i < ka.size:
        out_k[n] = ka[i]
        out_c[n] = ca[i]
        i += 1
        n += 1
    while j < kb.size:
        out_k[n] = kb[j]
        out_c[n] = cb[j]
        j += 1
        n += 1
    return out_k[:n], out_c[:n]


def key_dtype(vocab_size: int) -> np.dtype:
    # N ≤ 65,536 (SmolLM2, GPT-2) fits every key in uint32, which sorts twice as fast.
    return np.dtype(np.uint32) if vocab_size * vocab_size <= 2**32 else np.dtype(np.uint64)


@dataclass
class BigramCounts:
    """Sorted unique bigram keys with their counts, over a vocabulary of ``vocab_size``."""

    vocab_size: int
    keys: np.ndarray
    counts: np.ndarray
    documents: int = 0
    tokens: int = 0

    @classmethod
    def empty(cls, vocab_size: int) -> BigramCounts:
        return cls(vocab_size, np.empty(0, key_dtype(vocab_size)), np.empty(0, np.int64))

    @classmethod
    def from_keys(cls, vocab_size: int, keys: np.ndarray, documents: int = 0, tokens: int = 0) -> BigramCounts:
        uniq, counts = np.unique(keys, return_counts=True)
        return cls(vocab_size, uniq.astype(key_dtype(vocab_size), copy=False), counts.astype(np.int64), documents,
                   tokens)

    @classmethod
    def from_csr(cls, matrix: sp.csr_matrix, documents: int = 0, tokens: int = 0) -> BigramCounts:
        n = matrix.shape[0]
        coo = matrix.tocoo()
        keys = coo.row.astype(np.uint64) * np.uint64(n) + coo.col.astype(np.uint64)
        order = np.argsort(keys, kind="stable")
        return cls(n, keys[order].astype(key_dtype(n)), coo.data[order].astype(np.int64), documents, tokens)

    def merge(self, other: BigramCounts) -> BigramCounts:
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge counts over vocabularies of {self.vocab_size} and {other.vocab_size} "
                             f"tokens")
        keys, counts = _merge_sorted(self.keys, self.counts, other.keys, other.counts)
        return BigramCounts(self.vocab_size, keys, counts,
                            self.documents + other.documents, self.tokens + other.tokens)

    @property
    def distinct(self) -> int:
        return int(self.keys.size)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def src_dst(self) -> tuple[np.ndarray, np.ndarray]:
        n = np.uint64(self.vocab_size)
        k = self.keys.astype(np.uint64, copy=False)
        return (k // n).astype(np.int32), (k % n).astype(np.int32)

    def to_csr(self) -> sp.csr_matrix:
        """The N×N count matrix A (int64) with sorted column indices."""
        src, dst = self.src_dst()
        n = self.vocab_size
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(src, minlength=n), out=indptr[1:])
        return sp.csr_matrix((self.counts, dst, indptr), shape=(n, n))


class CountAccumulator:
    """Counts bigrams of encoded batches, reducing its buffer as it grows."""

    def __init__(self, vocab_size: int, buffer_pairs: int = 1 << 24):
        self.vocab_size = vocab_size
        self.buffer_pairs = buffer_pairs
        self._dtype = key_dtype(vocab_size)
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._result = BigramCounts.empty(vocab_size)

    def add(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        """Add the bigrams of documents ``ids[offsets[i]:offsets[i+1]]``; none crosses a document boundary."""
        if ids.size and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            raise ValueError(f"token id out of range for a vocabulary of {self.vocab_size}")
        self._result.documents += int(offsets.size - 1)
        self._result.tokens += int(ids.size)
        if ids.size < 2:
            return
        keys = ids[:-1].astype(self._dtype) * self._dtype.type(self.vocab_size) + ids[1:].astype(self._dtype)
        # A pair ending at the start of a document would bridge two documents.
        starts = offsets[1:-1]
        starts = starts[(starts > 0) & (starts < ids.size)]
        keep = np.ones(keys.size, dtype=bool)
        keep[starts - 1] = False
        self._buffer.append(keys[keep])
        self._buffered += self._buffer[-1].size
        if self._buffered >= self.buffer_pairs:
            self._reduce()

    @property
    def documents(self) -> int:
        return self._result.documents

    @property
    def tokens(self) -> int:
        return self._result.tokens

    def _reduce(self) -> None:
        if not self._buffer:
            return
        chunk = BigramCounts.from_keys(self.vocab_size, np.concatenate(self._buffer))
        self._buffer, self._buffered = [], 0
        merged = self._result.merge(chunk)
        merged.documents, merged.tokens = self._result.documents, self._result.tokens
        self._result = merged

    def result(self) -> BigramCounts:
        self._reduce()
        return self._result
