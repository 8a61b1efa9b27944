"""Solvers of the graphmax problem: certified entropic mirror descent, and the paper's Algorithm 1.

Both take logits ``z`` (B, V) in the working dtype and return ``(log x, SolveInfo)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import mirror_kernel
from .objective import dual_logits, gap, gap_to, primal
from .operator import TransitionOperator


@dataclass
class SolveInfo:
    """Per-row iterations and duality gap, total operator applications, and traces when asked for: what every
    solve returns beside the distribution.

    Args:
        iterations (``torch.Tensor`` (B,)): the iterations (or ν steps) each row took.
        gap (``torch.Tensor`` (B,)): each row's certified duality gap.
        converged (``torch.Tensor`` (B,) of ``bool``): rows whose gap reached the tolerance.
        operator_applications (``int``): products with M or Mᵀ, all rows together.
        gap_trace (``list[torch.Tensor]``, defaults to ``[]``): the gaps after each iteration (``trace=True``).
        step_trace (``list[torch.Tensor]``, defaults to ``[]``): the step sizes of each iteration (``trace=True``).

    Example::

        >>> import scipy.sparse as sp, torch
        >>> from gm_solver import graphmax
        >>> x, info = graphmax(torch.tensor([[1.0, 0.0]]), sp.csr_matrix([[0, 1.0], [1.0, 0]]), return_info=True)
        >>> bool(info.converged.all()), bool(info.gap.max() <= 1e-6), info.operator_applications > 0
        (True, True, True)
    """

    iterations: torch.Tensor
    gap: torch.Tensor
    converged: torch.Tensor
    operator_applications: int
    gap_trace: list[torch.Tensor] = field(default_factory=list)
    step_trace: list[torch.Tensor] = field(default_factory=list)


def _masked(v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, v, torch.full_like(v, -torch.inf))


def mirror_descent(z: torch.Tensor, op: TransitionOperator, lam: float, *, tol: float = 1e-6,
                   max_iter: int = 200, trace: bool = False,
                   check_every: int | None = None) -> tuple[torch.Tensor, SolveInfo]:
    """Entropic mirror descent with per-row step control, stopped by the duality gap.

    Step: log x ← normalise(log x + η·r), r = log softmax(z − 2λLᵀLx) − log x,
    so η = 1 is the plain fixed-point map. It stays strictly inside the simplex
    (on the finite logits). η follows the ratio ρ = ⟨r, r_prev⟩ / ‖r_prev‖²
    (weighted by x) of successive residuals: a fixed-point map that overshoots
    (ρ < 0, the oscillation that makes η = 1 diverge when λ‖LᵀL‖ is large, or
    crawl when it sits near the edge) gets η ← η / (1 − ρ), the damping that
    cancels a mode of ratio ρ. A step that does not lower f is refused and
    halves η. Each step costs one M and one Mᵀ application per unconverged row.

    Rows are independent: every ``check_every`` iterations the rows whose gap
    is ≤ ``tol`` are dropped from the working batch, so a batch costs the sum
    of its rows' iterations, not its slowest row's times the batch. That check
    is the only host synchronisation: every iteration on CPU (free there),
    every 8 on other devices (in between, converged rows are frozen on device).
    ``check_every=0`` never synchronises: every row runs ``max_iter`` steps,
    frozen once converged, and ``info.converged`` tells (still on the device).
    """
    if check_every is None:
        check_every = 1 if z.device.type == "cpu" or trace else 8
    if not isinstance(check_every, int) or check_every < 0:
        raise ValueError(f"check_every must be an int >= 0 (0: never synchronise), got {check_every!r}")
    valid = torch.isfinite(z)
    start = op.applications
    s = torch.log_softmax(z, dim=-1)
    x = torch.exp(s)
    f, g, ly = _score(z, valid, s, x, op, lam)
    eta = torch.ones_like(f)
    iters = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    # the state of each row: log x, x, log softmax(y), f, gap, η, iterations, the previous residual (0: none)
    state = [s, x, ly, f, g, eta, iters, torch.zeros_like(s)]
    step = _fused_step if op.backend == "numba" else _mirror_step
    info = SolveInfo(iters, g, g <= tol, 0)
    if trace:
        info.gap_trace.append(g.clone())
    if check_every == 0:  # no host synchronisation: every row takes max_iter steps, frozen once converged
        for _ in range(max_iter):
            state = step(z, valid, *state, op, lam, tol)
            if trace:
                info.gap_trace.append(state[4].clone())
                info.step_trace.append(state[5].clone())
    else:
        done = 0
        while done < max_iter:
            rows = torch.nonzero(state[4] > tol).squeeze(1)
            if rows.numel() == 0:
                break
            every = rows.numel() == z.shape[0]  # no row has converged yet: the batch as it is, without copies
            part = state if every else [t.index_select(0, rows) for t in state]
            zr, vr = (z, valid) if every else (z.index_select(0, rows), valid.index_select(0, rows))
            for _ in range(min(check_every, max_iter - done)):
                part = step(zr, vr, *part, op, lam, tol)
                done += 1
            if every:
                state = part
            else:
                for full, p in zip(state, part):
                    full.index_copy_(0, rows, p)
            if trace:
                info.gap_trace.append(state[4].clone())
                info.step_trace.append(state[5].clone())
    s, _, _, _, g, _, iters, _ = state
    info.iterations, info.gap, info.converged = iters, g, g <= tol
    info.operator_applications = op.applications - start
    return s, info


def _score(z, valid, s, x, op, lam):
    """(f, gap, log softmax(y)) of the rows x = exp(s)."""
    lx, gram = op.residual_and_gram(x)
    if op.backend == "numba":
        f, g, ly = (torch.empty_like(z[:, 0]), torch.empty_like(z[:, 0]), torch.empty_like(z))
        mirror_kernel.score_rows(z.numpy(), valid.numpy(), s.numpy(), x.numpy(), lx.numpy(), gram.numpy(), lam,
                                 ly.numpy(), f.numpy(), g.numpy())
        return f, g, ly
    ly = torch.log_softmax(z - 2.0 * lam * gram, dim=-1)
    return primal(x, z, lx, lam), gap_to(x, ly), ly


def _fused_step(z, valid, s, x, ly, f, g, eta, iters, r_prev, op, lam, tol):
    """:func:`_mirror_step` with its vector work in ``mirror_kernel``'s fused passes (the numba backend's)."""
    state = [t.contiguous() for t in (s, x, ly, f, g, eta, iters, r_prev)]
    s, x, ly, f, g, eta, iters, r_prev = (t.numpy() for t in state)  # updated in place by the kernels
    z, valid = z.contiguous().numpy(), valid.contiguous().numpy()
    cand, xc, r = np.empty_like(s), np.empty_like(s), np.empty_like(s)
    mirror_kernel.propose_rows(valid, s, x, ly, r_prev, eta, g, tol, cand, xc, r)
    lx, gram = op.residual_and_gram(torch.from_numpy(xc))
    mirror_kernel.judge_rows(z, valid, lam, tol, cand, xc, lx.numpy(), gram.numpy(), r, np.empty_like(s), s, x, ly,
                             f, g, eta, iters, r_prev)
    return state


def _mirror_step(z, valid, s, x, ly, f, g, eta, iters, r_prev, op, lam, tol):
    """One step of :func:`mirror_descent` on a working batch; rows already at gap ≤ tol stay as they are."""
    active = g > tol
    r = torch.where(valid, ly - s, torch.zeros_like(s))
    den = (x * r_prev * r_prev).sum(-1)
    rho = (x * r * r_prev).sum(-1) / torch.where(den > 0, den, torch.ones_like(den))
    eta = torch.where(active & (den > 0), (eta / (1.0 - rho).clamp_min(1e-3)).clamp(0.02, 1.0), eta)
    cand = torch.log_softmax(_masked(s + eta[:, None] * r, valid), dim=-1)
    x_c = torch.exp(cand)
    lx_c, y_c = dual_logits(z, x_c, lam, op)
    f_c = primal(x_c, z, lx_c, lam)
    accept = active & (f_c <= f + mirror_kernel.SLACK * f.abs().clamp_min(1.0))
    a = accept[:, None]
    ly_c = torch.log_softmax(y_c, dim=-1)
    s, x, ly = torch.where(a, cand, s), torch.where(a, x_c, x), torch.where(a, ly_c, ly)
    g = torch.where(accept, gap_to(x_c, ly_c), g)
    f = torch.where(accept, f_c, f)
    # a refused step halves η and forgets r: ρ compares residuals of accepted steps only
    r_prev = torch.where(a, r, torch.where(active[:, None], torch.zeros_like(r), r_prev))
    eta = torch.where(accept | ~active, eta, eta * 0.5)
    return s, x, ly, f, g, eta, iters + active.long(), r_prev


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of each row onto the probability simplex (sort-based; Duchi et al. 2008)."""
    u, _ = torch.sort(v, dim=-1, descending=True)
    css = torch.cumsum(u, dim=-1) - 1.0
    k = torch.arange(1, v.shape[-1] + 1, device=v.device, dtype=v.dtype)
    rho = ((u - css / k) > 0).sum(dim=-1, keepdim=True)
    theta = css.gather(-1, rho - 1) / rho.to(v.dtype)
    return (v - theta).clamp_min(0.0)


