"""The CPU kernel of ``solve_toward`` for the Lambert-W divergences (``rkl`` and ``l2``), one fused numba pass per
ν step.

Both divergences give xᵢ(ν) through ωᵢ = log W(e^sᵢ), the root of ω + e^ω = s,
with sᵢ affine in ν. The torch path in ``divergences.py`` finds each ω by
Newton, with a dozen 49k-long temporaries per step. Here ω and e^ω come from a
table: quintic Hermite interpolation between nodes 1/32 apart, whose values
and first two derivatives are exact (ω' = 1/(1+e^ω), ω'' = −e^ω/(1+e^ω)³).
That is accurate to ~1e-14 with no exp, log or iteration per token, so each ν
step is one parallel loop that sums x and its first two derivatives in ν.
Arguments beyond the table use the series (below) or Newton (above).

:func:`solve_row` does one row of ``solve_toward`` whole (log-softmax, the
reference restricted to the allowed tokens, a share of λ on KL(x‖q) merged into
the logits, the solve, and the certificate, computed from scratch as
``divergences.certificate_toward`` does), so a decoding step makes no torch
temporaries.
"""

from __future__ import annotations

import math

import numba
import numpy as np

RKL, L2 = 0, 1
# The ν search stops at |log Σx| ≤ NU_TOL / max(1, λ); x is then divided by Σx, which leaves
# the stationarity off by a factor Σx in λ∇D only: a duality gap of order NU_TOL², far below
# any tolerance, while a tighter stop costs one more pass over the vocabulary.
NU_TOL = 1e-7

# ω(s) tabulated on [S_LO, S_HI) at PER_UNIT nodes per unit of s. Below S_LO, e^s < 4e-11 and
# the series W(y) = y − y² + O(y³) is exact to rounding; above S_HI (a reference ~e^64 times
# likelier than the model's token), Newton.
S_LO, S_HI, PER_UNIT = -24.0, 64.0, 32
_COLUMNS = 6  # per node: ω, ω', ω'', e^ω, (e^ω)', (e^ω)''
_TINY = 1e-300  # divergences._TINY: the floor of x in ∇D


@numba.njit(cache=True)
def nu_tolerance(lam):
    return NU_TOL / max(1.0, lam)


@numba.njit(cache=True)
def _lambert_newton(s):
    # (ω, e^ω) to rounding by Newton from the asymptotic start (s ≥ 1); the error after a
    # step of size d is below d²/2 (f''/2f' < 1/2), so a step under 1e-8 leaves rounding only
    omega = math.log(s - math.log(s))
    for _ in range(60):
        e = math.exp(omega)
        d = (omega + e - s) / (1.0 + e)
        omega -= d
        if abs(d) <= 1e-8:
            break
    return omega, math.exp(omega)


def _build_table() -> np.ndarray:
    s = S_LO + np.arange(int((S_HI - S_LO) * PER_UNIT) + 1) / PER_UNIT
    omega = np.where(s >= 1.0, np.log(np.maximum(s, 1.0) - np.log(np.maximum(s, 1.0))), s - 1.0 / (1.0 + np.exp(-s)))
    for _ in range(8):  # Newton from a start within 0.3: rounding level well before 8 steps
        e = np.exp(omega)
        omega = omega - (omega + e - s) / (1.0 + e)
    e = np.exp(omega)
    d1 = 1.0 / (1.0 + e)
    d2 = -e * d1 ** 3
    return np.ascontiguousarray(np.stack([omega, d1, d2, e, e * d1, e * (d2 + d1 * d1)], axis=1).ravel())


TABLE = _build_table()


@numba.njit(cache=True, inline="always")
def lambert(s, table):
    """(ω, e^ω) with ω + e^ω = s, i.e. ω = log W(e^s); ``table`` is :data:`TABLE`."""
    u = (s - S_LO) * PER_UNIT
    if u < 0.0:
        y = math.exp(s)
        return s - y, y - y * y
    k = int(u)
    if k >= table.size // _COLUMNS - 1:
        return _lambert_newton(s)
    # quintic Hermite on [node k, node k+1], f the fraction of the way, h the node spacing
    f = u - k
    g = 1.0 - f
    h = 1.0 / PER_UNIT
    f3, g3 = f * f * f, g * g * g
    v0 = g3 * (1.0 + 3.0 * f + 6.0 * f * f)
    v1 = f * g3 * (1.0 + 3.0 * f) * h
    v2 = 0.5 * f * f * g3 * h * h
    w0 = f3 * (1.0 + 3.0 * g + 6.0 * g * g)
    w1 = -g * f3 * (1.0 + 3.0 * g) * h
    w2 = 0.5 * g * g * f3 * h * h
    j = _COLUMNS * k
    n = j + _COLUMNS
    omega = (v0 * table[j] + v1 * table[j + 1] + v2 * table[j + 2]
             + w0 * table[n] + w1 * table[n + 1] + w2 * table[n + 2])
    e = (v0 * table[j + 3] + v1 * table[j + 4] + v2 * table[j + 5]
         + w0 * table[n + 3] + w1 * table[n + 4] + w2 * table[n + 5])
    return omega, e


