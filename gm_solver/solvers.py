"""Solvers of the graphmax problem: certified entropic mirror descent, and the paper's Algorithm 1.

Both take logits ``z`` (B, V) in the working dtype and return ``(log x, SolveInfo)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

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


def softmax_solution(z: torch.Tensor) -> tuple[torch.Tensor, SolveInfo]:
    """The exact solution at λ = 0, where no regulariser is left: log softmax(z) in ``z``'s dtype, with the info of a
    solve that took no step (0 iterations, gap 0, converged). Every solver's entry returns it at λ = 0.

    The callers hand it their working dtype (float64) and round its result once to the scores' dtype, as they do
    every solution: a float32 log-sum-exp over SmolLM2's 49,152 logits is 1e-5 to 2.5e-5 low, by an amount that
    depends on the CPU's vector width (twice as far with AVX2 as with AVX-512), where float64 rounded to float32
    is within half a float32 ulp of log softmax(z) on any CPU.

    Args:
        z (``torch.Tensor`` (B, V)): the logits in the working dtype; ``-inf`` masks a token (x = 0 there).

    Returns:
        ``tuple[torch.Tensor, SolveInfo]``: log softmax(z), and the info of a solve certified where it starts.
    """
    zeros = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
    return torch.log_softmax(z, dim=-1), SolveInfo(zeros.long(), zeros, torch.ones_like(zeros, dtype=torch.bool), 0)


def _masked(v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, v, torch.full_like(v, -torch.inf))


def mirror_descent(z: torch.Tensor, op: TransitionOperator, lam: float, *, tol: float = 1e-6,
                   max_iter: int = 200, trace: bool = False,
                   check_every: int | None = None) -> tuple[torch.Tensor, SolveInfo]:
    """Preconditioned entropic mirror steps with an exact search on each step's segment, stopped by the duality gap.

    Candidate: log x_c = normalise(log x + η⊙r), r = log softmax(z − 2λLᵀLx) − log x, with each token's step
    η_j = 1 / (1 + λ D_j x_j), D = diag(LᵀL) (``op.gram_diagonal``): the plain fixed-point map (η = 1) where the
    graph term is flat, damped on the tokens where λ‖Lx‖² curves hard (a frequent token's column of M makes
    D_j hundreds). The solve starts from softmax(z) after two such steps on the diagonal part of the graph term
    alone (no product). Then x moves to the point t of the segment from x to x_c where f stops decreasing: Lx and LᵀLx
    are linear in t, so φ(t) = f(x + t(x_c − x)) and φ′ need no further product; t is the secant root of φ′
    between 0 and 1 (1 where φ′(1) ≤ 0), halved until f decreases. Every step is taken, so each costs exactly one
    M and one Mᵀ application per unconverged row (SmolLM2's logits on the movie-review graph, λ = 1: 3.6 applications
    of each per row, the start's included, against 9.2 for ratio-controlled steps that refused half their candidates).

    Rows are independent: every ``check_every`` iterations the rows whose gap
    is ≤ ``tol`` are dropped from the working batch (the numba backend's
    kernels and products pass over them at every step instead, with no copies),
    so a batch costs the sum of its rows' iterations, not its slowest row's
    times the batch. That check is the only host synchronisation: every
    iteration on CPU (free there), every 8 on other devices (in between,
    converged rows are frozen on device).
    ``check_every=0`` never synchronises: every row runs ``max_iter`` steps,
    frozen once converged, and ``info.converged`` tells (still on the device).
    """
    if check_every is None:
        check_every = 1 if z.device.type == "cpu" or trace else 8
    if not isinstance(check_every, int) or check_every < 0:
        raise ValueError(f"check_every must be an int >= 0 (0: never synchronise), got {check_every!r}")
    valid = z > -torch.inf  # the finite scores: NaN and +inf are refused before (check_logits)
    diag = op.gram_diagonal(z.shape[-1], z.dtype)
    start = op.applications
    s, x = _start(z, valid, diag, op, lam)
    lx, gram = op.residual_and_gram(x)
    f, g, ly = _score(z, valid, s, x, lx, gram, op, lam)
    iters = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    # the state of each row: log x, x, Lx, LᵀLx, log softmax(y), f, gap, the last step t, iterations
    state = [s, x, lx, gram, ly, f, g, torch.zeros_like(f), iters]
    # the torch path may read a value back within a step only where the solver synchronises anyway
    early = z.device.type == "cpu" and check_every > 0
    step = _fused_step if op.backend == "numba" else partial(_mirror_step, early=early)
    info = SolveInfo(iters, g, g <= tol, 0)
    if trace:
        info.gap_trace.append(g.clone())
    if check_every == 0:  # no host synchronisation: every row takes max_iter steps, frozen once converged
        for _ in range(max_iter):
            state = step(z, valid, diag, *state, op, lam, tol)
            if trace:
                info.gap_trace.append(state[6].clone())
                info.step_trace.append(state[7].clone())
    else:
        done = 0
        while done < max_iter:
            rows = torch.nonzero(state[6] > tol).squeeze(1)
            if rows.numel() == 0:
                break
            # no row has converged yet, or the numba kernels, which pass over converged rows themselves: the batch
            # as it is, without copies
            every = rows.numel() == z.shape[0] or op.backend == "numba"
            part = state if every else [t.index_select(0, rows) for t in state]
            zr, vr = (z, valid) if every else (z.index_select(0, rows), valid.index_select(0, rows))
            for _ in range(min(check_every, max_iter - done)):
                part = step(zr, vr, diag, *part, op, lam, tol)
                done += 1
            if every:
                state = part
            else:
                for full, p in zip(state, part):
                    full.index_copy_(0, rows, p)
            if trace:
                info.gap_trace.append(state[6].clone())
                info.step_trace.append(state[7].clone())
    s, g, iters = state[0], state[6], state[8]
    info.iterations, info.gap, info.converged = iters, g, g <= tol
    info.operator_applications = op.applications - start
    return s, info


def _start(z, valid, diag, op, lam):
    """(log x, x) where the solve starts: softmax(z) moved ``mirror_kernel.START_STEPS`` steps toward
    softmax(z − 2λ D⊙x), the graph term's diagonal alone."""
    if op.backend == "numba":
        z = z.contiguous()
        s, x = torch.empty_like(z), torch.empty_like(z)
        mirror_kernel.start_rows(z.numpy(), valid.contiguous().numpy(), diag.numpy(), lam, s.numpy(), x.numpy(),
                                 *(np.empty_like(s.numpy()) for _ in range(3)))
        return s, x
    s = torch.log_softmax(z, dim=-1)
    x = torch.exp(s)
    for _ in range(mirror_kernel.START_STEPS):
        s = _candidate(valid, s, x, torch.log_softmax(z - 2.0 * lam * diag * x, dim=-1), diag, lam)
        x = torch.exp(s)
    return s, x


def _candidate(valid, s, x, ly, diag, lam):
    """log x_c = log softmax(log x + η⊙(log softmax(y) − log x)), η_j = 1 / (1 + λ D_j x_j) (``_propose``'s)."""
    damp = torch.where(x > 0, 1.0 / (1.0 + lam * diag * x), torch.ones_like(x))
    return torch.log_softmax(_masked(s + damp * (ly - s), valid), dim=-1)


def _score(z, valid, s, x, lx, gram, op, lam):
    """(f, gap, log softmax(y)) of the rows x = exp(s) with their (Lx, LᵀLx)."""
    if op.backend == "numba":
        f, g, ly = (torch.empty_like(z[:, 0]), torch.empty_like(z[:, 0]), torch.empty_like(z))
        mirror_kernel.score_rows(z.numpy(), valid.numpy(), s.numpy(), x.numpy(), lx.numpy(), gram.numpy(), lam,
                                 ly.numpy(), f.numpy(), g.numpy())
        return f, g, ly
    ly = torch.log_softmax(z - 2.0 * lam * gram, dim=-1)
    return primal(x, z, lx, lam), gap_to(x, ly), ly


def _fused_step(z, valid, diag, s, x, lx, gram, ly, f, g, t, iters, op, lam, tol):
    """:func:`_mirror_step` with its vector work in ``mirror_kernel``'s fused passes (the numba backend's); the
    kernels and the products pass over the rows already at gap ≤ tol."""
    state = [u.contiguous() for u in (s, x, lx, gram, ly, f, g, t, iters)]
    s, x, lx, gram, ly, f, g, t, iters = (u.numpy() for u in state)  # updated in place by the kernels
    active = np.flatnonzero(g > tol)
    if active.size == 0:
        return state
    z, valid = z.contiguous().numpy(), valid.contiguous().numpy()
    cand, xc = np.empty_like(s), np.empty_like(s)
    mirror_kernel.propose_rows(valid, s, x, ly, diag.numpy(), lam, g, tol, cand, xc)
    lxc, gramc = op.residual_and_gram(torch.from_numpy(xc), rows=torch.from_numpy(active))
    mirror_kernel.judge_rows(z, valid, lam, tol, cand, xc, lxc.numpy(), gramc.numpy(), s, x, lx, gram, ly, f, g, t,
                             iters, np.empty_like(s))
    return state


def _mirror_step(z, valid, diag, s, x, lx, gram, ly, f, g, t, iters, op, lam, tol, *, early):
    """One step of :func:`mirror_descent` on a working batch; rows already at gap ≤ tol stay as they are."""
    active = g > tol
    cand = _candidate(valid, s, x, ly, diag, lam)
    xc = torch.exp(cand)
    lxc, gramc = op.residual_and_gram(xc)
    d, dl = xc - x, lxc - lx
    both = (x > 0) & (xc > 0)
    zero = torch.zeros_like(x)
    d0 = torch.where(both, d * (s - z), zero).sum(-1) + 2.0 * lam * (lx * dl).sum(-1)
    d1 = torch.where(both, d * (cand - z), zero).sum(-1) + 2.0 * lam * (lxc * dl).sum(-1)
    step = torch.where((d0 < 0) & (d1 > 0), d0 / (d0 - d1), torch.ones_like(d0))
    bound = f + mirror_kernel.SLACK * f.abs().clamp_min(1.0)
    f_t = primal(xc, z, lxc, lam)
    whole = step == 1.0
    step = torch.where(whole & (f_t > bound), torch.full_like(step, 0.5), step)
    whole = whole & (f_t <= bound)
    # the rows that take part of the segment: halve t until f decreases (no product: Lx is linear in t), as often
    # as the kernel does; with ``early`` the loop stops once no row needs it (a read-back, where one costs nothing)
    for halving in range(mirror_kernel.HALVINGS + 1):
        xt = x + step[:, None] * d
        lxt = lx + step[:, None] * dl
        f_t = torch.where(whole, f_t, primal(xt, z, lxt, lam))
        short = active & ~whole & (f_t > bound)
        if halving == mirror_kernel.HALVINGS or (early and not bool(short.any())):
            break
        step = torch.where(short, step * 0.5, step)
    moved = active & (f_t <= bound)
    step = torch.where(moved, step, torch.zeros_like(step))
    w = whole[:, None]
    xt = torch.where(w, xc, x + step[:, None] * d)
    st = torch.where(w, cand, torch.log(torch.where(xt > 0, xt, torch.ones_like(xt))).masked_fill(xt <= 0, -torch.inf))
    lxt = torch.where(w, lxc, lx + step[:, None] * dl)
    gramt = torch.where(w, gramc, gram + step[:, None] * (gramc - gram))
    ly_t = torch.log_softmax(z - 2.0 * lam * gramt, dim=-1)
    m = moved[:, None]
    s, x, lx, gram, ly = (torch.where(m, new, old) for new, old in
                          ((st, s), (xt, x), (lxt, lx), (gramt, gram), (ly_t, ly)))
    g = torch.where(moved, gap_to(x, ly), g)
    f = torch.where(moved, f_t, f)
    t = torch.where(active, step, t)
    return s, x, lx, gram, ly, f, g, t, iters + active.long()


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
