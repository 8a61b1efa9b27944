"""Solvers of the graphmax problem: certified entropic mirror descent, and the paper's Algorithm 1.

Both take logits ``z`` (B, V) in the working dtype and return ``(log x, SolveInfo)``.
"""

from __future__ import annotations

import torch

from . import backends
from .objective import dual_logits, gap
from .operator import TransitionOperator
from .solve_info import SolveInfo


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
        check_every = 1 if trace else backends.defaults(z.device).mirror_check_every
    if not isinstance(check_every, int) or check_every < 0:
        raise ValueError(f"check_every must be an int >= 0 (0: never synchronise), got {check_every!r}")
    valid = z > -torch.inf  # the finite scores: NaN and +inf are refused before (check_logits)
    diag = op.gram_diagonal(z.shape[-1], z.dtype)
    start = op.applications
    # the numba kernels, the torch backend's steps, or those steps compiled (once a warmup on a GPU turned them on)
    name = backends.choose(z.device, op.backend, fused=bool(op.use_fused))
    room = backends.room(name)
    s, x = room.mirror_start(z, valid, diag, lam)
    lx, gram = op.residual_and_gram(x)
    f, g, ly = room.mirror_score(z, valid, s, x, lx, gram, lam)
    iters = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    # the state of each row: log x, x, Lx, LᵀLx, log softmax(y), f, gap, the last step t, iterations
    state = [s, x, lx, gram, ly, f, g, torch.zeros_like(f), iters]
    # the torch path may read a value back within a step only where the solver synchronises anyway
    early = z.device.type == "cpu" and check_every > 0
    info = SolveInfo(iters, g, g <= tol, 0, backend=name)
    if trace:
        info.gap_trace.append(g.clone())
    if check_every == 0:  # no host synchronisation: every row takes max_iter steps, frozen once converged
        for _ in range(max_iter):
            state = room.mirror_step(z, valid, diag, *state, op, lam, tol, early=early)
            if trace:
                info.gap_trace.append(state[6].clone())
                info.step_trace.append(state[7].clone())
    else:
        done = 0
        while done < max_iter:
            rows = torch.nonzero(state[6] > tol).squeeze(1)
            if rows.numel() == 0:
                break
            # no row has converged yet, the numba kernels, which pass over converged rows themselves, or the
            # compiled steps, which a new working batch's shape would compile again: the batch as it is
            every = rows.numel() == z.shape[0] or name != "torch"
            part = state if every else [t.index_select(0, rows) for t in state]
            zr, vr = (z, valid) if every else (z.index_select(0, rows), valid.index_select(0, rows))
            for _ in range(min(check_every, max_iter - done)):
                part = room.mirror_step(zr, vr, diag, *part, op, lam, tol, early=early)
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
