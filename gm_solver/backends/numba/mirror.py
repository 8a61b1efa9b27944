"""The CPU kernels of :func:`gm_solver.solvers.mirror_descent`: its vector work per iteration, a few fused passes per
row, between the products with the graph (``TransitionOperator``, whose kernels they are apart from).

A step of the solver is :func:`propose_rows` (the mirror step's candidate, each token's step damped by the curvature
the graph term puts on it), the operator's (Lx, LᵀLx) of the candidates, then :func:`judge_rows` (the best point on
the segment from x to the candidate, found without another product, its fixed-point map and duality gap). Rows are
(B, V) arrays, one row per thread; ``torch`` does the same in ``backends.eager.mirror_step`` on other devices, and the
tests cross-check the two.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from gm_graphs.store.kernel_cache import ensure_cache_dir

from .vector_math import LOOP, exp, jit, log, maximum

ensure_cache_dir()  # before the cached kernels below are defined

# a relative slack on the objective's decrease absorbs float64 rounding of f near the optimum
SLACK = 1e-13
# how often a step on the segment is halved before the row is left where it is for this iteration (the secant's t
# decreases f but where f is flat to rounding); a fixed count lets the torch path run it without reading back
HALVINGS = 12
# steps of the solver on the graph term's diagonal alone before the first product: they bring the frequent tokens,
# whose columns of M make the term curve hardest, most of the way (4.8 → 3.6 products of each kind per row on
# SmolLM2's logits and the movie-review graph; more steps gain little)
START_STEPS = 2


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
    for i in range(z.size):
        y[i] = z[i] - 2.0 * lam * gram[i]
    return f + lam * sq, maximum(y)


@jit(fastmath=LOOP)
def _log_softmax_gap(valid, s, x, y, top):
    """y ← log softmax(y) over the valid entries, in place; returns KL(x ‖ softmax(y)) ≥ 0, the duality gap."""
    total = 0.0
    for i in range(y.size):
        if valid[i]:
            total += exp(y[i] - top)
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


@jit(fastmath=LOOP, inline="always")
def _softmax(z, s, x):
    """x ← softmax(z), s ← its log; z is −inf where a token is masked (exp(−inf) = 0, −inf − lse = −inf), and ``s``
    may be ``z`` itself."""
    top = maximum(z)
    total = 0.0
    for i in range(z.size):
        e = exp(z[i] - top)
        x[i] = e
        total += e
    lse = top + math.log(total)
    scale = 1.0 / total
    for i in range(z.size):
        s[i] = z[i] - lse
        x[i] *= scale


@jit(fastmath=LOOP)
def _propose(valid, s, x, ly, diag, lam, cand, xc):
    # the candidate log softmax(log x + η⊙r), r = log softmax(y) − log x, with its exp; η_j = 1 / (1 + λ D_j x_j)
    for i in range(s.size):
        if valid[i]:
            damp = 1.0 / (1.0 + lam * diag[i] * x[i]) if x[i] > 0 else 1.0
            cand[i] = s[i] + damp * (ly[i] - s[i])
        else:
            cand[i] = -np.inf
    _softmax(cand, cand, xc)


@jit(parallel=True)
def propose_rows(valid, s, x, ly, diag, lam, g, tol, cand, xc):
    """Each active row's candidate (``cand`` = its log, ``xc``); ``diag`` (V,) is the operator's
    ``gram_diagonal``. A row at gap ≤ ``tol`` proposes nothing: its rows of ``cand`` and ``xc`` are left as they
    are (:func:`judge_rows` reads them only for the active rows)."""
    for b in numba.prange(s.shape[0]):
        if g[b] > tol:
            _propose(valid[b], s[b], x[b], ly[b], diag, lam, cand[b], xc[b])


@jit(parallel=True)
def start_rows(z, valid, diag, lam, s, x, ly, cand, xc):
    """Each row's start (into ``s`` = log x, ``x``): x = softmax(z) moved ``START_STEPS`` of the solver's steps
    toward softmax(z − 2λ D⊙x), the fixed point of the graph term's diagonal alone (no product).
    ``ly``, ``cand``, ``xc`` are scratch (B, V)."""
    for b in numba.prange(z.shape[0]):
        # each step reads one pair of buffers and writes the other, starting where the last step lands in s, x
        now_s, now_x, next_s, next_x = s[b], x[b], cand[b], xc[b]
        if START_STEPS % 2:
            now_s, now_x, next_s, next_x = next_s, next_x, now_s, now_x
        _softmax(z[b], now_s, now_x)  # z is −inf where not valid
        for _ in range(START_STEPS):
            for i in range(z.shape[1]):
                ly[b, i] = z[b, i] - 2.0 * lam * diag[i] * now_x[i]
            _log_softmax_gap(valid[b], now_s, now_x, ly[b], maximum(ly[b]))
            _propose(valid[b], now_s, now_x, ly[b], diag, lam, next_s, next_x)
            now_s, now_x, next_s, next_x = next_s, next_x, now_s, now_x


@jit(fastmath=LOOP)
def _slopes(z, s, x, lx, cand, xc, lxc, lam):
    """φ′(0) and φ′(1) of φ(t) = f(x + t(xc − x)): Lx is linear in t, so no product is needed."""
    d0 = 0.0
    d1 = 0.0
    for i in range(z.size):
        d = xc[i] - x[i]
        if x[i] > 0 and xc[i] > 0:
            d0 += d * (s[i] - z[i])
            d1 += d * (cand[i] - z[i])
    for i in range(lx.size):
        dl = lxc[i] - lx[i]
        d0 += 2.0 * lam * lx[i] * dl
        d1 += 2.0 * lam * lxc[i] * dl
    return d0, d1


@jit(fastmath=LOOP)
def _objective_at(z, x, xc, lx, lxc, t, lam, st):
    """φ(t), with log(x + t(xc − x)) written to ``st``."""
    f = 0.0
    for i in range(z.size):
        xt = x[i] + t * (xc[i] - x[i])
        if xt > 0:
            lt = log(xt)
            st[i] = lt
            f += xt * (lt - z[i])
        else:
            st[i] = -np.inf
    sq = 0.0
    for i in range(lx.size):
        v = lx[i] + t * (lxc[i] - lx[i])
        sq += v * v
    return f + lam * sq


@jit(fastmath=LOOP)
def _move(z, lam, t, st, xc, lxc, gramc, s, x, lx, gram, y):
    """The row's state ← the point t of the segment (its logs in ``st``); y = z − 2λLᵀLx written to ``y`` with its
    largest entry returned. LᵀLx is linear in t too."""
    for i in range(z.size):
        s[i] = st[i]
        x[i] = x[i] + t * (xc[i] - x[i])
        lx[i] = lx[i] + t * (lxc[i] - lx[i])
        gram[i] = gram[i] + t * (gramc[i] - gram[i])
        y[i] = z[i] - 2.0 * lam * gram[i]
    return maximum(y)


@jit(parallel=True)
def judge_rows(z, valid, lam, tol, cand, xc, lxc, gramc, s, x, lx, gram, ly, f, g, step, iters, y):
    """Each active row moves to the point t of the segment from x to its candidate where φ′ crosses 0 (the secant of
    φ′(0) < 0 < φ′(1), or t = 1 where φ′(1) ≤ 0), halving t until f decreases; its state ``s, x, lx, gram, ly, f,
    g`` ← that point's, ``step`` ← t (0: no decrease found, the row stays). ``y`` is scratch (B, V)."""
    for b in numba.prange(z.shape[0]):
        if not g[b] > tol:
            continue
        iters[b] += 1
        d0, d1 = _slopes(z[b], s[b], x[b], lx[b], cand[b], xc[b], lxc[b], lam)
        t = d0 / (d0 - d1) if d0 < 0 < d1 else 1.0
        bound = f[b] + SLACK * max(abs(f[b]), 1.0)
        if t == 1.0:
            f_t, top = _objective(z[b], cand[b], xc[b], lxc[b], gramc[b], lam, y[b])
            if f_t <= bound:
                f[b] = f_t
                s[b] = cand[b]
                x[b] = xc[b]
                lx[b] = lxc[b]
                gram[b] = gramc[b]
                g[b] = _log_softmax_gap(valid[b], s[b], x[b], y[b], top)
                ly[b] = y[b]
                step[b] = 1.0
                continue
            t = 0.5
        f_t = _objective_at(z[b], x[b], xc[b], lx[b], lxc[b], t, lam, y[b])
        for _ in range(HALVINGS):
            if f_t <= bound:
                break
            t *= 0.5
            f_t = _objective_at(z[b], x[b], xc[b], lx[b], lxc[b], t, lam, y[b])
        if not f_t <= bound:  # NaN included, as the torch path
            step[b] = 0.0
            continue
        top = _move(z[b], lam, t, y[b], xc[b], lxc[b], gramc[b], s[b], x[b], lx[b], gram[b], ly[b])
        f[b] = f_t
        g[b] = _log_softmax_gap(valid[b], s[b], x[b], ly[b], top)
        step[b] = t
