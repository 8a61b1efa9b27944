"""The torch backend: every operation in eager torch, on any device and dtype, all rows at once.

The same steps as the numba kernels (``backends/numba``), which the tests hold these to; what the fused backend
compiles (``backends/fused.py``) is this module's code, so the two cannot drift apart. λ is a tensor on the rows'
device or a float that becomes one without a copy from the host, and with ``check_every=0`` nothing is read back:
such a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from ..objective import gap, gap_to, primal
from ..solve_info import SolveInfo
from .numba import lambert, mirror

_TINY = 1e-300


def log_lambertw_exp(s: torch.Tensor, steps: int = 6) -> torch.Tensor:
    """ω = log W(eˢ), i.e. the root of ω + e^ω = s, by Newton from a close start."""
    big = s >= 1.0
    omega = torch.where(big, torch.log(torch.where(big, s - torch.log(s.clamp_min(1.0)), 1.0)),
                        s - torch.sigmoid(s))
    for _ in range(steps):
        e = torch.exp(omega)
        omega = omega - (omega + e - s) / (1.0 + e)
    return omega


def _grad(divergence: str, x: torch.Tensor, q: torch.Tensor, logx: torch.Tensor) -> torch.Tensor:
    """∇D(x) up to a per-row constant (which the certificate ignores)."""
    if divergence == "kl":
        return logx - torch.log(q.clamp_min(_TINY))
    if divergence == "rkl":
        # the floor of x, in a dtype where 1e-300 would round to 0 its smallest normal number (not 0/0)
        return -q / x.clamp_min(max(_TINY, torch.finfo(x.dtype).tiny))
    return 2.0 * (x - q)


def certificate_toward(logx: torch.Tensor, z: torch.Tensor, q: torch.Tensor, lam: float | torch.Tensor,
                       divergence: str) -> torch.Tensor:
    """Duality gap of the point exp(``logx``) for the problem toward ``q`` (−⟨x,z⟩ + ⟨x,log x⟩ + λ·D(x, q)),
    computed from scratch: a gap ≤ ε certifies the point ε-optimal whatever produced it.

    Args:
        logx (``torch.Tensor`` (B, V)): log of rows on the simplex (``-inf`` where x = 0).
        z (``torch.Tensor`` (B, V)): the logits.
        q (``torch.Tensor`` (B, V)): the reference rows.
        lam (``float`` or ``torch.Tensor`` (B, 1)): λ ≥ 0.
        divergence (``str``): D, one of ``DIVERGENCES``.

    Returns:
        ``torch.Tensor`` (B,): the gap of each row, ≥ 0.

    Example::

        >>> import torch
        >>> from gm_solver import solve_toward
        >>> z = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
        >>> q = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)
        >>> logx, info = solve_toward(z, q, lam=1.0, divergence="l2")
        >>> bool(certificate_toward(logx, z, q, 1.0, "l2") <= 1e-6)
        True
        >>> bool(certificate_toward(torch.log_softmax(z, -1), z, q, 1.0, "l2") > 1e-3)   # softmax is not optimal
        True
    """
    finite = torch.isfinite(z)
    # the gap is the same for z shifted by a constant per row; by its largest finite score, |z| is its spread
    peak = torch.where(finite, z, -torch.inf).amax(-1, keepdim=True)
    z = z - torch.where(torch.isfinite(peak), peak, 0.0)
    x = torch.exp(logx)
    y = z - lam * _grad(divergence, x, q, logx)
    if divergence == "kl":  # tokens with q = 0 are excluded by the KL term itself
        y = torch.where(q > 0, y, torch.full_like(y, -torch.inf))
    y = torch.where(finite, y, torch.full_like(y, -torch.inf))
    if divergence != "rkl":
        return gap(x, y)
    # far tokens (``lambert.FAR``): the dual logit log x + c, c making softmax(y) agree with x on the others,
    # and the Fenchel–Young residual of that dual point (``lambert.far_term``)
    a = lam * q
    far = finite & (a > 0) & (x > 0) & (z - torch.logsumexp(z, -1, keepdim=True) < -lambert.FAR)
    near_y = torch.where(far, -torch.inf, y)
    held = torch.where(far, 0.0, x).sum(-1, keepdim=True)
    c = torch.where(held > 0, torch.logsumexp(near_y, -1, keepdim=True) - torch.log(held), 0.0)
    y = torch.where(far, logx + c, y)
    w = torch.where(far, x * (logx + c - z) / torch.where(far, a, 1.0), 1.0)
    d = w - 1.0
    residual = torch.where(w > 0, a * (d - torch.log1p(d)), torch.inf)
    return gap(x, y) + torch.where(far, residual, 0.0).sum(-1)


def restrict_reference(q: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q zeroed on disallowed tokens and renormalised; rows left with no mass stay zero (flagged False)."""
    q = torch.where(valid, q, torch.zeros_like(q))
    mass = q.sum(-1, keepdim=True)
    has_q = mass > 0
    return torch.where(has_q, q / torch.where(has_q, mass, 1.0), q), has_q


