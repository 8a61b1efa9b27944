"""The numba half of the CSR products: M·v (or base − M·v) for chosen rows of a batch, on the CPU's cores.

``compact`` lays M out once for the kernel (rows longest first, the narrowest unsigned index types);
``product`` applies it. Torch's CPU CSR matmul has a multi-millisecond floor per call (``benchmarks/solver.py``),
which this kernel does not.
"""

from __future__ import annotations

import numba
import numpy as np
import scipy.sparse as sp

from gm_graphs.store.kernel_cache import ensure_cache_dir

from .vector_math import LOOP, jit

ensure_cache_dir()  # before the cached kernels below are defined

_CHUNKS = 64  # row blocks of equal work, spread over the threads


def _balanced_chunks(indptr: np.ndarray, chunks: int = _CHUNKS) -> np.ndarray:
    """Row boundaries that split the work evenly: a row's non-zeros and four more for the row itself (its loop's
    start and end; at four, a product took 6 % less time than split by non-zeros alone, at sixteen 7 % more).

    The rows come longest first (:func:`compact`), and a tokenizer's frequent tokens hold most of Ã's
    non-zeros: split by row count, one thread would do most of the work.
    """
    cost = np.asarray(indptr, dtype=np.int64) + 4 * np.arange(indptr.size)
    bounds = np.searchsorted(cost, np.linspace(0, cost[-1], chunks + 1), side="left")
    bounds[0], bounds[-1] = 0, indptr.size - 1
    return np.maximum.accumulate(bounds).astype(np.int64)


# Sums over a row's non-zeros may be reordered (vectorized: four gathers at a time). The index arrays are unsigned
# (:func:`compact`): numba wraps a negative signed index around, and that check on every gather took half the time.
@jit(parallel=True, fastmath=LOOP)
def product(indptr, indices, data, rows, chunks, v, base, residual, which, out):
    # out[b] = base[b] − M·v[b] (``residual``) or M·v[b] for the rows b of v listed in ``which``, two at a time:
    # their 8 bytes a token stay in the core's cache while M streams past (a sixth less time than one row at a
    # time; all four rows of a batch of four at once did not fit, a third more). M's rows are all in ``rows``; the
    # ids beyond the graph are isolated nodes (M maps them to 0). Rows of ``out`` not in ``which`` are set to 0.
    n = rows.size
    listed = np.zeros(v.shape[0], dtype=np.bool_)
    listed[which] = True
    for b in range(v.shape[0]):
        if not listed[b]:
            out[b] = 0.0
    for k0 in range(0, which.size, 2):
        k1 = min(k0 + 1, which.size - 1)
        b0, b1 = which[k0], which[k1]
        v0, v1 = v[b0], v[b1]
        o0, o1 = out[b0], out[b1]
        for c in numba.prange(chunks.size - 1):
            for i in range(chunks[c], chunks[c + 1]):
                a0 = 0.0
                a1 = 0.0
                if k1 > k0:
                    for p in range(indptr[i], indptr[i + 1]):
                        w = data[p]
                        j = indices[p]
                        a0 += w * v0[j]
                        a1 += w * v1[j]
                else:
                    for p in range(indptr[i], indptr[i + 1]):
                        a0 += data[p] * v0[indices[p]]
                r = rows[i]
                o0[r] = base[b0, r] - a0 if residual else a0
                if k1 > k0:
                    o1[r] = base[b1, r] - a1 if residual else a1
        for k in range(k0, k1 + 1):
            b = which[k]
            for j in range(n, v.shape[1]):
                out[b, j] = base[b, j] if residual else 0.0


def compact(m: sp.csr_matrix) -> tuple[np.ndarray, ...]:
    """(indptr, indices, data, rows, chunks) of ``m`` for the kernels: its rows longest first (``rows``: their ids),
    so that neighbouring rows loop the same number of times (the branch predictor's guess holds: half the time of
    a product in row order); offsets and column ids in the narrowest unsigned type that holds them (a vocabulary
    under 65,536 tokens gives 2-byte ids)."""
    rows = np.argsort(-np.diff(np.asarray(m.indptr)), kind="stable")
    kept = m[rows]
    indptr = kept.indptr.astype(np.uint32 if kept.nnz < 2**32 else np.uint64)
    indices = kept.indices.astype(np.uint16 if m.shape[1] <= 2**16 else np.uint32)
    return indptr, indices, kept.data, rows.astype(np.int64), _balanced_chunks(indptr)