def paper_pgd(z: torch.Tensor, op: TransitionOperator, lam: float, *, alpha: float = 1e-4, max_iter: int = 20,
              stop: float = 1e-4, trace: bool = False) -> tuple[torch.Tensor, SolveInfo]:
    """The paper's Algorithm 1 as printed: x¹ = 0, xᵗ⁺¹ = Proj(xᵗ − α∇f(xᵗ)), T = 20, stop at ‖Δx‖₂ < 1e-4.

    It does not reach the optimum: log 0 at x¹ = 0 and the exact zeros made by
    the projection are evaluated as log(smallest normal float) (≈ −708 in
    float64), which floods the first step, and α = 1e-4 with T = 20 then moves
    x by at most 2e-3. The duality gap it leaves is returned in the info
    (``benchmarks/solver.py`` prints it on real logits: far above 1e-6).
    """
    tiny = torch.finfo(z.dtype).tiny
    finite_z = torch.where(torch.isfinite(z), z, torch.full_like(z, -1e30))
    x = torch.zeros_like(z)
    iters = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    start = op.applications
    info = SolveInfo(iters, torch.zeros_like(z[:, 0]), torch.zeros_like(iters, dtype=torch.bool), 0)
    moving = torch.ones_like(iters, dtype=torch.bool)
    for _ in range(max_iter):
        # ∇f = −z + log x + 1 + 2λLᵀLx = log x + 1 − y
        grad = torch.log(x.clamp_min(tiny)) + 1.0 - dual_logits(finite_z, x, lam, op)[1]
        x_new = project_simplex(x - alpha * grad)
        delta = torch.linalg.vector_norm(x_new - x, dim=-1)
        x = torch.where(moving[:, None], x_new, x)
        iters = iters + moving.long()
        if trace:
            info.step_trace.append(delta.clone())
            info.gap_trace.append(gap(x, dual_logits(z, x, lam, op)[1]))
        moving = moving & (delta >= stop)
        if not bool(moving.any()):
            break
    info.iterations = iters
    info.operator_applications = op.applications - start
    info.gap = gap(x, dual_logits(z, x, lam, op)[1])
    info.converged = info.gap <= 1e-6
    return torch.log(x), info