def _x_of_nu(divergence: str, t: torch.Tensor, a: torch.Tensor, c: torch.Tensor, nu: torch.Tensor, steps: int = 6):
    """x(ν) and its first two derivatives in ν; ``t`` are log-softmaxed logits, ``c`` = 2λ per row (B, 1)."""
    if divergence == "rkl":
        on = a > 0
        s = torch.log(torch.where(on, a, 1.0)) - t + nu
        omega = log_lambertw_exp(torch.where(on, s, torch.zeros_like(s)), steps=steps)
        e = torch.where(on, torch.exp(omega), torch.zeros_like(omega))  # a token with no reference mass: e^ω = 0
        x = torch.where(on, a * torch.exp(-omega), torch.exp(t - nu))
    else:
        s = torch.where(torch.isfinite(t), t + a - nu + torch.log(c), torch.zeros_like(t))
        e = torch.exp(log_lambertw_exp(s, steps=steps))
        x = torch.where(torch.isfinite(t), e / c, torch.zeros_like(t))
    # both kinds: dx/dν = −x/(1+e^ω), d²x/dν² = x(1+2e^ω)/(1+e^ω)³
    r = 1.0 / (1.0 + e)
    return x, -x * r, x * (1.0 + 2.0 * e) * r ** 3


def _nu_step(divergence: str, s: torch.Tensor, ds: torch.Tensor, d2s: torch.Tensor) -> torch.Tensor:
    """``lambert.nu_step`` for every row at once."""
    g = s * d2s / (ds * ds) - 1.0
    g = g.clamp(0.0, 1.0) if divergence == "rkl" else g.clamp(-1.0, 0.0)
    log_s = torch.log(s)
    small = g.abs() < 1e-12
    return torch.where(small, -s * log_s / ds, -s * torch.expm1(g * log_s) / (torch.where(small, 1.0, g) * ds))


