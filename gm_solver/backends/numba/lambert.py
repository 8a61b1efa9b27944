"""The CPU kernel of ``solve_toward`` (``rkl``, ``l2`` and ``kl``): a whole batch in one numba call.

Both Lambert-W divergences give xᵢ(ν) through ωᵢ = log W(e^sᵢ), the root of
ω + e^ω = s, with sᵢ affine in ν. The torch path in ``divergences.py`` finds
each ω by Newton, with a dozen V-long temporaries per step. Here ω and e^ω come
from a table: quintic Hermite interpolation between nodes 1/32 apart, whose
values and first two derivatives are exact (ω' = 1/(1+e^ω), ω'' = −e^ω/(1+e^ω)³),
stored as each interval's polynomial coefficients. That is accurate to ~1e-14
with no exp, log or iteration per token, so each ν step is one loop that sums x
and its first two derivatives in ν. Arguments beyond the table use the series
(below) or Newton (above).

:func:`solve_batch` does ``solve_toward`` whole for every row (log-softmax, the
reference restricted to the allowed tokens, a share of λ on KL(x‖q) merged into
the logits, the solve, and the certificate, computed from scratch as
``eager.certificate_toward`` does). A row is cut into chunks of
:data:`CHUNK` tokens whose sums are kept apart and added in one order. A batch
at least as large as the thread count is solved a row per thread (one parallel
region); a smaller one pass by pass over all its rows' chunks at once, ν steps
in lockstep. Either way a row comes out bit for bit the same, alone or in any
batch. Per token and row: one exp before the ν steps (the log-softmax; log q
comes with q from the caller or costs a log); then, for a wide rkl row, one
scatter into a histogram of the Lambert arguments, over which every ν step runs
(:func:`_bin_row`; other rows take a half table lookup per ν step); then the
finish: the other half of a lookup for log x and an exp for Σx, then a pass that
divides x by Σx and sums the certificate (its logsumexp shifted by ν, where
y ≈ log x + ν: no pass for the maximum). The exps are ``vector_math.exp``, a
polynomial the loops vectorize (CPU per row: ``benchmarks/solver.py``, section 7).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import numba
import numpy as np

from gm_graphs.store.kernel_cache import ensure_cache_dir

from .vector_math import LOOP, exp, jit

ensure_cache_dir()  # before the cached kernels below are defined

RKL, L2 = 0, 1


@contextmanager
def one_task_at_a_time():
    """Parallel loops launched from this thread hand out one iteration at a time to whichever thread is free
    (numba's default splits them into equal blocks up front): rows differ in ν steps."""
    default = numba.set_parallel_chunksize(1)
    try:
        yield
    finally:
        numba.set_parallel_chunksize(default)


# The ν search stops at |log Σx| ≤ NU_TOL / max(1, λ); x is then divided by Σx, which leaves
# the stationarity off by a factor Σx in λ∇D only: a duality gap of order NU_TOL², far below
# any tolerance, while a tighter stop costs one more pass over the vocabulary.
NU_TOL = 1e-7

# ω(s) tabulated on [S_LO, S_HI) at PER_UNIT nodes per unit of s. Below S_LO, e^s < 4e-11 and
# the series W(y) = y − y² + O(y³) is exact to rounding; above S_HI (a reference ~e^64 times
# likelier than the model's token), Newton.
S_LO, S_HI, PER_UNIT = -24.0, 64.0, 32
_COLUMNS = 12  # per interval: the quintic's 6 coefficients for ω, then 6 for e^ω
_TINY = 1e-300  # divergences._TINY: the floor of x in ∇D

# A token whose log-softmaxed logit t lies more than FAR below 0 is far (huge scores: |z| of 1e6 and beyond). There
# rkl's x ≈ λq/|t| and both t and λq/x are of size |t|, so the dual logit t + λq/x of the certificate cancels to
# ν + log x with an error of ε·|t|·|log x| (1e4 at |t| = 1e20), which its logsumexp turns into any gap, and
# base + v gives back log q with an error ε·|t|. Far tokens take log q and the dual logit log x + c directly
# (``far_term``); below FAR the plain forms lose at most 1e-8.
FAR = 1e6


@jit()
def nu_tolerance(lam):
    return NU_TOL / max(1.0, lam)


@jit()
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
    """Per interval [node k, node k+1], the monomial coefficients in f (the fraction of the way) of the quintic
    Hermite interpolants of ω and e^ω, whose values and first two derivatives at both nodes are exact."""
    s = (S_LO + np.arange(int((S_HI - S_LO) * PER_UNIT) + 1) / PER_UNIT).astype(np.longdouble)
    omega = np.where(s >= 1.0, np.log(np.maximum(s, 1.0) - np.log(np.maximum(s, 1.0))), s - 1.0 / (1.0 + np.exp(-s)))
    for _ in range(8):  # Newton from a start within 0.3: rounding level well before 8 steps
        e = np.exp(omega)
        omega = omega - (omega + e - s) / (1.0 + e)
    e = np.exp(omega)
    d1 = 1.0 / (1.0 + e)  # ω' and ω''; (e^ω)' = e^ω·ω', (e^ω)'' = e^ω·(ω'' + ω'²)
    d2 = -e * d1 ** 3
    h = np.longdouble(1.0) / PER_UNIT
    columns = []
    for y, dy, ddy in ((omega, d1, d2), (e, e * d1, e * (d2 + d1 * d1))):
        # p(f) = Σ c_j f^j with p, p', p'' matching (y, h·y', h²·y'') at f = 0 and f = 1 (in long double, so that
        # the differences below lose nothing a float64 coefficient keeps)
        c0, c1, c2 = y[:-1], h * dy[:-1], h * h * ddy[:-1] / 2
        a = y[1:] - c0 - c1 - c2
        b = h * dy[1:] - c1 - 2 * c2
        c = h * h * ddy[1:] - 2 * c2
        columns += [c0, c1, c2, 10 * a - 4 * b + c / 2, -15 * a + 7 * b - c, 6 * a - 3 * b + c / 2]
    return np.ascontiguousarray(np.stack(columns, axis=1).astype(np.float64).ravel())


TABLE = _build_table()


@jit(inline="always")
def _interval(s, table):
    # (k, f): s lies a fraction f of the way through the table's interval k; k = −1 below the table (or NaN),
    # −2 above it
    u = (s - S_LO) * PER_UNIT
    if not u >= 0.0:
        return -1, 0.0
    if u >= table.size // _COLUMNS:
        return -2, 0.0
    k = int(u)
    return k, u - k


@jit(inline="always")
def _horner(table, j, f):
    return table[j] + f * (table[j + 1] + f * (table[j + 2] + f * (table[j + 3] + f * (table[j + 4]
                                                                                     + f * table[j + 5]))))


@jit(inline="always")
def lambert_omega(s, table):
    """ω = log W(e^s), the root of ω + e^ω = s; ``table`` is :data:`TABLE`. NaN gives NaN."""
    k, f = _interval(s, table)
    if k == -1:
        y = math.exp(s)
        return s - y
    if k == -2:
        return _lambert_newton(s)[0]
    return _horner(table, _COLUMNS * k, f)


@jit(inline="always")
def lambert_e(s, table):
    """e^ω = W(e^s) alone (what the ν steps need: half the table's work of :func:`lambert_omega` and it together)."""
    k, f = _interval(s, table)
    if k == -1:
        y = math.exp(s)
        return y - y * y
    if k == -2:
        return _lambert_newton(s)[1]
    return _horner(table, _COLUMNS * k + 6, f)


@jit(inline="always")
def _is_far(kind, ti, ai, x):
    # a token whose dual logit is log x + c (see FAR): rkl, reference mass, x > 0, t < −FAR
    return kind == RKL and ai > 0.0 and x > 0.0 and ti < -FAR


@jit(inline="always")
def _dual_logit(kind, ti, ai, lam, x, lx, c, far):
    # y = t − λ∇D(x) up to a per-row constant, for the certificate: t + a/x (rkl, a = λq̂), t − 2λx + a (l2,
    # a = 2λq̂); t itself at λ = 0; log x + c for a far token (``far_term``) where the row may have one (``far``).
    # An x that underflows to 0 is read at 1e-300 by ∇D, as ``eager.certificate_toward`` does (and adds
    # nothing to Σ x(log x − y)).
    if far and _is_far(kind, ti, ai, x):
        return lx + c
    return ti + ai / max(x, _TINY) if kind == RKL else ti - 2.0 * lam * x + ai


@jit(inline="always")
def far_term(ti, ai, x, lx, c):
    """What a far token adds to the certificate when its dual logit is y = log x + c instead of t + a/x: the
    Fenchel–Young residual a·φ(w) of h(x) = −a·log x at the dual point u = y − t, φ(w) = w − 1 − log w,
    w = x·u/a (0 when u = a/x, as for the plain dual logit; +inf when u ≤ 0). Any u gives a lower bound of the
    dual, so the gap stays a certificate; this one loses no digits to rounding at |t| ≫ 1 (see FAR)."""
    w = x * (lx + c - ti) / ai
    if not w > 0.0:
        return np.inf
    d = w - 1.0
    return ai * (d - math.log1p(d))


@jit()
def certificate(kind, t, a, lam, logx):
    """The duality gap KL(x ‖ softmax(y)), y = t − λ∇D(x), of the point exp(``logx``), computed from scratch.

    ``t`` are log-softmaxed logits and ``a`` the scaled reference (λq̂ for rkl,
    2λq̂ for l2): ``eager.certificate_toward`` for one row. :func:`solve_batch`
    sums the same terms in its last pass.
    """
    y = np.full(t.size, -np.inf)
    # the other tokens first: far tokens' y = log x + c, with c = logsumexp(their y) − log(their Σx), the shift
    # that makes softmax(y) agree with x on them (at the optimum, y = log x + logsumexp(y) for every token)
    top = -np.inf
    held = 0.0
    for i in range(t.size):
        if logx[i] > -np.inf:
            x = math.exp(logx[i])
            if not _is_far(kind, t[i], a[i], x):
                y[i] = _dual_logit(kind, t[i], a[i], lam, x, logx[i], 0.0, False)
                top = max(top, y[i])
                held += x
    c = 0.0
    if held > 0.0:
        total = 0.0
        for i in range(t.size):
            total += math.exp(y[i] - top)
        c = top + math.log(total) - math.log(held)
    inner = 0.0
    for i in range(t.size):
        if logx[i] > -np.inf:
            x = math.exp(logx[i])
            if _is_far(kind, t[i], a[i], x):
                y[i] = logx[i] + c
                inner += far_term(t[i], a[i], x, logx[i], c)
                top = max(top, y[i])
            if x > 0.0:
                inner += x * (logx[i] - y[i])
    total = 0.0
    for i in range(t.size):
        total += math.exp(y[i] - top)
    return max(inner + top + math.log(total), 0.0)


@jit()
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


CHUNK = 4096  # tokens per task: V = 49,152 gives 12 per row, enough to spread one row over the cores
# what solve_batch returns when a row of z cannot be solved (it then stops before any ν step)
FINE, HAS_NAN, HAS_POSINF, ALL_MASKED = 0, 1, 2, 3
# how solve_batch spreads a batch over the threads (see schedule)
SERIAL, ROWS, LOCKSTEP = 0, 1, 2
# a row's state between passes: one float64 row of ``state`` per logits row
LSE, MASS, KAP, LOG_KAP, LOG_C, LAM, SCALE, SOFT, NU, AT, LOW, HIGH, REACH, LAST, LOG_TOTAL, TOP, BINNED, \
    BIN_FIRST, BIN_LAST, FREE = range(20)
STATE = FREE + 1  # the width of ``state``
# An rkl row at least BIN_MIN_WIDTH wide takes its ν steps over a histogram of its tokens (:func:`_bin_row`): BINS
# bins 1/BIN_PER_UNIT wide of s at ν = 0 from BIN_S_LO on, each with the reference mass of its tokens and their first
# three moments about the bin's centre. Every token's s moves with ν alike, so a bin's Σ q·f(s) at any ν is its
# moments times f and its derivatives at the centre (Taylor to the fourth order: about 1e-9 of Σx on SmolLM2's
# rows, whose s at ν = 0 lie in [−17, 22]); a pass then costs a thousand table lookups instead of one per token. A
# row with a token outside the bins keeps the exact passes.
BIN_PER_UNIT, BINS, BIN_S_LO, BIN_MIN_WIDTH = 32, 4096, -64.0, 8192
# a row whose largest z + w·log q (w = λm, the weight of KL(x‖q)'s share; z alone without one) lies within ±NEAR
# is solved as it comes, where rounding at |z| ≤ 64 costs ε·64 ≈ 1e-14, as the table does; any other is shifted
# (:func:`_row_peak`), at the cost of a second first pass
NEAR = 64.0


@jit()
def _span(c, width):
    return c * CHUNK, min(width, (c + 1) * CHUNK)


@jit()
def _finite_max(z):
    # the largest finite z (a row that reaches it has one)
    top = -np.inf
    for i in range(z.size):
        if z[i] < np.inf:
            top = max(top, z[i])
    return top


@jit(fastmath=LOOP)
def _prepare(kind, z, peak, q, logq, w, need_base, v, base, lo, hi, sums):
    # tokens lo:hi of one row, its scores shifted by ``peak`` (see :func:`_row_peak`): x and the objective are the
    # same (⟨x, z − peak⟩ = ⟨x, z⟩ − peak on the simplex).
    # v = z, or with KL(x‖q)'s share w = λm > 0 the logits leaned toward q,
    # (z + w·log q)/(1 + w) (−inf where q = 0: KL(x‖q) keeps x there at 0); base = log q − v (rkl's
    # s = log a − t + ν, less a per-row constant); log q read from ``logq`` where q > 0.
    # sums ← (q's mass on the finite logits, max v, Σ e^(v − max), #NaN, #+inf, #finite z).
    mass = 0.0
    top = -np.inf
    nan = 0
    posinf = 0
    finite = 0
    lean = 1.0 / (1.0 + w)
    for i in range(lo, hi):
        zi = z[i]
        if zi == -np.inf:
            v[i] = -np.inf
            continue
        if not zi < np.inf:
            nan += zi != zi
            posinf += zi == np.inf
            v[i] = -np.inf
            continue
        finite += 1
        qi = q[i]
        mass += qi
        vi = zi - peak
        if w > 0.0 or need_base:
            if qi > 0.0:
                lq = logq[i]
                if w > 0.0:
                    vi = (vi + w * lq) * lean
                base[i] = lq - vi
            elif w > 0.0:
                vi = -np.inf
        v[i] = vi
        top = max(top, vi)
    total = 0.0
    if top > -np.inf:
        for i in range(lo, hi):
            total += exp(v[i] - top)
    sums[0], sums[1], sums[2], sums[3], sums[4], sums[5] = mass, top, total, nan, posinf, finite


@jit()
def _row_peak(z, v, sums, w):
    """What :func:`_prepare` is to subtract from a row it went through unshifted (``v``, its chunks' ``sums``,
    chunks × 6, KL(x‖q)'s share ``w``): 0 when (1 + w)·max v, the largest z + w·log q, lies within :data:`NEAR`
    of 0 (or the row has no v > −inf), else the score of the token with the largest v (the largest z when w = 0).
    Shifted, that token's leaned logit is w·log q/(1 + w), the largest, and every quantity stays of the size of
    the scores' spread instead of their magnitude: unshifted, log x = base + v + … and t = v − lse lose ε·|z|
    (at 1e20, λ, q and ν round away)."""
    top = sums[:, 1].max()
    if not (abs(top) * (1.0 + w) > NEAR and top > -np.inf):
        return 0.0
    if w == 0.0:
        return top
    for i in range(v.size):  # a row with scores this large: the rare path
        if v[i] == top:
            return z[i] if abs(z[i]) > NEAR else 0.0
    return 0.0


@jit()
def _prepare_chunks(kind, z, peak, q, logq, lam, share, v, base, sums):
    for c in range((z.size + CHUNK - 1) // CHUNK):
        lo, hi = _span(c, z.size)
        _prepare(kind, z, peak, q, logq, lam * share, kind == RKL and lam * (1.0 - share) > 0.0, v, base,
                 lo, hi, sums[c])


@jit()
def _prepare_row(kind, z, q, logq, lam, share, v, base, sums, st):
    # a row's chunks through _prepare, and again shifted by st[TOP] when _row_peak says so (scores beyond ±NEAR)
    _prepare_chunks(kind, z, 0.0, q, logq, lam, share, v, base, sums)
    st[TOP] = _row_peak(z, v, sums[:(z.size + CHUNK - 1) // CHUNK], lam * share)
    if st[TOP] != 0.0:
        _prepare_chunks(kind, z, st[TOP], q, logq, lam, share, v, base, sums)


@jit(fastmath=LOOP)
def _start_l2(v, q, kap, lo, hi):
    # (max, Σ e^(u − max)) of u = v + kap·q over lo:hi: l2 starts at ν = logsumexp(t + a), where every x ≤ softmax
    top = -np.inf
    for i in range(lo, hi):
        if v[i] > -np.inf:
            top = max(top, v[i] + kap * q[i])
    total = 0.0
    if top > -np.inf:
        for i in range(lo, hi):
            total += exp(v[i] + kap * q[i] - top)
    return top, total


@jit(fastmath=LOOP)
def _sums(kind, v, q, base, shift, soft_shift, kap, inv_c, table, lo, hi):
    # Σx(ν), Σdx/dν and Σd²x/dν² over lo:hi; they need e^ω only. The Lambert argument is s = base + shift (rkl,
    # shift = log κ + lse + ν) or v + κq + shift (l2, shift = log c − lse − ν); rkl's tokens without reference
    # mass keep softmax's own form x = e^(v − soft_shift), soft_shift = lse + ν.
    total = 0.0
    slope = 0.0
    curve = 0.0
    for i in range(lo, hi):
        vi = v[i]
        if vi == -np.inf:
            continue
        qi = q[i]
        if kind == RKL and qi <= 0.0:
            x = math.exp(vi - soft_shift)
            total += x
            slope -= x
            curve += x
            continue
        e = lambert_e(base[i] + shift if kind == RKL else vi + kap * qi + shift, table)
        # x = κq/e^ω (rkl) or e^ω/c (l2); dx/dν = −x·r and d²x/dν² = x(1+2e^ω)·r³, r = 1/(1+e^ω): one division
        if kind == RKL:
            inv = 1.0 / (e * (1.0 + e))
            x = kap * qi * (1.0 + e) * inv
            r = e * inv
        else:
            r = 1.0 / (1.0 + e)
            x = e * inv_c
        total += x
        slope -= x * r
        curve += x * (1.0 + 2.0 * e) * r * r * r
    return total, slope, curve


@jit(inline="always")
def _log_x_tokens(kind, v, q, base, shift, lse, kap, lam, log_kap, log_c, nu, table, lo, hi, out, kept, far):
    # log x over lo:hi at ν (its Lambert argument s as in _sums) before the row's normalisation (the finish's first
    # pass), moving v to ``kept``: ``out`` holds v on entry (it is the solve's buffer). With ``far`` (a literal at
    # both callers, so that each compiles to its own loop) far tokens (FAR) take log a from q: base + v gives it back
    # with an error ε·|t|.
    for i in range(lo, hi):
        vi = v[i]
        kept[i] = vi
        if vi == -np.inf:
            out[i] = -np.inf
        elif lam == 0.0:  # KL(x‖q) alone: the leaned softmax is the solution
            out[i] = vi - lse
        elif kind == RKL:
            if q[i] > 0.0:  # log x = log a − ω, and log a = log κ + base + v
                omega = lambert_omega(base[i] + shift, table)
                if far and vi - lse < -FAR:
                    out[i] = math.log(kap * q[i]) - omega
                else:
                    out[i] = base[i] + vi + log_kap - omega
            else:
                out[i] = vi - lse - nu
        else:  # l2: x = e^ω / c
            out[i] = lambert_omega(vi + kap * q[i] + shift, table) - log_c


@jit(fastmath=LOOP)
def _log_x(kind, v, q, base, shift, lse, kap, lam, log_kap, log_c, nu, table, lo, hi, out, kept):
    _log_x_tokens(kind, v, q, base, shift, lse, kap, lam, log_kap, log_c, nu, table, lo, hi, out, kept, False)


@jit(fastmath=LOOP)
def _log_x_far(kind, v, q, base, shift, lse, kap, lam, log_kap, log_c, nu, table, lo, hi, out, kept):
    _log_x_tokens(kind, v, q, base, shift, lse, kap, lam, log_kap, log_c, nu, table, lo, hi, out, kept, True)


@jit(fastmath=LOOP)
def _mass(out, kept, lse, lo, hi):
    # Σx over lo:hi before the normalisation, and how many tokens have t < −FAR and x > 0 (rkl: far ones; x of any
    # other rounds to 0 there; masked ones have t = −inf and x = 0): a loop that vectorizes
    total = 0.0
    count = 0
    for i in range(lo, hi):
        x = exp(out[i])
        total += x
        count += (kept[i] - lse < -FAR) & (x > 0.0)
    return total, count


@jit(inline="always")
def _certificate_tokens(kind, kept, q, lse, kap, lam, nu, log_total, lo, hi, out, careful):
    # the certificate's sums Σ x(log x − y) and Σ e^(y − ν) over lo:hi, x = e^(log x − ``log_total``) (the finish's
    # second pass; the caller writes the normalised log x back after it). At the optimum y = log x + ν (the
    # stationarity condition), so ν is a safe shift for the logsumexp, and e^(y − ν) = x·e^δ with δ = y − ν − log x
    # tiny: a cubic gives e^δ to rounding for |δ| < 1e-4 (one exp per token instead of two). The plain loop counts
    # the tokens with a larger δ instead of summing them (it computes no second exp, so that it vectorizes whole);
    # where it counts any, the caller runs the ``careful`` loop (a literal at both callers), which sums e^(y − ν)
    # itself there and gives far tokens (FAR) the dual logit log x + ν and ``far_term``. Where ν is no safe shift
    # (rare), the caller sums again from the max (:func:`_gap`).
    inner = 0.0
    total = 0.0
    wide = 0
    for i in range(lo, hi):
        lx = out[i] - log_total
        x = exp(lx)
        ti = kept[i] - lse
        ai = kap * q[i]
        y = _dual_logit(kind, ti, ai, lam, x, lx, nu, careful)
        inner += x * (lx - y) if x > 0.0 else 0.0
        if careful and _is_far(kind, ti, ai, x):
            inner += far_term(ti, ai, x, lx, nu)
        d = y - nu - lx
        near = abs(d) < 1e-4
        total += x * (1.0 + d * (1.0 + d * (0.5 + d / 6.0))) if near else (exp(y - nu) if careful else 0.0)
        if not careful:  # masked tokens (t = −inf, d NaN) add e^(−inf) = 0 in either loop
            wide += (not near) & (ti > -np.inf)
    return inner, total, wide


@jit(fastmath=LOOP)
def _certificate(kind, kept, q, lse, kap, lam, nu, log_total, lo, hi, out):
    return _certificate_tokens(kind, kept, q, lse, kap, lam, nu, log_total, lo, hi, out, False)


@jit(fastmath=LOOP)
def _certificate_careful(kind, kept, q, lse, kap, lam, nu, log_total, lo, hi, out):
    return _certificate_tokens(kind, kept, q, lse, kap, lam, nu, log_total, lo, hi, out, True)


@jit()
def _ordered(values):
    # a plain left-to-right sum: both drivers add a row's chunk sums in this one order
    acc = 0.0
    for j in range(values.size):
        acc += values[j]
    return acc


@jit()
def _begin(kind, z, out, sums, lam, share, st):
    """A row's state from its chunks' :func:`_prepare` sums (``sums``, chunks × 6), or what is wrong with its z.

    λ′ = λ(1−m)/(1+λm) is the divergence's own weight, and a = κq with κ = λ′/mass
    (rkl) or 2λ′/mass (l2), λ′ times q renormalised over the allowed tokens. A row
    with λ = 0 or no reference mass there is left as softmax (``st[SOFT]``).
    """
    if _ordered(sums[:, 3]) > 0:
        return HAS_NAN
    if _ordered(sums[:, 4]) > 0:
        return HAS_POSINF
    if _ordered(sums[:, 5]) == 0:
        return ALL_MASKED
    st[SCALE] = 1.0 + lam * share
    st[LAM] = lam * (1.0 - share) / st[SCALE]
    st[MASS] = _ordered(sums[:, 0])
    st[LSE] = _combine(sums[:, 1], sums[:, 2])
    soft = lam == 0.0 or not st[MASS] > 0.0
    st[SOFT] = soft
    if soft and lam * share > 0.0:  # out holds the leaned logits: softmax is of z itself, shifted by its largest
        st[TOP] = _finite_max(z)
        for i in range(z.size):
            out[i] = z[i] - st[TOP]
        st[LSE] = _logsumexp(out)
    st[KAP] = (1.0 if kind == RKL else 2.0) * st[LAM] / (1.0 if soft else st[MASS])
    st[LOG_KAP] = math.log(max(st[KAP], _TINY))
    st[LOG_C] = math.log(max(2.0 * st[LAM], _TINY))
    # the ν search: ν (rkl starts at 0, where every x ≥ its softmax, so Σx ≥ 1), where Σx was last evaluated
    # (the answer if the budget runs out), the bracket, the reach of one-sided fallback steps (doubled each time:
    # the root may lie hundreds away), the last |log Σx|; exact passes until _bin_row says otherwise
    st[NU], st[AT], st[LOW], st[HIGH], st[REACH], st[LAST], st[BINNED] = 0.0, 0.0, -np.inf, np.inf, 1.0, np.inf, 0.0
    return FINE


@jit()
def _solving(st):
    # a row that takes ν steps: not softmax, and λ′ > 0 (λ′ = 0 is KL(x‖q) alone, the leaned softmax)
    return st[SOFT] == 0.0 and st[LAM] > 0.0


@jit()
def _shift(kind, st, nu):
    # the per-row constant of the Lambert argument at ν: log κ + lse + ν (rkl), log c − lse − ν (l2)
    return st[LOG_KAP] + st[LSE] + nu if kind == RKL else st[LOG_C] - st[LSE] - nu


@jit(fastmath=LOOP)
def _bin_row(v, q, base, st, hist):
    """An rkl row's histogram for its ν steps (BINS): ``hist`` (BINS, 4) gets, per bin of s at ν = 0
    (s = base + log κ + lse), Σq and Σq·dʲ (j = 1…3, d = s − the bin's centre); ``st[FREE]`` the softmax mass of
    the tokens without reference mass, whose x = e^(t − ν). ``st[BINNED]`` is 1 once the row is binned, 0 (exact
    passes) for a narrow row or one with a token outside the bins."""
    st[BINNED] = 0.0
    if v.size < BIN_MIN_WIDTH:
        return
    hist[:] = 0.0
    offset = st[LOG_KAP] + st[LSE] - BIN_S_LO
    first, last = BINS, -1
    free = 0.0
    for i in range(v.size):
        vi = v[i]
        if vi == -np.inf:
            continue
        qi = q[i]
        if qi <= 0.0:
            free += exp(vi - st[LSE])
            continue
        u = (base[i] + offset) * BIN_PER_UNIT
        if not (0.0 <= u < BINS):
            return
        k = int(u)
        first, last = min(first, k), max(last, k)
        d = (u - k - 0.5) / BIN_PER_UNIT
        hist[k, 0] += qi
        hist[k, 1] += qi * d
        hist[k, 2] += qi * d * d
        hist[k, 3] += qi * d * d * d
    st[BINNED], st[BIN_FIRST], st[BIN_LAST], st[FREE] = 1.0, first, last, free


@jit(fastmath=LOOP)
def _binned_sums(st, hist, table):
    # Σx, Σx′, Σx″ at st[NU] from the row's histogram (_bin_row): x = κq·f(s), f = 1/W(eˢ), whose derivatives in s
    # (= in ν) are f′ = −f·r, f″ = f·r³(1 + 2e), f‴ = −f·r⁵(1 + 4e + 6e²), e = W(eˢ), r = 1/(1 + e); Σx to the
    # third moment, Σx′ to the second, Σx″ to the first
    centre = BIN_S_LO + 0.5 / BIN_PER_UNIT + st[NU]
    total = 0.0
    slope = 0.0
    curve = 0.0
    for k in range(int(st[BIN_FIRST]), int(st[BIN_LAST]) + 1):
        m0 = hist[k, 0]
        if m0 == 0.0:
            continue
        e = lambert_e(centre + k / BIN_PER_UNIT, table)
        r = 1.0 / (1.0 + e)
        f0 = 1.0 / e
        f1 = -f0 * r
        f2 = f0 * r * r * r * (1.0 + 2.0 * e)
        f3 = -f0 * r * r * r * r * r * (1.0 + e * (4.0 + 6.0 * e))
        m1, m2, m3 = hist[k, 1], hist[k, 2], hist[k, 3]
        total += m0 * f0 + m1 * f1 + m2 * f2 / 2.0 + m3 * f3 / 6.0
        slope += m0 * f1 + m1 * f2 + m2 * f3 / 2.0
        curve += m0 * f2 + m1 * f3
    free = st[FREE] * math.exp(-st[NU])
    return st[KAP] * total + free, st[KAP] * slope - free, st[KAP] * curve + free


@jit()
def _sums_at(kind, v, q, base, st, table, hist, c, lo, hi, sums):
    # chunk c's Σx, Σx′, Σx″ at st[NU]; a binned row's are all in chunk 0's (the others add exact zeros)
    if st[BINNED] > 0.0:
        sums[0], sums[1], sums[2] = _binned_sums(st, hist, table) if c == 0 else (0.0, 0.0, 0.0)
        return
    sums[0], sums[1], sums[2] = _sums(kind, v, q, base, _shift(kind, st, st[NU]), st[LSE] + st[NU], st[KAP],
                                      0.5 / st[LAM], table, lo, hi)


@jit()
def _advance(kind, st, sums):
    """A row's ν step from its chunks' Σx, Σx′, Σx″ at st[NU]; False once |log Σx| is within tolerance (ν stays).

    The steps of :func:`nu_step`, kept inside a bracket by bisection (also taken
    when a step does not halve |log Σx|: they can bounce between the two sides
    without closing in at large λ), stopped at |log Σx| ≤ ``nu_tolerance(λ′)``.
    """
    total = _ordered(sums[:, 0])
    st[AT] = st[NU]
    if total >= 1.0:
        st[LOW] = max(st[LOW], st[NU])
    else:
        st[HIGH] = min(st[HIGH], st[NU])
    miss = abs(math.log(total))
    if miss <= nu_tolerance(st[LAM]):
        return False
    step = st[NU] + nu_step(kind, total, _ordered(sums[:, 1]), _ordered(sums[:, 2]))
    both = np.isfinite(st[LOW]) and np.isfinite(st[HIGH])
    slow = both and miss > 0.5 * st[LAST]
    st[LAST] = miss
    if slow or not (st[LOW] < step < st[HIGH]):
        if both:
            step = 0.5 * (st[LOW] + st[HIGH])
        elif np.isfinite(st[LOW]):
            step = st[LOW] + st[REACH]
            st[REACH] *= 2.0
        else:
            step = st[HIGH] - st[REACH]
            st[REACH] *= 2.0
    st[NU] = step
    return True


@jit()
def _log_x_at(kind, v, q, base, kept, st, table, lo, hi, out, sums):
    # the finish's first pass over chunk lo:hi at the last ν evaluated (st[AT]): sums ← (Σx, far tokens) before the
    # row's normalisation; a softmax row is done here
    if st[SOFT] != 0.0:
        for i in range(lo, hi):
            out[i] -= st[LSE]
        return
    shift = _shift(kind, st, st[AT])
    _log_x(kind, v, q, base, shift, st[LSE], st[KAP], st[LAM], st[LOG_KAP], st[LOG_C], st[AT], table, lo, hi, out,
           kept)
    sums[0], sums[1] = _mass(out, kept, st[LSE], lo, hi)
    if sums[1] > 0 and kind == RKL:  # huge scores: the chunk again (v is in ``kept`` now)
        _log_x_far(kind, kept, q, base, shift, st[LSE], st[KAP], st[LAM], st[LOG_KAP], st[LOG_C], st[AT], table, lo,
                   hi, out, kept)
        sums[0] = _mass(out, kept, st[LSE], lo, hi)[0]


@jit()
def _normalise(st, sums):
    # a row's log Σx from its chunks' first finish pass: x is divided by it, so that it sums to 1 whatever ν's
    # passes made of Σx (binned, they round it to 1e-9)
    if st[SOFT] == 0.0:
        st[LOG_TOTAL] = math.log(_ordered(sums[:, 0]))


@jit()
def _certificate_at(kind, q, kept, st, lo, hi, out, sums):
    # the finish's second pass over chunk lo:hi: sums ← the certificate's (Σ x(log x − y), Σ e^(y − ν)), then log x
    # normalised; the careful loop where the first pass counted far tokens (sums[1]) or the plain one finds a
    # large δ
    if st[SOFT] != 0.0:
        return
    args = (kind, kept, q, st[LSE], st[KAP], st[LAM], st[AT], st[LOG_TOTAL], lo, hi, out)
    wide = 1
    if not (sums[1] > 0 and kind == RKL):
        sums[0], sums[1], wide = _certificate(*args)
    if wide > 0:
        sums[0], sums[1], _ = _certificate_careful(*args)
    for i in range(lo, hi):
        out[i] -= st[LOG_TOTAL]


@jit()
def _gap(kind, st, sums, logx, kept, q):
    # the certificate from the chunks' Σ x(log x − y) and Σ e^(y − ν), scaled by 1 + λm
    if st[SOFT] != 0.0:
        return 0.0
    summed = _ordered(sums[:, 1])
    if 1e-100 < summed < 1e100:
        lse_y = st[AT] + math.log(summed)
    else:  # ν was no safe shift (far from the optimum, e.g. out of ν steps): y again, and from its maximum
        y = np.full(logx.size, -np.inf)
        for i in range(logx.size):
            if logx[i] > -np.inf:
                y[i] = _dual_logit(kind, kept[i] - st[LSE], st[KAP] * q[i], st[LAM], math.exp(logx[i]), logx[i],
                                   st[AT], True)
        lse_y = _logsumexp(y)
    return st[SCALE] * max(_ordered(sums[:, 0]) + lse_y, 0.0)


@jit()
def _start_l2_row(st, sums):
    # l2 starts at ν = logsumexp(t + a), from its chunks' (max, Σ e^(u − max)): every x ≤ its softmax, so Σx ≤ 1
    st[NU] = _combine(sums[:, 1], sums[:, 2]) - st[LSE]


@jit()
def solve_row(kind, z, q, logq, lam, share, max_iter, table, out, base, kept, st, sums, hist):
    """One row of :func:`solve_batch`, serially, chunk by chunk: (status, ν steps, gap). Its chunks' sums are
    added in the order the lockstep driver adds them, so the row comes out bit for bit the same. ``hist``
    (BINS, 4) is the row's scratch for :func:`_bin_row`."""
    width = z.size
    chunks = (width + CHUNK - 1) // CHUNK
    _prepare_row(kind, z, q, logq, lam, share, out, base, sums, st)
    status = _begin(kind, z, out, sums[:chunks], lam, share, st)
    if status != FINE:
        return status, 0, 0.0
    iters = 0
    if _solving(st):
        if kind == L2:
            for c in range(chunks):
                lo, hi = _span(c, width)
                sums[c, 1], sums[c, 2] = _start_l2(out, q, st[KAP], lo, hi)
            _start_l2_row(st, sums[:chunks])
        else:
            _bin_row(out, q, base, st, hist)
        for _ in range(max_iter):
            for c in range(chunks):
                lo, hi = _span(c, width)
                _sums_at(kind, out, q, base, st, table, hist, c, lo, hi, sums[c])
            if not _advance(kind, st, sums[:chunks]):
                break
            iters += 1
    for c in range(chunks):
        lo, hi = _span(c, width)
        _log_x_at(kind, out, q, base, kept, st, table, lo, hi, out, sums[c])
    _normalise(st, sums[:chunks])
    for c in range(chunks):
        lo, hi = _span(c, width)
        _certificate_at(kind, q, kept, st, lo, hi, out, sums[c])
    return FINE, iters, _gap(kind, st, sums[:chunks], out, kept, q)


@jit(parallel=True)
def _solve_rows(kind, z, q, logq, lam, share, max_iter, table, out, base, kept, state, iters, gaps):
    # rows in parallel, each solved whole by one thread: one parallel region for the batch
    rows, width = z.shape
    chunks = (width + CHUNK - 1) // CHUNK
    status = np.zeros(rows, dtype=np.int64)
    part = np.empty((rows, chunks, 6))
    hist = np.empty((rows, BINS, 4))
    for b in numba.prange(rows):
        status[b], iters[b], gaps[b] = solve_row(kind, z[b], q[b], logq[b], lam[b], share, max_iter, table,
                                                 out[b], base[b], kept[b], state[b], part[b], hist[b])
    for b in range(rows):
        if status[b] != FINE:
            return status[b]
    return FINE


@jit(parallel=True)
def _solve_lockstep(kind, z, q, logq, lam, share, max_iter, table, out, base, kept, state, iters, gaps):
    # every pass over all (row, chunk) pairs of the rows still working at once: one row or a few spread over
    # every core, at one parallel region per pass; rows take their ν steps in lockstep and leave as they converge
    rows, width = z.shape
    chunks = (width + CHUNK - 1) // CHUNK
    part = np.empty((rows * chunks, 6))
    for t in numba.prange(rows * chunks):
        b, c = t // chunks, t % chunks
        lo, hi = _span(c, width)
        _prepare(kind, z[b], 0.0, q[b], logq[b], lam[b] * share,
                 kind == RKL and lam[b] * (1.0 - share) > 0.0, out[b], base[b], lo, hi, part[t])
    shifted = False  # rows whose scores lie beyond ±NEAR go through _prepare again, shifted (_prepare_row)
    for b in range(rows):
        state[b, TOP] = _row_peak(z[b], out[b], part[b * chunks:(b + 1) * chunks], lam[b] * share)
        shifted |= state[b, TOP] != 0.0
    if shifted:
        for t in numba.prange(rows * chunks):
            b, c = t // chunks, t % chunks
            if state[b, TOP] != 0.0:
                lo, hi = _span(c, width)
                _prepare(kind, z[b], state[b, TOP], q[b], logq[b], lam[b] * share,
                         kind == RKL and lam[b] * (1.0 - share) > 0.0, out[b], base[b], lo, hi, part[t])
    for b in range(rows):
        status = _begin(kind, z[b], out[b], part[b * chunks:(b + 1) * chunks], lam[b], share, state[b])
        if status != FINE:
            return status
    iters[:] = 0
    hist = np.empty((rows, BINS, 4))
    working = np.empty(rows, dtype=np.int64)
    n_work = 0
    for b in range(rows):
        if _solving(state[b]):
            working[n_work] = b
            n_work += 1
    if kind == L2:
        for t in numba.prange(n_work * chunks):
            b, c = working[t // chunks], t % chunks
            lo, hi = _span(c, width)
            part[t, 1], part[t, 2] = _start_l2(out[b], q[b], state[b, KAP], lo, hi)
        for j in range(n_work):
            _start_l2_row(state[working[j]], part[j * chunks:(j + 1) * chunks])
    else:
        for j in numba.prange(n_work):
            b = working[j]
            _bin_row(out[b], q[b], base[b], state[b], hist[b])
    for _ in range(max_iter):
        if n_work == 0:
            break
        for t in numba.prange(n_work * chunks):
            b, c = working[t // chunks], t % chunks
            lo, hi = _span(c, width)
            _sums_at(kind, out[b], q[b], base[b], state[b], table, hist[b], c, lo, hi, part[t])
        still = 0
        for j in range(n_work):
            b = working[j]
            if _advance(kind, state[b], part[j * chunks:(j + 1) * chunks]):
                iters[b] += 1
                working[still] = b
                still += 1
        n_work = still
    for t in numba.prange(rows * chunks):
        b, c = t // chunks, t % chunks
        lo, hi = _span(c, width)
        _log_x_at(kind, out[b], q[b], base[b], kept[b], state[b], table, lo, hi, out[b], part[t])
    for b in range(rows):
        _normalise(state[b], part[b * chunks:(b + 1) * chunks])
    for t in numba.prange(rows * chunks):
        b, c = t // chunks, t % chunks
        lo, hi = _span(c, width)
        _certificate_at(kind, q[b], kept[b], state[b], lo, hi, out[b], part[t])
    for b in range(rows):
        gaps[b] = _gap(kind, state[b], part[b * chunks:(b + 1) * chunks], out[b], kept[b], q[b])
    return FINE


def schedule(rows: int) -> int:
    """How to spread ``rows`` rows over numba's threads: a row per thread (:data:`ROWS`, one parallel region) for a
    batch at least as large as the thread count, every pass over all rows' chunks (:data:`LOCKSTEP`) for a smaller
    one, and one row alone on the calling thread (:data:`SERIAL`).

    One row gets no parallel region: a region waits for every thread of the team, and while other processes keep
    the cores busy a waiting thread comes back milliseconds later, far more than two threads save on one row
    (``benchmarks/solver.py``, sections 5 and 7).
    """
    if rows == 1:
        return SERIAL
    return ROWS if rows >= numba.get_num_threads() else LOCKSTEP


@jit()
def solve_batch(kind, z, q, logq, lam, share, max_iter, table, work, out, iters, gaps, mode):
    """``solve_toward`` for every row of ``z`` (B, V) toward ``q`` (B, V, finite, ≥ 0), λ = ``lam`` (B,) per row.

    Fills ``out`` with log x, ``iters`` with the ν steps and ``gaps`` with the
    certificate, scaled by 1 + λm for the share m = ``share`` on KL(x‖q) (λ′ = 0
    when m = 1: KL(x‖q) alone, closed form). q is restricted to the finite
    logits and renormalised; a row with no mass there, or with λ = 0, is left
    as softmax with gap 0. ``logq`` is log q, read where q > 0 (the context kernel
    builds both; ``solve_toward`` takes its log). ``work`` (2, B, V) is scratch, the
    caller's: allocated here, its page faults would cost more than the solve at
    every call. ``mode`` is :func:`schedule`'s: each row solved whole by one
    thread, rows in parallel (:data:`ROWS`) or one after another (:data:`SERIAL`),
    or every pass spread over all rows' chunks (:data:`LOCKSTEP`). All add each
    row's chunk sums in one order, so a row comes out bit for bit the same any
    way, in any batch. Returns :data:`FINE`, or what is wrong with the first row
    of z that has NaN, +inf or no finite entry, found in the first pass, before
    any ν step.
    """
    rows, width = z.shape
    state = np.empty((rows, STATE))
    if mode == ROWS:
        return _solve_rows(kind, z, q, logq, lam, share, max_iter, table, out, work[0], work[1], state,
                           iters, gaps)
    if mode == LOCKSTEP:
        return _solve_lockstep(kind, z, q, logq, lam, share, max_iter, table, out, work[0], work[1],
                               state, iters, gaps)
    part = np.empty(((width + CHUNK - 1) // CHUNK, 6))
    hist = np.empty((BINS, 4))
    for b in range(rows):
        status, iters[b], gaps[b] = solve_row(kind, z[b], q[b], logq[b], lam[b], share, max_iter, table,
                                              out[b], work[0, b], work[1, b], state[b], part, hist)
        if status != FINE:
            return status
    return FINE


@jit()
def _combine(tops, totals):
    # logsumexp from per-chunk (max, Σ e^(v − max)) pairs
    top = tops.max()
    if top == -np.inf:
        return -np.inf
    acc = 0.0
    for j in range(tops.size):
        if tops[j] > -np.inf:
            acc += totals[j] * math.exp(tops[j] - top)
    return top + math.log(acc)


@jit()
def _logsumexp(v):
    top = v.max()
    if top == -np.inf:
        return -np.inf
    acc = 0.0
    for i in range(v.size):
        acc += math.exp(v[i] - top)
    return top + math.log(acc)