@numba.njit(parallel=True, cache=True)
def _pass(kind, t, a, base, inv_c, nu, table):
    """Σx(ν), Σdx/dν and Σd²x/dν²; the Lambert argument is s = base + ν (rkl) or base − ν (l2), see :func:`_bases`."""
    total = 0.0
    slope = 0.0
    curve = 0.0
    sign = 1.0 if kind == RKL else -1.0
    for i in numba.prange(t.size):
        ti = t[i]
        if ti == -np.inf:
            continue
        ai = a[i]
        if kind == RKL and ai <= 0.0:  # no reference mass: softmax's own form
            x = math.exp(ti - nu)
            total += x
            slope -= x
            curve += x
            continue
        _, e = lambert(base[i] + sign * nu, table)
        x = ai / e if kind == RKL else e * inv_c
        # both kinds: dx/dν = −x/(1+e^ω), d²x/dν² = x(1+2e^ω)/(1+e^ω)³
        r = 1.0 / (1.0 + e)
        total += x
        slope -= x * r
        curve += x * (1.0 + 2.0 * e) * r * r * r
    return total, slope, curve


@numba.njit(parallel=True, cache=True)
def _bases(kind, t, a, log_c):
    # rkl: s = log aᵢ − tᵢ + ν; l2: s = tᵢ + aᵢ + log c − ν
    out = np.empty(t.size)
    for i in numba.prange(t.size):
        if t[i] == -np.inf or (kind == RKL and a[i] <= 0.0):
            out[i] = 0.0
        elif kind == RKL:
            out[i] = math.log(a[i]) - t[i]
        else:
            out[i] = t[i] + a[i] + log_c
    return out


@numba.njit(parallel=True, cache=True)
def _log_x(kind, t, a, base, log_c, nu, log_total, table, out):
    sign = 1.0 if kind == RKL else -1.0
    for i in numba.prange(t.size):
        ti = t[i]
        if ti == -np.inf:
            out[i] = -np.inf
        elif kind == RKL and a[i] <= 0.0:
            out[i] = ti - nu - log_total
        else:
            omega, _ = lambert(base[i] + sign * nu, table)
            # rkl: log x = log a − ω, and base = log a − t; l2: x = e^ω/c
            out[i] = (base[i] + ti - omega if kind == RKL else omega - log_c) - log_total


@numba.njit(cache=True)
def nu_step(kind, total, slope, curve):
    """The ν step toward Σx = 1: Newton on h = (Σx^(−γ) − 1)/γ (log Σx at γ = 0), γ making h locally linear.

    h'' = 0 at γ = S·S''/S'² − 1 (S = Σx). A token softmax dominates has x ∝ e^(−ν)
    (γ = 0); one the reference dominates has x ≈ λq/(ν + c) under rkl (γ = 1) and
    x ≈ (c − ν)/2λ under l2 (γ = −1), so γ is kept in [0, 1] or [−1, 0].
    Against plain Newton on log Σx: 2.0 steps instead of 3.05 at λ = 1 (rkl, real
    rows), 2.95 instead of 8 at λ = 1000.
    """
    g = total * curve / (slope * slope) - 1.0
    g = min(1.0, max(0.0, g)) if kind == RKL else min(0.0, max(-1.0, g))
    log_total = math.log(total)
    if abs(g) < 1e-12:
        return -total * log_total / slope
    return -total * math.expm1(g * log_total) / (g * slope)


