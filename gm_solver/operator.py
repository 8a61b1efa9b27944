"""The graph operator M (Ã, Ãᵏ or Ã+…+Ãⁿ) applied to batches of distributions, on CPU or GPU.

``TransitionOperator`` applies ``x ↦ Mx`` and ``v ↦ Mᵀv`` to each row of a
``(B, V)`` tensor. Logits wider than the graph (``V > N``; models pad their
vocabulary) treat the extra ids as isolated nodes: M maps them to 0.

The products are the backends' ``csr_product`` (``gm_solver.backends``): ``numba``
on the CPU's cores from a compact copy of M and Mᵀ, ``torch`` with torch sparse
CSR tensors (cuSPARSE on CUDA). Mᵀ is built once and cached.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from . import backends


def _row_indices(rows: Any, batch: int) -> bool:
    """Whether ``rows`` can index the rows of a batch of ``batch``: the kernel reads them unchecked."""
    return (isinstance(rows, torch.Tensor) and rows.dtype == torch.long and rows.dim() == 1
            and (rows.numel() == 0 or (int(rows.min()) >= 0 and int(rows.max()) < batch)))


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
            ``device``, the mirror steps eager even after a warm-up), ``"fused"`` (torch's products, and the mirror
            steps around them compiled: CUDA) or ``"auto"`` (numba on the CPU, torch elsewhere; fused once a
            decoder's warmup on a GPU turned it on).

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
        self.device = backends.canonical(device)
        # the fused backend compiles the mirror steps around these products, which run eager on its device
        chosen = backends.choose(self.device, backend)
        self.backend = "torch" if chosen == "fused" else chosen
        self._room = backends.room(self.backend)
        # the switch of the paper decoder's compiled mirror steps, which backends.choose reads: True on wherever
        # they compile, False never (a "torch" asked for by name stays eager until turned on by hand); None, until a
        # decoder's warmup on a GPU turns them on (compiling is paid there)
        self.use_fused: bool | None = True if chosen == "fused" else False if backend == "torch" else None
        self.nnz = int(matrix.nnz)
        transposed = matrix.T.tocsr()
        transposed.sort_indices()
        transposed.data = transposed.data.astype(matrix.data.dtype)
        self._fwd = self._room.csr_layout(matrix, self.device)
        self._bwd = self._room.csr_layout(transposed, self.device)
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

    def _apply(self, csr, v: torch.Tensor, base: torch.Tensor, residual: bool,
               rows: torch.Tensor | None) -> torch.Tensor:
        """``base − Mv`` (``residual``) or ``Mv``, row by row: every row, or only ``rows`` (the others are 0)."""
        self.applications += 1
        return self._room.csr_product(csr, v, base, residual, rows)

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
