"""The CPU kernels of :func:`gm_solver.solvers.mirror_descent`: its vector work per iteration, a few fused passes per
row, between the products with the graph (``TransitionOperator``, whose kernels they are apart from).

A step of the solver is :func:`propose_rows` (the residual, the step size and the candidate), the operator's
(Lx, LᵀLx) of the candidates, then :func:`judge_rows` (the objective, and for an accepted candidate its fixed-point
map and duality gap). Rows are (B, V) arrays, one row per thread; ``torch`` does the same in ``solvers._mirror_step``
on other devices, and the tests cross-check the two.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from gm_graphs.store.kernel_cache import ensure_cache_dir

from .lambert_kernel import LOOP, jit

ensure_cache_dir()  # before the cached kernels below are defined

# a relative slack on the objective's decrease absorbs float64 rounding of f near the optimum
SLACK = 1e-13


@jit(fastmath=LOOP)
def _objective(z, s, x, lx, gram, lam, y):
    """f(x) = ⟨x, log x − z⟩ + λ‖Lx‖² (log x = s), and y = z − 2λLᵀLx written to ``y`` with its largest finite entry."""
    f = 0.0
    for i in range(z.size):
        if x[i] > 0:
            f += x[i] * (s[i] - z[i])
    sq = 0.0
    for i in range(lx.size):
        sq += lx[i] * lx[i]
    top = -np.inf
    for i in range(z.size):
        yi = z[i] - 2.0 * lam * gram[i]
        y[i] = yi
        top = max(top, yi)
    return f + lam * sq, top


@jit(fastmath=LOOP)
def _log_softmax_gap(valid, s, x, y, top):
    """y ← log softmax(y) over the valid entries, in place; returns KL(x ‖ softmax(y)) ≥ 0, the duality gap."""
    total = 0.0
    for i in range(y.size):
        if valid[i]:
            total += math.exp(y[i] - top)
    lse = top + math.log(total)
    kl = 0.0
    for i in range(y.size):
        y[i] = y[i] - lse if valid[i] else -np.inf
        if x[i] > 0:
            kl += x[i] * (s[i] - y[i])
    return max(kl, 0.0)


@jit(parallel=True)
def score_rows(z, valid, s, x, lx, gram, lam, ly, f, g):
    """Each row's f(x), log softmax(y) (into ``ly``) and gap, for x = exp(s) and the operator's (Lx, LᵀLx)."""
    for b in numba.prange(z.shape[0]):
        f[b], top = _objective(z[b], s[b], x[b], lx[b], gram[b], lam, ly[b])
        g[b] = _log_softmax_gap(valid[b], s[b], x[b], ly[b], top)


@jit(fastmath=LOOP)
def _propose(valid, s, x, ly, r_prev, eta, cand, xc, r):
    # the residual r = log softmax(y) − log x, the step η from the ratio of successive residuals, and the candidate
    # log softmax(log x + η·r) with its exp; returns η
    den = 0.0
    num = 0.0
    for i in range(s.size):
        ri = ly[i] - s[i] if valid[i] else 0.0
        r[i] = ri
        den += x[i] * r_prev[i] * r_prev[i]
        num += x[i] * ri * r_prev[i]
    if den > 0:
        eta = min(1.0, max(0.02, eta / max(1.0 - num / den, 1e-3)))
    top = -np.inf
    for i in range(s.size):
        v = s[i] + eta * r[i] if valid[i] else -np.inf
        cand[i] = v
        top = max(top, v)
    total = 0.0
    for i in range(s.size):
        e = math.exp(cand[i] - top) if valid[i] else 0.0
        xc[i] = e
        total += e
    lse = top + math.log(total)
    scale = 1.0 / total
    for i in range(s.size):
        cand[i] -= lse
        xc[i] *= scale
    return eta


@jit(parallel=True)
def propose_rows(valid, s, x, ly, r_prev, eta, g, tol, cand, xc, r):
    """Each active row's candidate (``cand`` = its log, ``xc``) and residual ``r``; ``eta`` updated in place. A row
    at gap ≤ ``tol`` proposes itself."""
    for b in numba.prange(s.shape[0]):
        if g[b] > tol:
            eta[b] = _propose(valid[b], s[b], x[b], ly[b], r_prev[b], eta[b], cand[b], xc[b], r[b])
        else:
            cand[b] = s[b]
            xc[b] = x[b]


@jit(parallel=True)
def judge_rows(z, valid, lam, tol, cand, xc, lx, gram, r, y, s, x, ly, f, g, eta, iters, r_prev):
    """Each active row takes its candidate if it lowers f (its state ``s, x, ly, f, g, r_prev`` ← the candidate's),
    or halves its step and forgets its residual; ``y`` is scratch (B, V)."""
    for b in numba.prange(z.shape[0]):
        if not g[b] > tol:
            continue
        iters[b] += 1
        f_c, top = _objective(z[b], cand[b], xc[b], lx[b], gram[b], lam, y[b])
        if f_c <= f[b] + SLACK * max(abs(f[b]), 1.0):
            g[b] = _log_softmax_gap(valid[b], cand[b], xc[b], y[b], top)
            f[b] = f_c
            s[b] = cand[b]
            x[b] = xc[b]
            ly[b] = y[b]
            r_prev[b] = r[b]
        else:
            eta[b] *= 0.5
            r_prev[b] = 0.0