def solve_rows(divergence: str, z: torch.Tensor, q: torch.Tensor, lam: float | torch.Tensor, kl_share: float, *,
               tol: float, max_iter: int, check_every: int) -> tuple[torch.Tensor, SolveInfo]:
    """``divergences.solve_toward`` in torch, every row at once, on any device and dtype: the same steps as the
    numba kernel. ``check_every`` as in :data:`gm_solver.backends.Defaults`; λ (a float, or a (B,) tensor on ``z``'s
    device) becomes a tensor without a copy from the host, so a step with ``check_every=0`` can be captured.

    A share m of λ on KL(x‖q) is solved as D alone at z′ = (z + λm·log q)/(1+λm) and λ′ = λ(1−m)/(1+λm),
    whose certificate scales by 1+λm (``lambert.solve_batch`` does the same).
    """
    rows = z.shape[0]
    lam = (lam.to(z.dtype) if isinstance(lam, torch.Tensor) else z.new_full((1,), lam)).expand(rows).unsqueeze(-1)
    valid = torch.isfinite(z)
    t = softmax_t = torch.log_softmax(z, dim=-1)
    q, has_q = restrict_reference(q.to(z.dtype), valid)
    soft = (lam == 0) | ~has_q  # softmax rows: λ = 0, or no reference mass on the allowed tokens
    scale = 1.0 + lam * kl_share
    lam_d = lam * (1.0 - kl_share) / scale
    if kl_share > 0.0:  # KL(x‖q) gives x = 0 where q = 0
        w = lam * kl_share
        leaned = torch.where(q > 0, (t + w * torch.log(q)) / (1.0 + w), torch.full_like(t, -torch.inf))
        t = torch.where(soft, t, torch.log_softmax(torch.where(soft, t, leaned), dim=-1))
    if kl_share == 1.0:  # KL(x‖q) alone: the leaned softmax is the solution
        divergence, logx = "kl", t
        iters = torch.zeros(rows, dtype=torch.long, device=z.device)
    else:
        lam_s = torch.where(lam_d > 0, lam_d, 1.0)  # softmax rows are replaced below
        logx, iters = _nu_solve(divergence, t, (lam_s if divergence == "rkl" else 2.0 * lam_s) * q, lam_s,
                                        max_iter, check_every)
    logx = torch.where(soft, softmax_t, logx)
    g = scale.squeeze(-1) * certificate_toward(logx, t, torch.where(has_q, q, 1.0), lam_d, divergence)
    g = torch.where(soft.squeeze(-1), 0.0, g)
    iters = torch.where(soft.squeeze(-1), 0, iters)
    return logx, SolveInfo(iters, g, g <= tol, 0)


