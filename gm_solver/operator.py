"""The graph operator M (Ã, Ãᵏ or Ã+…+Ãⁿ) applied to batches of distributions, on CPU or GPU.

``TransitionOperator`` applies ``x ↦ Mx`` and ``v ↦ Mᵀv`` to each row of a
``(B, V)`` tensor. Logits wider than the graph (``V > N``; models pad their
vocabulary) treat the extra ids as isolated nodes: M maps them to 0.

Backends: ``numba`` runs the CSR products on the CPU's cores from a compact
copy of M and Mᵀ, built once (torch's CPU CSR matmul has a multi-millisecond
floor per call, see ``benchmarks/solver.py``); ``torch`` uses torch sparse
CSR tensors and is what runs on CUDA (cuSPARSE). Mᵀ is built once and cached.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import scipy.sparse as sp
import torch

from gm_graphs.store.kernel_cache import ensure_cache_dir

from .vector_math import LOOP, jit

ensure_cache_dir()  # before the cached kernels below are defined

_CHUNKS = 64  # row blocks of equal work, spread over the threads


def _balanced_chunks(indptr: np.ndarray, chunks: int = _CHUNKS) -> np.ndarray:
    """Row boundaries that split the work evenly: a row's non-zeros and four more for the row itself (its loop's
    start and end; at four, a product took 6 % less time than split by non-zeros alone, at sixteen 7 % more).

    The rows come longest first (:func:`_compact`), and a tokenizer's frequent tokens hold most of Ã's
    non-zeros: split by row count, one thread would do most of the work.
    """
    cost = np.asarray(indptr, dtype=np.int64) + 4 * np.arange(indptr.size)
    bounds = np.searchsorted(cost, np.linspace(0, cost[-1], chunks + 1), side="left")
    bounds[0], bounds[-1] = 0, indptr.size - 1
    return np.maximum.accumulate(bounds).astype(np.int64)


# Sums over a row's non-zeros may be reordered (vectorized: four gathers at a time). The index arrays are unsigned
# (:func:`_compact`): numba wraps a negative signed index around, and that check on every gather took half the time.
@jit(parallel=True, fastmath=LOOP)
def _csr_times_rows(indptr, indices, data, rows, chunks, v, base, residual, which, out):
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


def _row_indices(rows: Any, batch: int) -> bool:
    """Whether ``rows`` can index the rows of a batch of ``batch``: the kernel reads them unchecked."""
    return (isinstance(rows, torch.Tensor) and rows.dtype == torch.long and rows.dim() == 1
            and (rows.numel() == 0 or (int(rows.min()) >= 0 and int(rows.max()) < batch)))


def _compact(m: sp.csr_matrix) -> tuple[np.ndarray, ...]:
    """(indptr, indices, data, rows, chunks) of ``m`` for the kernels: its rows longest first (``rows``: their ids),
    so that neighbouring rows loop the same number of times (the branch predictor's guess holds: half the time of
    a product in row order); offsets and column ids in the narrowest unsigned type that holds them (a vocabulary
    under 65,536 tokens gives 2-byte ids)."""
    rows = np.argsort(-np.diff(np.asarray(m.indptr)), kind="stable")
    kept = m[rows]
    indptr = kept.indptr.astype(np.uint32 if kept.nnz < 2**32 else np.uint64)
    indices = kept.indices.astype(np.uint16 if m.shape[1] <= 2**16 else np.uint32)
    return indptr, indices, kept.data, rows.astype(np.int64), _balanced_chunks(indptr)


def _as_csr(graph: Any) -> tuple[sp.csr_matrix, str, int]:
    """(matrix to apply, kind 'power'|'mixture', times) for a Graph, scipy CSR or torch sparse CSR."""
    from gm_graphs import Graph

    if isinstance(graph, Graph):
        if graph.spec.k == 1 or (graph.materialized and not graph.pruned):
            return graph.matrix, "power", 1
        return graph.base, graph.spec.kind, graph.spec.k
    if isinstance(graph, torch.Tensor):
        if graph.layout != torch.sparse_csr:
            graph = graph.to_sparse_csr()
        g = graph.cpu()
        return sp.csr_matrix((g.values().numpy(), g.col_indices().numpy(), g.crow_indices().numpy()),
                             shape=tuple(g.shape)), "power", 1
    if sp.issparse(graph):
        return sp.csr_matrix(graph), "power", 1
    raise TypeError(f"graph must be a gm_graphs.Graph, a scipy sparse matrix or a torch sparse CSR tensor, "
                    f"got {type(graph).__name__}")


class TransitionOperator:
    """Applies M and Mᵀ to the rows of ``(B, V)`` tensors; M is exact (matrix-free for pruned orders).

    Build one once and pass it as ``graph`` to :func:`graphmax` and the processors: it holds M and its transpose.

    Args:
        graph (``gm_graphs.Graph``, scipy sparse matrix or torch sparse CSR tensor): M, square.
        device (``str`` or ``torch.device``, defaults to ``"cpu"``): where the rows it is applied to live.
        backend (``str``, defaults to ``"auto"``): ``"numba"`` (CPU kernels), ``"torch"`` (sparse CSR on
            ``device``) or ``"auto"`` (numba on the CPU, torch elsewhere).

    Example::

        >>> import scipy.sparse as sp, torch
        >>> op = TransitionOperator(sp.csr_matrix([[0, 1.0], [1.0, 0]]))
        >>> op.matvec(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
        tensor([[0.7500, 0.2500]], dtype=torch.float64)
    """

    def __init__(self, graph: Any, *, device: str | torch.device = "cpu", backend: str = "auto"):
        matrix, self.kind, self.times = _as_csr(graph)
        if matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"the graph operator must be square, got {matrix.shape}")
        self.n = matrix.shape[0]
        self.device = torch.device(device)
        if backend == "auto":
            backend = "numba" if self.device.type == "cpu" else "torch"
        if backend not in ("numba", "torch"):
            raise ValueError(f"backend must be 'auto', 'numba' or 'torch', got {backend!r}")
        if backend == "numba" and self.device.type != "cpu":
            raise ValueError("the numba backend runs on the CPU; use backend='torch' for device " + str(self.device))
        self.backend = backend
        self.nnz = int(matrix.nnz)
        transposed = matrix.T.tocsr()
        transposed.sort_indices()
        if backend == "numba":
            transposed.data = transposed.data.astype(matrix.data.dtype)
            self._fwd, self._bwd = _compact(matrix), _compact(transposed)
        else:
            self._fwd = self._torch_csr(matrix)
            self._bwd = self._torch_csr(transposed)
        self._matrix = matrix  # for gram_diagonal, which only the certified solver asks for
        self._diagonals: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.applications = 0

    def gram_diagonal(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """diag(LᵀL), L = I − M, as a (``width``,) tensor on the operator's device: exact for one matrix, an
        estimate for a chain (its base's, times n for a mixture of n terms); ids beyond the graph are isolated (1)."""
        key = (width, dtype)
        if key not in self._diagonals:
            # ‖L e_j‖² = 1 − 2M_jj + Σ_i M_ij²; a chain gets its base's, times n for a mixture of n terms: an
            # estimate is enough, as it only sets the solver's step sizes
            m = self._matrix
            squares = np.bincount(np.asarray(m.indices), weights=np.asarray(m.data, dtype=np.float64) ** 2,
                                  minlength=self.n)
            diag = np.ones(width)
            diag[:self.n] = (1.0 - 2.0 * m.diagonal().astype(np.float64) + squares) * (
                self.times if self.kind == "mixture" else 1)
            self._diagonals[key] = torch.as_tensor(diag, dtype=dtype, device=self.device)
        return self._diagonals[key]

    def _torch_csr(self, m: sp.csr_matrix) -> torch.Tensor:
        index = torch.int32 if m.nnz < 2**31 else torch.int64
        return torch.sparse_csr_tensor(torch.as_tensor(np.asarray(m.indptr), dtype=index),
                                       torch.as_tensor(np.asarray(m.indices), dtype=index),
                                       torch.as_tensor(np.asarray(m.data, dtype=np.float64)),
                                       size=m.shape, check_invariants=False).to(self.device)

    def _apply(self, csr, v: torch.Tensor, base: torch.Tensor, residual: bool,
               rows: torch.Tensor | None) -> torch.Tensor:
        """``base − Mv`` (``residual``) or ``Mv``, row by row: every row, or only ``rows`` (the others are 0)."""
        self.applications += 1
        if self.backend == "numba":
            out = torch.empty_like(v)
            which = np.arange(v.shape[0]) if rows is None else rows.numpy()
            _csr_times_rows(*csr, v.contiguous().numpy(), base.contiguous().numpy(), residual, which, out.numpy())
            return out
        if rows is None:
            return self._torch_product(csr, v, base, residual)
        out = torch.zeros_like(v)
        out[rows] = self._torch_product(csr, v[rows], base[rows], residual)
        return out

    def _torch_product(self, csr, v: torch.Tensor, base: torch.Tensor, residual: bool) -> torch.Tensor:
        out = torch.zeros_like(v)  # the ids beyond the graph are isolated nodes: M maps them to 0
        out[:, :self.n] = (csr @ v[:, :self.n].T.to(csr.dtype)).T.to(v.dtype)  # M is stored in float64
        return base - out if residual else out

    def _chain(self, csr, x: torch.Tensor, residual: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Mx, or x − Mx (``residual``: the last product writes it); of ``rows`` only, when given."""
        if self.kind == "power":
            v = x
            for k in range(self.times):
                v = self._apply(csr, v, x, residual and k == self.times - 1, rows)
            return v
        # mixture Σ_{j=1..n} Mʲx by Horner's rule: M(x + M(x + … M x))
        acc = self._apply(csr, x, x, residual and self.times == 1, rows)
        for k in range(self.times - 1):
            acc = self._apply(csr, x + acc, x, residual and k == self.times - 2, rows)
        return acc

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """Mx for each row x of ``x`` (B, V)."""
        return self._chain(self._fwd, x)

    def rmatvec(self, v: torch.Tensor) -> torch.Tensor:
        """Mᵀv for each row v of ``v`` (B, V)."""
        return self._chain(self._bwd, v)

    def residual_and_gram(self, x: torch.Tensor,
                          rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(Lx, LᵀLx) for each row x of ``x`` (B, V), L = I − M: one M and one Mᵀ application. With ``rows`` (a
        1-D long tensor of row indices) only those rows are computed, and the others of both results are 0:
        a solver whose converged rows stay where they are asks for the others without copying them out."""
        if rows is not None and not _row_indices(rows, x.shape[0]):
            raise ValueError(f"rows must be a 1-D long tensor of row indices in [0, {x.shape[0]}), got {rows!r}")
        lx = self._chain(self._fwd, x, residual=True, rows=rows)
        return lx, self._chain(self._bwd, lx, residual=True, rows=rows)
