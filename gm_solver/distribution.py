"""The paper's graph-regularised softmax, ``graphmax`` and ``log_graphmax``: a function and an nn.Module (this
module is not named for them, since ``gm_solver.graphmax`` is the function)."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from . import backends
from .checks import logit_value_checks, raise_unless
from .operator import TransitionOperator
from .solve_info import softmax_solution
from .solvers import mirror_descent, paper_pgd

SOLVERS = ("mirror", "paper")
_operators: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def get_operator(graph: Any, device: torch.device, backend: str = "auto") -> TransitionOperator:
    """The cached :class:`TransitionOperator` of ``graph`` on ``device`` (built once: it transposes M)."""
    if isinstance(graph, TransitionOperator):
        return graph
    device = backends.canonical(device)
    try:
        per_graph = _operators.setdefault(graph, {})
    except TypeError:  # not weak-referenceable: build each time
        return TransitionOperator(graph, device=device, backend=backend)
    key = (str(device), backend)
    if key not in per_graph:
        per_graph[key] = TransitionOperator(graph, device=device, backend=backend)
    return per_graph[key]


def check_logits(logits: torch.Tensor, *, sync: bool) -> None:
    """Refuse what no graphmax decoder takes as scores, each with a one-line error: not a floating-point tensor of
    shape (N,) or (B, N), NaN, ``+inf``, or a row with no finite score. ``sync`` False asserts the values on the device
    (a failure then surfaces as a device-side assert).

    Example::

        >>> check_logits(torch.tensor([[0.0, -torch.inf]]), sync=True)
        >>> check_logits(torch.tensor([-torch.inf]), sync=True)
        Traceback (most recent call last):
        ValueError: a row of logits is entirely -inf: no token is allowed, so there is no distribution
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point torch tensor, got {type(logits).__name__}")
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits must have shape (N,) or (B, N), got {tuple(logits.shape)}")
    raise_unless(logit_value_checks(logits), sync)


def _check_settings(lam: float, tol: float, solver: str) -> None:
    if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
        raise ValueError(f"lam must be a finite float >= 0 (0 gives softmax), got {lam!r}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")


def _solve(logits, graph, lam, tol, max_iter, solver, backend, dtype, trace, check_every):
    _check_settings(lam, tol, solver)
    check_logits(logits, sync=check_every != 0)
    op = get_operator(graph, logits.device, backend)
    z = logits.reshape(-1, logits.shape[-1]).to(dtype)
    if z.shape[-1] < op.n:
        raise ValueError(f"logits have {z.shape[-1]} entries but the graph has {op.n} nodes; the graph was "
                         f"built for a larger vocabulary: rebuild it with this model's tokenizer")
    if lam == 0:  # no kernel runs: a gradient flows on either backend
        return softmax_solution(z)
    if op.backend == "numba":  # its kernels take values, as the context decoder's: the result carries no gradient
        z = z.detach()
    if solver == "paper":
        return paper_pgd(z, op, lam, trace=trace)
    return mirror_descent(z, op, lam, tol=tol, max_iter=max_iter, trace=trace, check_every=check_every)


def graphmax(logits: torch.Tensor, graph: Any, lam: float = 1.0, *, tol: float = 1e-6, max_iter: int = 200,
             solver: str = "mirror", backend: str = "auto", dtype: torch.dtype = torch.float64,
             return_info: bool = False, trace: bool = False, check_every: int | None = None):
    """argmin over the simplex of −⟨x,z⟩ + ⟨x,log x⟩ + λ‖x − Mx‖², per row of ``logits``.

    ``graph`` is a ``gm_graphs.Graph`` (Ã, Ãᵏ or a mixture; pruned orders are
    applied exactly, matrix-free), a scipy sparse matrix, a torch sparse CSR
    tensor, or a :class:`TransitionOperator`. The default solver stops at a
    certified duality gap ≤ ``tol``; ``solver="paper"`` runs the paper's
    Algorithm 1 (which does not reach the optimum). ``-inf`` logits get
    probability exactly 0. Logits wider than the graph treat the extra ids as
    isolated nodes. Computes in ``dtype`` (float64: the gap is certified to
    1e-6) and returns the input's dtype. ``check_every`` sets how often the
    solver reads the gaps back to the host (default: every iteration on CPU,
    every 8 on GPUs); ``0`` never does: ``max_iter`` steps, converged rows
    frozen, input checks asserted on the device; read ``info.converged``.

    Args:
        logits (``torch.Tensor`` (N,) or (B, N)): z, floating point; ``-inf`` masks a token, NaN and ``+inf``
            are refused.
        graph (``gm_graphs.Graph``, scipy sparse matrix, torch sparse CSR tensor or ``TransitionOperator``): M.
        lam (``float``, defaults to 1.0): λ ≥ 0, finite; 0 gives softmax, computed in ``dtype`` (0 iterations,
            gap 0).
        tol (``float``, defaults to 1e-6): the certified duality gap at which the solve stops.
        max_iter (``int``, defaults to 200): the iteration budget.
        solver (``str``, defaults to ``"mirror"``): ``"mirror"`` (certified mirror descent) or ``"paper"`` (the
            paper's Algorithm 1).
        backend (``str``, defaults to ``"auto"``): how M is applied: ``"numba"`` (CPU), ``"torch"`` (any device)
            or ``"auto"``.
        dtype (``torch.dtype``, defaults to ``torch.float64``): the working dtype.
        return_info (``bool``, defaults to ``False``): also return the solve's :class:`SolveInfo`.
        trace (``bool``, defaults to ``False``): record the gap and step of every iteration in the info.
        check_every (``int`` or ``None``, defaults to ``None``): iterations between the checks that read the gaps
            back to the host (0: never).

    Returns:
        ``torch.Tensor``: x, the logits' shape and dtype, rows summing to 1; with ``return_info``, ``(x, info)``.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> A = sp.csr_matrix([[0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]])
        >>> p, info = graphmax(torch.tensor([2.0, 1.0, 0.0]), A, lam=1.0, return_info=True)
        >>> bool(info.gap.max() <= 1e-6), round(float(p.sum()), 6)
        (True, 1.0)
    """
    logp, info = _solve(logits, graph, lam, tol, max_iter, solver, backend, dtype, trace, check_every)
    x = torch.exp(logp).to(logits.dtype).reshape(logits.shape)
    return (x, info) if return_info else x