@numba.njit(cache=True)
def _solve(kind, t, a, lam, max_iter, table, out):
    """Fill ``out`` with log x for one row (log-softmaxed logits ``t``, scaled reference ``a``); return iterations.

    The steps of :func:`nu_step`, kept inside a bracket by bisection (also taken
    when a step does not halve |log Σx|), stopped when |log Σx| ≤
    ``nu_tolerance(λ)``, as the torch path.
    """
    log_c = math.log(2.0 * lam)
    base = _bases(kind, t, a, log_c)
    if kind == RKL:
        nu = 0.0  # every x_i ≥ softmax_i here, so Σx ≥ 1
    else:
        nu = _logsumexp(t + a)  # every x_i ≤ its softmax here, so Σx ≤ 1
    lo, hi = -np.inf, np.inf
    reach = 1.0  # a one-sided fallback step, doubled each time: the root may lie hundreds away
    last = np.inf  # |log Σx| at the previous ν
    iters = 0
    for _ in range(max_iter):
        at = nu  # where Σx was last evaluated: the answer if the budget runs out
        total, slope, curve = _pass(kind, t, a, base, 0.5 / lam, nu, table)
        if total >= 1.0:
            lo = max(lo, nu)
        else:
            hi = min(hi, nu)
        miss = abs(math.log(total))
        if miss <= nu_tolerance(lam):
            break
        iters += 1
        step = nu + nu_step(kind, total, slope, curve)
        both = np.isfinite(lo) and np.isfinite(hi)
        # the steps can bounce between the two sides without closing in (large λ): bisect
        # when a step did not halve |log Σx|
        slow = both and miss > 0.5 * last
        last = miss
        if slow or not (lo < step < hi):
            if both:
                step = 0.5 * (lo + hi)
            elif np.isfinite(lo):
                step = lo + reach
                reach *= 2.0
            else:
                step = hi - reach
                reach *= 2.0
        nu = step
    _log_x(kind, t, a, base, log_c, at, math.log(total), table, out)
    return iters


@numba.njit(parallel=True, cache=True)
def _logsumexp(v):
    m = np.max(v)
    acc = 0.0
    for i in numba.prange(v.size):
        acc += math.exp(v[i] - m)
    return m + math.log(acc)


@numba.njit(parallel=True, cache=True)
def _log_softmax(z, out):
    shift = _logsumexp(z)
    for i in numba.prange(z.size):
        out[i] = z[i] - shift


@numba.njit(parallel=True, cache=True)
def _restricted(t, q, scale, out):
    # q on the allowed tokens (finite t), renormalised and times ``scale``; returns q's mass there
    mass = 0.0
    for i in numba.prange(t.size):
        if t[i] > -np.inf:
            mass += q[i]
    for i in numba.prange(t.size):
        out[i] = q[i] * (scale / mass) if t[i] > -np.inf and mass > 0.0 else 0.0
    return mass


@numba.njit(parallel=True, cache=True)
def certificate(kind, t, a, lam, logx):
    """The duality gap KL(x ‖ softmax(y)), y = t − λ∇D(x), of the point exp(``logx``), computed from scratch.

    ``a`` is the scaled reference (λq̂ for rkl, 2λq̂ for l2), so y = t + a/x (rkl) or
    t − 2λx + a (l2): ``divergences.certificate_toward`` in one pass and a logsumexp.
    """
    y = np.empty_like(t)
    inner = 0.0  # Σ x (log x − y)
    for i in numba.prange(t.size):
        if logx[i] == -np.inf:
            y[i] = -np.inf
            continue
        x = math.exp(logx[i])  # may underflow to 0: then it adds nothing, and ∇D takes x at _TINY, as in torch
        y[i] = t[i] + a[i] / max(x, _TINY) if kind == RKL else t[i] - 2.0 * lam * x + a[i]
        if x > 0.0:
            inner += x * (logx[i] - y[i])
    return max(inner + _logsumexp(y), 0.0)


@numba.njit(parallel=True, cache=True)
def _lean_toward(t, q, mass, weight):
    # t ← log-softmax of (t + weight·log q̂)/(1 + weight), q̂ = q/mass: KL(x‖q)'s share, merged into the logits
    for i in numba.prange(t.size):
        t[i] = (t[i] + weight * math.log(q[i] / mass)) / (1.0 + weight) if t[i] > -np.inf and q[i] > 0.0 else -np.inf
    _log_softmax(t, t)  # the shift is summed before any entry changes


@numba.njit(cache=True)
def solve_row(kind, z, q, lam, kl_share, max_iter, table, out):
    """One row of ``solve_toward``: fill ``out`` with log x for logits ``z`` and reference ``q``; return
    (iterations, gap).

    q is restricted to the finite logits and renormalised; a row with no mass
    there is left as softmax, with gap 0, as in the torch path. With
    ``kl_share`` = m > 0, D is solved at λ′ = λ(1−m)/(1+λm) from the logits
    leaned toward q, and the gap is scaled by 1 + λm (``divergences``).
    """
    t = np.empty_like(z)
    _log_softmax(z, t)
    a = np.empty_like(z)
    mass = _restricted(t, q, 1.0, a)
    if not mass > 0.0:
        out[:] = t
        return 0, 0.0
    scale = 1.0 + lam * kl_share
    if kl_share > 0.0:
        _lean_toward(t, q, mass, lam * kl_share)
        lam = lam * (1.0 - kl_share) / scale
    a *= lam if kind == RKL else 2.0 * lam
    iters = _solve(kind, t, a, lam, max_iter, table, out)
    return iters, scale * certificate(kind, t, a, lam, out)