def _nu_solve(divergence: str, t: torch.Tensor, a: torch.Tensor, lam: torch.Tensor, max_iter: int,
                      check_every: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All rows at once in torch (any device): the kernel's ν steps, kept inside a bracket by bisection
    (also taken when a step does not halve |log Σx|). ``lam`` is (B, 1), > 0. ``check_every`` 0 takes ``max_iter``
    steps with no host synchronisation, rows frozen once converged."""
    valid = torch.isfinite(t)
    c = 2.0 * lam
    tolerance = lambert.NU_TOL / lam.clamp_min(1.0)
    # starts: for rkl ν = 0 gives every xᵢ ≥ softmax(z)ᵢ; for l2 ν = logsumexp(z + 2λq) gives xᵢ ≤ its softmax
    nu = torch.zeros_like(t[:, :1]) if divergence == "rkl" else torch.logsumexp(t + a, -1, keepdim=True)
    lo = torch.full_like(nu, -torch.inf)
    hi = torch.full_like(nu, torch.inf)
    reach = torch.ones_like(nu)  # one-sided fallback steps double, as in the kernel
    last = torch.full_like(nu, torch.inf)
    iters = torch.zeros(t.shape[0], dtype=torch.long, device=t.device)
    for step_count in range(1, max_iter + 1):
        x, dx, d2x = _x_of_nu(divergence, t, a, c, nu)
        s = x.sum(-1, keepdim=True)
        ds = dx.sum(-1, keepdim=True)
        lo = torch.where(s >= 1.0, torch.maximum(lo, nu), lo)
        hi = torch.where(s < 1.0, torch.minimum(hi, nu), hi)
        log_s = torch.log(s)
        miss = log_s.abs()
        done = (miss <= tolerance).squeeze(-1)
        iters += (~done).long()
        if check_every and step_count % check_every == 0 and bool(done.all()):
            break
        step = nu + _nu_step(divergence, s, ds, d2x.sum(-1, keepdim=True))
        both = torch.isfinite(lo) & torch.isfinite(hi)
        mid = torch.where(both, 0.5 * (lo + hi), torch.where(torch.isfinite(lo), lo + reach, hi - reach))
        # bisect when a step did not halve |log Σx| (it can bounce between the sides)
        inside = (step > lo) & (step < hi) & ~(both & (miss > 0.5 * last))
        last = torch.where(done.unsqueeze(-1), last, miss)
        reach = torch.where(inside | both | done.unsqueeze(-1), reach, 2.0 * reach)
        step = torch.where(inside, step, mid)
        nu = torch.where(done.unsqueeze(-1), nu, step)
    logx = torch.log(x) - torch.log(s)
    return torch.where(valid & (x > 0), logx, torch.full_like(logx, -torch.inf)), iters


def reference_rows(reference: Any, contexts: torch.Tensor, width: int, knn: tuple | None = None) -> torch.Tensor:
    """``reference``'s rows q(· | context) (B, ``width``) in float64 on ``contexts``' device: the numba kernel's q,
    from fixed-width gathers (no size is read back to the host). ``contexts``: ``ContextReference.contexts`` (or
    ids, whose last ``tail`` columns are read). ``knn`` = (tokens (B, k), weights (B, k), β) mixes a sparse
    distribution in: (1 − β)·q + β·p_knn."""
    dev = reference.on(contexts.device)
    ctx = reference.contexts(contexts)
    rows = ctx.shape[0]
    weights = reference.weights(ctx)  # per row: the orders its own context reaches
    q = torch.zeros(rows, width, dtype=torch.float64, device=contexts.device)
    for k, beta in enumerate(reference.config.order_weights, start=1):
        if beta > 0.0:
            q[:, :reference.n] += weights[:, k - 1:k] * (_order_one(reference, ctx, dev) if k == 1
                                                         else _order_k(reference, ctx[:, -k], k, dev))
    if knn is not None:
        tokens, weights, share = knn
        q = (1.0 - share) * q
        q.scatter_add_(1, tokens.to(q.device), share * weights.to(q.device))
    return q


def _token_counts(reference: Any, token: torch.Tensor, dev: Any) -> tuple[torch.Tensor, torch.Tensor]:
    inside = (token >= 0) & (token < reference.n)
    token = torch.where(inside, token, 0)
    return token, torch.where(inside, dev.row_counts[token], 0.0)


def _order_one(reference: Any, ctx: torch.Tensor, dev: Any) -> torch.Tensor:
    """q₁ for each row: the (discounted) bigram row of the previous token, then each n-gram table's discount."""
    cfg = reference.config
    prev, c = _token_counts(reference, ctx[:, -1], dev)
    seen = c > 0
    c_safe = torch.where(seen, c, 1.0)
    cols, vals, mask = _gather(dev.indptr, dev.indices, dev.counts, prev, seen, dev.row_width)
    if reference.kneser_ney:
        coef = torch.where(seen, cfg.discount * dev.successors[prev] / c_safe, 1.0)
        piece = (vals - cfg.discount).clamp_min(0.0) / c_safe[:, None]
    else:
        coef = torch.where(seen, cfg.kappa / (c + cfg.kappa), 1.0)
        piece = vals / (c + cfg.kappa)[:, None]
    q = (coef[:, None] * dev.unigram).scatter_add_(1, cols, torch.where(mask, piece, 0.0))
    for order, contexts, table_ptr, table_next, table_counts, widest in dev.ngrams:
        history = ctx[:, ctx.shape[1] - (order - 1):]
        inside = ((history >= 0) & (history < reference.n)).all(-1)
        key = torch.zeros_like(history[:, 0])
        for j in range(order - 1):
            key = key * reference.n + torch.where(inside, history[:, j], 0)
        i = torch.searchsorted(contexts, key).clamp_max(contexts.numel() - 1)
        found = inside & (contexts[i] == key)
        cols, cnt, mask = _gather(table_ptr, table_next, table_counts, i, found, widest)
        total = torch.where(found, (cnt * mask).sum(-1), 1.0)
        gamma = cfg.discount * mask.sum(-1) / total
        piece = torch.where(mask, (cnt - cfg.discount).clamp_min(0.0) / total[:, None], 0.0)
        q = torch.where(found[:, None], (gamma[:, None] * q).scatter_add_(1, cols, piece), q)
    return q


def _order_k(reference: Any, token: torch.Tensor, k: int, dev: Any) -> torch.Tensor:
    """q_k for each row's token k places back: its row of Ãᵏ under a Dirichlet prior toward the unigram."""
    kappa = reference.config.kappa
    token, c = _token_counts(reference, token, dev)
    seen = c > 0
    c_safe = torch.where(seen, c, 1.0)
    cols, vals, mask = _gather(dev.indptr, dev.indices, dev.counts, token, seen, dev.row_width)
    x = torch.zeros(token.shape[0], reference.n, dtype=torch.float64, device=token.device)
    x.scatter_add_(1, cols, torch.where(mask, vals / c_safe[:, None], 0.0))  # Ã[token]
    for _ in range(k - 1):
        x = (dev.transition_t @ x.T).T  # x Ã
    coef = torch.where(seen, (kappa + c * (1.0 - x.sum(-1))) / (c + kappa), 1.0)
    return coef[:, None] * dev.unigram + torch.where(seen, c / (c + kappa), 0.0)[:, None] * x


def _gather(indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, row: torch.Tensor, keep: torch.Tensor,
            width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row ``row[b]`` of a CSR structure for each b, ``width`` entries wide: (columns, values, mask); rows where
    ``keep`` is False come out empty. Fixed width, so no length is read back to the host."""
    start = indptr[row]
    length = torch.where(keep, indptr[row + 1] - start, 0)
    offset = torch.arange(width, device=row.device)
    mask = offset[None, :] < length[:, None]
    pos = torch.where(mask, start[:, None] + offset[None, :], 0)
    return torch.where(mask, indices[pos], 0), torch.where(mask, values[pos], 0.0), mask


def _masked(v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, v, torch.full_like(v, -torch.inf))


def _candidate(valid, s, x, ly, diag, lam):
    """log x_c = log softmax(log x + η⊙(log softmax(y) − log x)), η_j = 1 / (1 + λ D_j x_j) (``_propose``'s)."""
    damp = torch.where(x > 0, 1.0 / (1.0 + lam * diag * x), torch.ones_like(x))
    return torch.log_softmax(_masked(s + damp * (ly - s), valid), dim=-1)


def context_step(reference: Any, contexts: torch.Tensor, scores: torch.Tensor, lam: float | torch.Tensor,
                 kl_share: float, *, tol: float, max_iter: int, check_every: int,
                 knn: tuple | None = None) -> tuple[torch.Tensor, SolveInfo]:
    """One step of the context decoders: :func:`reference_rows` then :func:`solve_rows` on the scores in float64;
    log x comes back in the scores' dtype."""
    q = reference_rows(reference, contexts.to(scores.device), scores.shape[-1], knn)
    logx, info = solve_rows(reference.config.divergence, scores.to(torch.float64), q, lam, kl_share, tol=tol,
                            max_iter=max_iter, check_every=check_every)
    return logx.to(scores.dtype), info


def csr_layout(m: sp.csr_matrix, device: torch.device) -> torch.Tensor:
    """M as a torch sparse CSR tensor on ``device``, in float64 (cuSPARSE on CUDA)."""
    index = torch.int32 if m.nnz < 2**31 else torch.int64
    return torch.sparse_csr_tensor(torch.as_tensor(np.asarray(m.indptr), dtype=index),
                                   torch.as_tensor(np.asarray(m.indices), dtype=index),
                                   torch.as_tensor(np.asarray(m.data, dtype=np.float64)),
                                   size=m.shape, check_invariants=False).to(device)


def csr_product(csr: torch.Tensor, v: torch.Tensor, base: torch.Tensor, residual: bool,
                rows: torch.Tensor | None) -> torch.Tensor:
    """``base − Mv`` (``residual``) or ``Mv`` for every row of ``v``, or for ``rows`` only (the others are 0); the ids
    beyond M's size are isolated nodes (M maps them to 0)."""
    if rows is None:
        return _product(csr, v, base, residual)
    out = torch.zeros_like(v)
    out[rows] = _product(csr, v[rows], base[rows], residual)
    return out


def _product(csr: torch.Tensor, v: torch.Tensor, base: torch.Tensor, residual: bool) -> torch.Tensor:
    n = csr.shape[0]
    out = torch.zeros_like(v)
    out[:, :n] = (csr @ v[:, :n].T.to(csr.dtype)).T.to(v.dtype)  # M is stored in float64
    return base - out if residual else out


def mirror_start(z, valid, diag, lam):
    """(log x, x) where the solve starts: softmax(z) moved ``mirror.START_STEPS`` steps toward
    softmax(z − 2λ D⊙x), the graph term's diagonal alone."""
    s = torch.log_softmax(z, dim=-1)
    x = torch.exp(s)
    for _ in range(mirror.START_STEPS):
        s = _candidate(valid, s, x, torch.log_softmax(z - 2.0 * lam * diag * x, dim=-1), diag, lam)
        x = torch.exp(s)
    return s, x


def mirror_score(z, valid, s, x, lx, gram, lam):
    """(f, gap, log softmax(y)) of the rows x = exp(s) with their (Lx, LᵀLx)."""
    ly = torch.log_softmax(z - 2.0 * lam * gram, dim=-1)
    return primal(x, z, lx, lam), gap_to(x, ly), ly


def mirror_step(z, valid, diag, s, x, lx, gram, ly, f, g, t, iters, op, lam, tol, *, early=False):
    """One step of ``solvers.mirror_descent`` on a working batch; rows already at gap ≤ tol stay as they are. With
    ``early`` the segment search stops once no row needs another halving (a read-back, where one costs nothing)."""
    cand, xc = mirror_propose(valid, s, x, ly, diag, lam)
    lxc, gramc = op.residual_and_gram(xc)
    return mirror_judge(z, valid, s, x, lx, gram, ly, f, g, t, iters, cand, xc, lxc, gramc, lam, tol, early=early)


def mirror_propose(valid, s, x, ly, diag, lam):
    """The step's candidate: (log x_c, x_c)."""
    cand = _candidate(valid, s, x, ly, diag, lam)
    return cand, torch.exp(cand)


def mirror_judge(z, valid, s, x, lx, gram, ly, f, g, t, iters, cand, xc, lxc, gramc, lam, tol, *, early=False):
    """The step from x toward its candidate x_c (with Lx_c, LᵀLx_c): the state after it, as :func:`mirror_step`."""
    active = g > tol
    d, dl = xc - x, lxc - lx
    both = (x > 0) & (xc > 0)
    zero = torch.zeros_like(x)
    d0 = torch.where(both, d * (s - z), zero).sum(-1) + 2.0 * lam * (lx * dl).sum(-1)
    d1 = torch.where(both, d * (cand - z), zero).sum(-1) + 2.0 * lam * (lxc * dl).sum(-1)
    step = torch.where((d0 < 0) & (d1 > 0), d0 / (d0 - d1), torch.ones_like(d0))
    bound = f + mirror.SLACK * f.abs().clamp_min(1.0)
    f_t = primal(xc, z, lxc, lam)
    whole = step == 1.0
    step = torch.where(whole & (f_t > bound), torch.full_like(step, 0.5), step)
    whole = whole & (f_t <= bound)
    # the rows that take part of the segment: halve t until f decreases (no product: Lx is linear in t), as often
    # as the kernel does; with ``early`` the loop stops once no row needs it (a read-back, where one costs nothing)
    for halving in range(mirror.HALVINGS + 1):
        xt = x + step[:, None] * d
        lxt = lx + step[:, None] * dl
        f_t = torch.where(whole, f_t, primal(xt, z, lxt, lam))
        short = active & ~whole & (f_t > bound)
        if halving == mirror.HALVINGS or (early and not bool(short.any())):
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


