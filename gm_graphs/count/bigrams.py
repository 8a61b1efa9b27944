"""Exact counts of token windows within documents, mergeable across chunks, files and machines.

A window of ``order`` tokens w₁…wₙ is the key Σ wᵢ·N^(n−i) (N = vocabulary size): a bigram (s, d) is ``s·N + d``,
and the key of an n-gram divided by N is its (n−1)-token context. Counting is sorting: a batch of keys is sorted
and run-length encoded into *packed entries* ``key << b | count`` (b = 64 − the bits a key needs, so an entry
sorts by its key; a count that does not fit b bits is split over several entries). Packed entries of any number
of chunks merge by concatenating, sorting and summing equal keys, so a corpus can be counted in any split and
merged into the same result.

:class:`BigramCounts` holds the merged bigrams of a corpus in memory (sorted keys, int64 counts); graph building
streams them instead (``gm_graphs.count.runs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import scipy.sparse as sp

from gm_graphs.store.kernel_cache import ensure_cache_dir

ensure_cache_dir()  # before the cached kernels below are defined


# ---- kernels (nogil: they run beside the tokenizer in another thread) ---------------------------------------------

@numba.njit(nogil=True, cache=True)
def window_keys(ids, offsets, vocab, order, inset, out, fill):
    """Write the key of every window of ``order`` tokens inside one document to ``out[fill:]``; the new fill.

    Document i is ``ids[offsets[i]:offsets[i+1]]`` less ``inset`` tokens at each end (a BOS and an EOS that only the
    bigrams count); no window crosses a document boundary.
    """
    for d in range(offsets.size - 1):
        a, b = offsets[d] + inset, offsets[d + 1] - inset
        for t in range(a, b - order + 1):
            key = np.uint64(ids[t])
            for j in range(1, order):
                key = key * np.uint64(vocab) + np.uint64(ids[t + j])
            out[fill] = key
            fill += 1
    return fill


@numba.njit(nogil=True, cache=True)
def last_keys(ids, offsets, vocab, order, inset, out, fill):
    """Write the key of the last window of ``order`` tokens of each document (as ``window_keys`` bounds it) to
    ``out[fill:]``; the new fill. These are the windows of ``order`` that no window of ``order + 1`` starts with."""
    for d in range(offsets.size - 1):
        a, b = offsets[d] + inset, offsets[d + 1] - inset
        if b - a >= order:
            key = np.uint64(ids[b - order])
            for j in range(b - order + 1, b):
                key = key * np.uint64(vocab) + np.uint64(ids[j])
            out[fill] = key
            fill += 1
    return fill


@numba.njit(nogil=True, cache=True)
def prefix_entries(packed, n, bits, vocab, last, lower_bits, out):
    """The packed entries of the windows one token shorter than those of the sorted packed entries
    ``packed[:n]``: each window's first tokens (its key divided by ``vocab``), merged with the sorted keys ``last``
    (the windows that no longer one starts with), counts summed; written to ``out``, their number returned.

    Prefixes of sorted keys are sorted, so the shorter windows come out sorted without another sort. ``out`` needs
    ``n + last.size`` entries: a count above the lower cap is split, but the lower cap is at least the higher one.
    """
    shift = np.uint64(bits)
    mask = (np.uint64(1) << shift) - np.uint64(1)
    lower = np.uint64(lower_bits)
    cap = (np.uint64(1) << lower) - np.uint64(1)
    v = np.uint64(vocab)
    i = j = m = 0
    while i < n or j < last.size:
        key = (packed[i] >> shift) // v if i < n else last[j]
        if j < last.size and last[j] < key:
            key = last[j]
        end = (key + np.uint64(1)) * v  # the longer windows starting with key are the next ones below end
        total = np.uint64(0)
        while i < n and (packed[i] >> shift) < end:  # one division per prefix, not per entry
            total += packed[i] & mask
            i += 1
        while j < last.size and last[j] == key:
            total += np.uint64(1)
            j += 1
        while total > 0:
            c = total if total < cap else cap
            out[m] = (key << lower) | c
            m += 1
            total -= c
    return m


@numba.njit(nogil=True, cache=True)
def pack_sorted(keys, n, count_bits):
    """Run-length encode the sorted ``keys[:n]`` in place as packed entries ``key << b | count``; their number."""
    if n == 0:
        return 0
    cap = (np.uint64(1) << np.uint64(count_bits)) - np.uint64(1)
    shift = np.uint64(count_bits)
    m = 0
    i = 0
    while i < n:
        key = keys[i]
        j = i + 1
        while j < n and keys[j] == key:
            j += 1
        left = np.uint64(j - i)
        while left > 0:  # a count above the cap is split; the entries still sort next to each other
            c = left if left < cap else cap
            keys[m] = (key << shift) | c
            m += 1
            left -= c
        i = j
    return m


@numba.njit(nogil=True, cache=True)
def unpack_sum(packed, n, count_bits, keys_out, counts_out):
    """Sum the counts of equal keys of the sorted packed entries ``packed[:n]`` into unique keys (ascending) and
    int64 counts; the number of keys."""
    shift = np.uint64(count_bits)
    mask = (np.uint64(1) << shift) - np.uint64(1)
    m = -1
    last = np.uint64(0)
    for i in range(n):
        key = packed[i] >> shift
        c = np.int64(packed[i] & mask)
        if m >= 0 and key == last:
            counts_out[m] += c
        else:
            m += 1
            keys_out[m] = np.int64(key)
            counts_out[m] = c
            last = key
    return m + 1


def count_bits(order: int, vocab_size: int) -> int:
    """The low bits of a packed entry that hold its count: what a key of ``order`` tokens leaves of 64."""
    return 64 - (int(vocab_size) ** order - 1).bit_length()


def pack_keys(keys: np.ndarray, bits: int) -> np.ndarray:
    """The packed entries of an unsorted uint64 key array (sorted, in a new array)."""
    out = np.sort(keys)
    return out[:pack_sorted(out, out.size, bits)]


def unpack(packed: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Unique keys (int64) and summed counts (int64) of sorted packed entries."""
    keys = np.empty(packed.size, dtype=np.int64)
    counts = np.empty(packed.size, dtype=np.int64)
    m = unpack_sum(packed, packed.size, bits, keys, counts)
    return keys[:m], counts[:m]