def log_graphmax(logits: torch.Tensor, graph: Any, lam: float = 1.0, *, tol: float = 1e-6, max_iter: int = 200,
                 solver: str = "mirror", backend: str = "auto", dtype: torch.dtype = torch.float64,
                 return_info: bool = False, trace: bool = False, check_every: int | None = None):
    """log of :func:`graphmax`, computed directly in log space (``-inf`` where the probability is 0).

    Args:
        logits (``torch.Tensor`` (N,) or (B, N)): z, as for :func:`graphmax`.
        graph (``gm_graphs.Graph``, scipy sparse matrix, torch sparse CSR tensor or ``TransitionOperator``): M.
        lam (``float``, defaults to 1.0): λ ≥ 0, finite; 0 gives log-softmax, computed in ``dtype``.
        tol (``float``, defaults to 1e-6): the certified duality gap at which the solve stops.
        max_iter (``int``, defaults to 200): the iteration budget.
        solver (``str``, defaults to ``"mirror"``): ``"mirror"`` or ``"paper"``.
        backend (``str``, defaults to ``"auto"``): ``"numba"``, ``"torch"`` or ``"auto"``.
        dtype (``torch.dtype``, defaults to ``torch.float64``): the working dtype.
        return_info (``bool``, defaults to ``False``): also return the solve's :class:`SolveInfo`.
        trace (``bool``, defaults to ``False``): record the gap and step of every iteration in the info.
        check_every (``int`` or ``None``, defaults to ``None``): iterations between host-side convergence checks.

    Returns:
        ``torch.Tensor``: log x, the logits' shape and dtype; with ``return_info``, ``(log x, info)``.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> A = sp.csr_matrix([[0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]])
        >>> logp = log_graphmax(torch.tensor([[2.0, 1.0, -torch.inf]]), A, lam=1.0)
        >>> [round(v, 3) for v in logp.exp()[0].tolist()], logp[0, 2].item()
        ([0.562, 0.438, 0.0], -inf)
    """
    logp, info = _solve(logits, graph, lam, tol, max_iter, solver, backend, dtype, trace, check_every)
    logp = logp.to(logits.dtype).reshape(logits.shape)
    return (logp, info) if return_info else logp


class Graphmax(torch.nn.Module):
    """:func:`graphmax` over the last dimension as a module.

    Args:
        graph (``gm_graphs.Graph``, scipy sparse matrix, torch sparse CSR tensor or ``TransitionOperator``): M.
        lam (``float``, defaults to 1.0): λ ≥ 0, finite; 0 gives softmax.
        **kwargs: the keyword arguments of :func:`graphmax` (``tol``, ``max_iter``, ``solver``, …).

    Example::

        >>> import scipy.sparse as sp, torch
        >>> layer = Graphmax(sp.csr_matrix([[0, 1.0], [1.0, 0]]), lam=0.5)
        >>> [round(v, 3) for v in layer(torch.tensor([[1.0, 0.0]]))[0].tolist()]
        [0.583, 0.417]
    """

    def __init__(self, graph: Any, lam: float = 1.0, **kwargs):
        super().__init__()
        if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
            raise ValueError(f"lam must be a finite float >= 0 (0 gives softmax), got {lam!r}")
        self.graph, self.lam, self.kwargs = graph, lam, kwargs

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return graphmax(logits, self.graph, self.lam, **self.kwargs)


class LogGraphmax(Graphmax):
    """:func:`log_graphmax` over the last dimension as a module.

    Args:
        graph (``gm_graphs.Graph``, scipy sparse matrix, torch sparse CSR tensor or ``TransitionOperator``): M.
        lam (``float``, defaults to 1.0): λ ≥ 0, finite; 0 gives log-softmax.
        **kwargs: the keyword arguments of :func:`log_graphmax` (``tol``, ``max_iter``, ``solver``, …).

    Example::

        >>> import scipy.sparse as sp, torch
        >>> layer = LogGraphmax(sp.csr_matrix([[0, 1.0], [1.0, 0]]), lam=0.5)
        >>> [round(v, 3) for v in layer(torch.tensor([[1.0, 0.0]])).exp()[0].tolist()]
        [0.583, 0.417]
    """

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return log_graphmax(logits, self.graph, self.lam, **self.kwargs)
