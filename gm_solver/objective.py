"""The graphmax objective, its dual and the duality-gap certificate.

Primal, over the probability simplex, with L = I − M (M the graph operator):

    f(x) = −⟨x, z⟩ + ⟨x, log x⟩ + λ‖Lx‖²

Dual, for any u:  g(u) = −logsumexp(z − Lᵀu) − ‖u‖²/(4λ)  ≤  f(x*)  ≤  f(x).

At u = 2λLx, with y = z − 2λLᵀLx, the gap simplifies to

    f(x) − g(u) = ⟨x, log x − y⟩ + logsumexp(y) = KL(x ‖ softmax(y)) ≥ 0,

zero exactly at the fixed point x* = softmax(z − 2λLᵀLx*).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .operator import TransitionOperator


def xlogx(x: torch.Tensor) -> torch.Tensor:
    """Σ x log x per row with 0 log 0 = 0."""
    return torch.where(x > 0, x * torch.log(torch.where(x > 0, x, torch.ones_like(x))), torch.zeros_like(x)).sum(-1)


def dual_logits(z: torch.Tensor, x: torch.Tensor, lam: float,
                op: TransitionOperator) -> tuple[torch.Tensor, torch.Tensor]:
    """(Lx, y) with y = z − 2λLᵀLx; softmax(y) is the fixed-point map and the dual's primal point."""
    lx, gram = op.residual_and_gram(x)
    return lx, z - 2.0 * lam * gram


def primal(x: torch.Tensor, z: torch.Tensor, lx: torch.Tensor, lam: float) -> torch.Tensor:
    """f(x) per row; −inf logits must carry x = 0."""
    zx = torch.where(x > 0, x * z, torch.zeros_like(x)).sum(-1)
    return -zx + xlogx(x) + lam * (lx * lx).sum(-1)


def dual(u: torch.Tensor, z: torch.Tensor, lam: float, op: TransitionOperator) -> torch.Tensor:
    """g(u) per row, for any u (the general form, used to cross-check the gap)."""
    return -torch.logsumexp(z - (u - op.rmatvec(u)), dim=-1) - (u * u).sum(-1) / (4.0 * lam)


def gap(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """f(x) − g(2λLx) = KL(x ‖ softmax(y)) per row, clamped at 0 against rounding."""
    return gap_to(x, torch.log_softmax(y, dim=-1))


def gap_to(x: torch.Tensor, log_t: torch.Tensor) -> torch.Tensor:
    """:func:`gap` for ``log_t`` = log softmax(y) already at hand."""
    logx = torch.log(torch.where(x > 0, x, torch.ones_like(x)))
    kl = torch.where(x > 0, x * (logx - log_t), torch.zeros_like(x)).sum(-1)
    return kl.clamp_min(0.0)


def certificate(x: torch.Tensor, z: torch.Tensor, lam: float, op: TransitionOperator) -> torch.Tensor:
    """The duality gap of any point ``x`` on the simplex (rows), computed from scratch: f(x) − f(x*) ≤ gap, so a
    gap ≤ ε certifies ``x`` ε-optimal whatever solver produced it.

    Args:
        x (``torch.Tensor`` (B, N)): rows on the simplex (0 where ``z`` is ``-inf``).
        z (``torch.Tensor`` (B, N)): the logits, in ``x``'s dtype.
        lam (``float``): λ ≥ 0.
        op (``TransitionOperator``): M.

    Returns:
        ``torch.Tensor`` (B,): the gap of each row, ≥ 0.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> from gm_solver import graphmax
        >>> from gm_solver.operator import TransitionOperator
        >>> op = TransitionOperator(sp.csr_matrix([[0, 1.0], [1.0, 0]]))
        >>> z = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
        >>> x = graphmax(z, op, lam=0.5)
        >>> bool(certificate(x, z, 0.5, op) <= 1e-6), bool(certificate(torch.softmax(z, -1), z, 0.5, op) > 1e-3)
        (True, True)
    """
    if lam == 0:
        return gap(x, z)
    return gap(x, dual_logits(z, x, lam, op)[1])