def check_ids(ids: np.ndarray, vocab_size: int) -> None:
    if ids.size and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        raise ValueError(f"token id out of range for a vocabulary of {vocab_size}")


# ---- bigram counts in memory --------------------------------------------------------------------------------------

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
    """Sorted unique bigram keys with their counts, over a vocabulary of ``vocab_size``.

    The key of a bigram (s, d) is ``s·N + d`` (N = ``vocab_size``); ``merge`` adds two sets of counts,
    ``to_csr`` gives the N×N count matrix A.

    Args:
        vocab_size (``int``): N.
        keys (``numpy.ndarray``): the sorted unique keys.
        counts (``numpy.ndarray`` of int64): each key's count.
        documents (``int``, defaults to 0): the documents counted.
        tokens (``int``, defaults to 0): the tokens counted.

    Example::

        >>> import numpy as np
        >>> a = BigramCounts.from_keys(3, np.array([1, 5, 1]))     # (0, 1) twice, (1, 2) once
        >>> b = BigramCounts.from_keys(3, np.array([1, 6]))        # (0, 1), (2, 0)
        >>> merged = a.merge(b)
        >>> merged.total, merged.distinct
        (5, 3)
        >>> merged.to_csr().toarray().tolist()
        [[0, 3, 0], [0, 0, 1], [1, 0, 0]]
    """

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

    def ranges(self, max_entries: int = 1 << 22):
        """(int64 keys, counts) in ascending row ranges of about ``max_entries``, each ending at a row boundary:
        what a graph writer consumes (``gm_graphs.format.writer``)."""
        src = self.keys.astype(np.int64) // self.vocab_size
        start = 0
        while start < self.keys.size:
            end = min(self.keys.size, start + max_entries)
            if end < self.keys.size:  # a row is never split between two ranges
                end = int(np.searchsorted(src, src[end - 1], side="right"))
            yield self.keys[start:end].astype(np.int64), self.counts[start:end]
            start = end


