"""The CPU kernel of ``solve_toward`` for the Lambert-W divergences (``rkl`` and ``l2``), one fused numba pass per Newton step.

The torch path in ``divergences.py`` evaluates x(ν) with a dozen 49k-long
temporaries per Newton step; here each step is one parallel loop over the
tokens that updates every token's Lambert ω in place and sums x and dx/dν.
ω is warm-started across steps by its first-order change, ω += δ/(1 + e^ω)
for a shift δ of its argument; each ω is then refined to rounding level, mostly in one or two Newton steps.
The result is certified by the same torch certificate as the torch path.
"""

from __future__ import annotations

import math

import numba
import numpy as np

RKL, L2 = 0, 1
# Newton on ν stops at |log Σx| ≤ NU_TOL / max(1, λ); x is then divided by Σx, which leaves
# the stationarity off by a factor Σx in λ∇D only: a duality gap of order NU_TOL², far below
# any tolerance, while a tighter stop costs one more pass over the vocabulary.
NU_TOL = 1e-7


@numba.njit(cache=True)
def nu_tolerance(lam):
    return NU_TOL / max(1.0, lam)


@numba.njit(cache=True)
def _lambert_start(s):
    # log W(e^s): asymptotic start for large s, series start for small s
    if s >= 1.0:
        return math.log(s - math.log(s))
    return s - 1.0 / (1.0 + math.exp(-s))


@numba.njit(cache=True)
def _lambert_refine(omega, s):
    # Newton on ω + e^ω = s; returns ω and e^ω. The error after a step of size d
    # is below d²/2 (f''/2f' < 1/2), so a step under 1e-8 leaves ω at rounding level.
    for _ in range(60):
        e = math.exp(omega)
        d = (omega + e - s) / (1.0 + e)
        omega -= d
        if abs(d) <= 1e-8:
            return omega, e * (1.0 - d + 0.5 * d * d)  # e^(ω−d) to rounding, without an exp
    return omega, math.exp(omega)


@numba.njit(parallel=True, cache=True)
def _pass(kind, t, a, base, inv_c, nu, shift, omega, e_omega, fresh):
    """Σx(ν) and Σdx/dν, moving each ω[i] (and e^ω[i]) to the new ν; ``shift`` is ν's change since the last pass.

    The Lambert argument is s = base + ν (rkl) or base − ν (l2); see :func:`_bases`.
    """
    total = 0.0
    slope = 0.0
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
            continue
        s = base[i] + sign * nu
        if fresh:
            w, e = _lambert_refine(_lambert_start(s), s)
        else:  # first-order predictor: a Newton step or two from there
            w, e = _lambert_refine(omega[i] + sign * shift / (1.0 + e_omega[i]), s)
        omega[i] = w
        e_omega[i] = e
        if kind == RKL:
            x = ai / e
            slope -= x * x / (x + ai)
        else:
            x = e * inv_c
            slope -= x / (1.0 + e)
        total += x
    return total, slope


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
def _log_x(kind, t, a, base, log_c, nu, omega, log_total, out):
    for i in numba.prange(t.size):
        ti = t[i]
        if ti == -np.inf:
            out[i] = -np.inf
        elif kind == RKL and a[i] <= 0.0:
            out[i] = ti - nu - log_total
        elif kind == RKL:  # log x = log a − ω, and base = log a − t
            out[i] = base[i] + ti - omega[i] - log_total
        else:
            out[i] = omega[i] - log_c - log_total


@numba.njit(cache=True)
def solve_row(kind, t, a, lam, max_iter, out):
    """Fill ``out`` with log x for one row (log-softmaxed logits ``t``, scaled reference ``a``); return iterations.

    Newton on log Σx(ν) (exact for softmax), kept inside a bracket by bisection
    (also taken when a Newton step does not halve |log Σx|),
    stopped when |log Σx| ≤ ``nu_tolerance(λ)``, as the torch path.
    """
    log_c = math.log(2.0 * lam)
    omega = np.empty_like(t)
    e_omega = np.empty_like(t)
    base = _bases(kind, t, a, log_c)
    if kind == RKL:
        nu = 0.0  # every x_i ≥ softmax_i here, so Σx ≥ 1
    else:
        m = -np.inf
        for i in range(t.size):
            if t[i] + a[i] > m:
                m = t[i] + a[i]
        acc = 0.0
        for i in range(t.size):
            acc += math.exp(t[i] + a[i] - m)
        nu = m + math.log(acc)  # every x_i ≤ its softmax here, so Σx ≤ 1
    lo, hi = -np.inf, np.inf
    reach = 1.0  # a one-sided fallback step, doubled each time: the root may lie hundreds away
    last = np.inf  # |log Σx| at the previous ν
    prev = nu  # the ν at which ω and Σx were last evaluated
    iters = 0
    for it in range(max_iter):
        # after a long ν step the first-order predictor is far off, and Newton from there
        # moves ω by only ~1 a step: start each ω afresh instead
        fresh = it == 0 or abs(nu - prev) > 1.0
        total, slope = _pass(kind, t, a, base, 0.5 / lam, nu, nu - prev, omega, e_omega, fresh)
        prev = nu
        if total >= 1.0:
            lo = max(lo, nu)
        else:
            hi = min(hi, nu)
        log_total = math.log(total)
        miss = abs(log_total)
        if miss <= nu_tolerance(lam):
            break
        iters += 1
        step = nu - total * log_total / slope
        both = np.isfinite(lo) and np.isfinite(hi)
        # Newton can bounce between the two sides without closing in (large λ): bisect when a
        # step did not halve |log Σx|
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
    _log_x(kind, t, a, base, log_c, prev, omega, math.log(total), out)
    return iters
