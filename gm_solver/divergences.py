"""Graphmax toward a reference distribution: argmin over the simplex of −⟨x,z⟩ + ⟨x,log x⟩ + λ·D(x, q).

``q`` (one row per logits row) is a distribution the decoder should lean toward,
e.g. the corpus' next-token row for the current context (see ``context.py``).
Every divergence here is separable, so the solution is x_i(ν) for one scalar ν
per row, found by a safeguarded Newton search on Σᵢ xᵢ(ν) = 1:

- ``"kl"``  D = KL(x‖q):  closed form x ∝ exp((z + λ log q)/(1+λ)), a product of experts;
- ``"rkl"`` D = KL(q‖x):  log xᵢ − λqᵢ/xᵢ = zᵢ − ν, so xᵢ = λqᵢ / W(λqᵢ e^{ν−zᵢ});
  it keeps mass on every token the corpus continues with (a soft interpolation);
- ``"l2"``  D = ‖x − q‖²: the paper's squared L2 toward q, xᵢ = W(2λ e^{zᵢ+2λqᵢ−ν}) / 2λ.

W is Lambert's function, computed in log space. The certificate is the same as
for the paper's objective: at u = λ∇D(x), f(x) − g(u) = KL(x ‖ softmax(z − λ∇D(x))),
zero exactly at the optimum.

``kl_share`` = m splits λ between a divergence and KL(x‖q):
λ·[(1−m)·D(x,q) + m·KL(x‖q)]. The KL(x‖q) part merges with the entropy, so the
problem is (1+λm) times the same one with z′ = (z + λm·log q)/(1+λm) and
λ′ = λ(1−m)/(1+λm): one solve of D, whose certificate scales by 1+λm. It both
flattens the LM's logits and leans them geometrically toward q, which the
interpolation-like KL(q‖x) alone does not.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import lambert_kernel
from .objective import gap
from .solvers import SolveInfo

DIVERGENCES = ("kl", "rkl", "l2")
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
        return -q / x.clamp_min(_TINY)
    return 2.0 * (x - q)


def certificate_toward(logx: torch.Tensor, z: torch.Tensor, q: torch.Tensor, lam: float,
                       divergence: str) -> torch.Tensor:
    """Duality gap of the point exp(``logx``) for the problem toward ``q``, computed from scratch."""
    x = torch.exp(logx)
    y = z - lam * _grad(divergence, x, q, logx)
    if divergence == "kl":  # tokens with q = 0 are excluded by the KL term itself
        y = torch.where(q > 0, y, torch.full_like(y, -torch.inf))
    return gap(x, torch.where(torch.isfinite(z), y, torch.full_like(y, -torch.inf)))


def restrict_reference(q: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q zeroed on disallowed tokens and renormalised; rows left with no mass stay zero (flagged False)."""
    q = torch.where(valid, q, torch.zeros_like(q))
    mass = q.sum(-1, keepdim=True)
    has_q = mass > 0
    return torch.where(has_q, q / torch.where(has_q, mass, 1.0), q), has_q


def _x_of_nu(divergence: str, t: torch.Tensor, a: torch.Tensor, c: float, nu: torch.Tensor, steps: int = 6):
    """x(ν) and its first two derivatives in ν; ``t`` are log-softmaxed logits."""
    if divergence == "rkl":
        on = a > 0
        s = torch.log(torch.where(on, a, 1.0)) - t + nu
        omega = log_lambertw_exp(torch.where(on, s, torch.zeros_like(s)), steps=steps)
        e = torch.where(on, torch.exp(omega), torch.zeros_like(omega))  # a token with no reference mass: e^ω = 0
        x = torch.where(on, a * torch.exp(-omega), torch.exp(t - nu))
    else:
        s = torch.where(torch.isfinite(t), t + a - nu + math.log(c), torch.zeros_like(t))
        e = torch.exp(log_lambertw_exp(s, steps=steps))
        x = torch.where(torch.isfinite(t), e / c, torch.zeros_like(t))
    # both kinds: dx/dν = −x/(1+e^ω), d²x/dν² = x(1+2e^ω)/(1+e^ω)³
    r = 1.0 / (1.0 + e)
    return x, -x * r, x * (1.0 + 2.0 * e) * r ** 3


def _nu_step(divergence: str, s: torch.Tensor, ds: torch.Tensor, d2s: torch.Tensor) -> torch.Tensor:
    """``lambert_kernel.nu_step`` for every row at once."""
    g = s * d2s / (ds * ds) - 1.0
    g = g.clamp(0.0, 1.0) if divergence == "rkl" else g.clamp(-1.0, 0.0)
    log_s = torch.log(s)
    small = g.abs() < 1e-12
    return torch.where(small, -s * log_s / ds, -s * torch.expm1(g * log_s) / (torch.where(small, 1.0, g) * ds))


def solve_toward(z: torch.Tensor, q: torch.Tensor, lam: float, divergence: str = "rkl", *, kl_share: float = 0.0,
                 tol: float = 1e-6, max_iter: int = 60, backend: str = "auto") -> tuple[torch.Tensor, SolveInfo]:
    """log of argmin over the simplex of −⟨x,z⟩ + ⟨x,log x⟩ + λ·[(1−m)·D(x, q) + m·KL(x‖q)], m = ``kl_share``,
    per row, with its certificate.

    ``z`` and ``q`` are (B, V) in the working dtype; ``-inf`` logits get x = 0
    whatever q says (q is renormalised over the allowed tokens), and a row of q
    with no mass there leaves that row as softmax. ``backend``: "numba" (the
    fused CPU kernel, float64), "torch" (any device and dtype) or "auto" (numba
    where it applies). ``kl_share`` = 0 is D alone, 1 is KL(x‖q) alone (``"kl"``).

    Example::

        >>> import torch
        >>> z = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
        >>> q = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
        >>> logx, info = solve_toward(z, q, lam=1.0, divergence="rkl")
        >>> bool(info.gap.max() <= 1e-6), [round(v, 3) for v in logx.exp()[0].tolist()]
        (True, [0.393, 0.145, 0.462])
        >>> q = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)   # KL(x‖q) keeps x on q's support
        >>> logx, info = solve_toward(z, q, lam=1.2, divergence="rkl", kl_share=0.15)
        >>> bool(info.gap.max() <= 1e-6), [round(v, 3) for v in logx.exp()[0].tolist()]
        (True, [0.421, 0.301, 0.278])
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if not 0.0 <= kl_share <= 1.0:
        raise ValueError(f"kl_share must be in [0, 1] (the share of λ on KL(x‖q)), got {kl_share}")
    if not lam >= 0.0:
        raise ValueError(f"lam must be >= 0 (0 gives softmax), got {lam}")
    if lam == 0.0:  # no regulariser: softmax, exactly optimal
        zeros = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
        return torch.log_softmax(z, dim=-1), SolveInfo(zeros.long(), zeros, zeros == 0, 0)
    if kl_share == 1.0:
        divergence = "kl"
    numba_fits = z.device.type == "cpu" and z.dtype == torch.float64
    if backend not in ("auto", "numba", "torch"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'torch', got {backend!r}")
    if backend == "numba" and not numba_fits:
        raise ValueError(f"the numba kernel takes float64 CPU tensors, got {z.dtype} on {z.device}; "
                         f"use backend='torch'")
    if divergence != "kl" and (backend == "numba" or (backend == "auto" and numba_fits)):
        logx, iters, g = _solve_rows_numba(divergence, z, q, lam, kl_share, max_iter)
        return logx, SolveInfo(iters, g, g <= tol, 0)
    if kl_share > 0.0 and divergence != "kl":
        return _solve_with_kl_share(z, q, lam, divergence, kl_share, tol=tol, max_iter=max_iter)
    valid = torch.isfinite(z)
    t = torch.log_softmax(z, dim=-1)
    q, has_q = restrict_reference(q, valid)
    if divergence == "kl":
        a = (t + lam * torch.log(q)) / (1.0 + lam)
        logx = torch.log_softmax(torch.where(valid, a, torch.full_like(a, -torch.inf)), dim=-1)
        iters = torch.ones(z.shape[0], dtype=torch.long, device=z.device)
    else:
        logx, iters = _solve_rows_torch(divergence, t, lam * q if divergence == "rkl" else 2.0 * lam * q, lam, max_iter)
    # a row whose reference has no mass on the allowed tokens carries no information: softmax
    logx = torch.where(has_q, logx, t)
    g = torch.where(has_q.squeeze(-1), certificate_toward(logx, t, torch.where(has_q, q, 1.0), lam, divergence), 0.0)
    return logx, SolveInfo(iters, g, g <= tol, 0)


def _solve_with_kl_share(z: torch.Tensor, q: torch.Tensor, lam: float, divergence: str, kl_share: float, *,
                         tol: float, max_iter: int) -> tuple[torch.Tensor, SolveInfo]:
    """``solve_toward``'s torch path with 0 < m < 1: D alone at z′ = (z + λm·log q)/(1+λm) and
    λ′ = λ(1−m)/(1+λm) (the kernel does the same in ``lambert_kernel.solve_row``)."""
    scale = 1.0 + lam * kl_share
    q, has_q = restrict_reference(q, torch.isfinite(z))
    t = torch.log_softmax(z, dim=-1)
    # KL(x‖q) gives x = 0 where q = 0; a row with no reference mass stays softmax, as for D alone
    z_kl = torch.where(has_q, (t + lam * kl_share * torch.log(q)) / scale, t)
    logx, info = solve_toward(z_kl, q, lam * (1.0 - kl_share) / scale, divergence, tol=tol / scale,
                              max_iter=max_iter, backend="torch")
    g = info.gap * scale  # the problem is (1+λm) times the solved one
    return logx, SolveInfo(info.iterations, g, g <= tol, 0)


def _solve_rows_numba(divergence: str, z: torch.Tensor, q: torch.Tensor, lam: float, kl_share: float,
                      max_iter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row by the fused CPU kernel (``lambert_kernel.solve_row``): log x, iterations and certificate."""
    kind = lambert_kernel.RKL if divergence == "rkl" else lambert_kernel.L2
    z_np, q_np = z.contiguous().numpy(), q.to(torch.float64).contiguous().numpy()
    out = np.empty_like(z_np)
    rows = [lambert_kernel.solve_row(kind, z_np[b], q_np[b], float(lam), float(kl_share), max_iter,
                                     lambert_kernel.TABLE, out[b])
            for b in range(len(z_np))]
    iters, gaps = zip(*rows) if rows else ((), ())
    return (torch.from_numpy(out), torch.tensor(iters, dtype=torch.long),
            torch.tensor(gaps, dtype=torch.float64))


def _solve_rows_torch(divergence: str, t: torch.Tensor, a: torch.Tensor, lam: float,
                      max_iter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All rows at once in torch (any device): the kernel's ν steps, kept inside a bracket by bisection
    (also taken when a step does not halve |log Σx|)."""
    valid = torch.isfinite(t)
    c = 2.0 * lam
    # starts: for rkl ν = 0 gives every xᵢ ≥ softmax(z)ᵢ; for l2 ν = logsumexp(z + 2λq) gives xᵢ ≤ its softmax
    nu = torch.zeros_like(t[:, :1]) if divergence == "rkl" else torch.logsumexp(t + a, -1, keepdim=True)
    lo = torch.full_like(nu, -torch.inf)
    hi = torch.full_like(nu, torch.inf)
    reach = torch.ones_like(nu)  # one-sided fallback steps double, as in the kernel
    last = torch.full_like(nu, torch.inf)
    iters = torch.zeros(t.shape[0], dtype=torch.long, device=t.device)
    for _ in range(max_iter):
        x, dx, d2x = _x_of_nu(divergence, t, a, c, nu)
        s = x.sum(-1, keepdim=True)
        ds = dx.sum(-1, keepdim=True)
        lo = torch.where(s >= 1.0, torch.maximum(lo, nu), lo)
        hi = torch.where(s < 1.0, torch.minimum(hi, nu), hi)
        log_s = torch.log(s)
        miss = log_s.abs()
        done = (miss <= lambert_kernel.nu_tolerance(lam)).squeeze(-1)
        iters += (~done).long()
        if bool(done.all()):
            break
        step = nu + _nu_step(divergence, s, ds, d2x.sum(-1, keepdim=True))
        both = torch.isfinite(lo) & torch.isfinite(hi)
        mid = torch.where(both, 0.5 * (lo + hi), torch.where(torch.isfinite(lo), lo + reach, hi - reach))
        # bisect when a step did not halve |log Σx| (it can bounce between the sides)
        inside = (step > lo) & (step < hi) & ~(both & (miss > 0.5 * last))
        last = miss
        reach = torch.where(inside | both, reach, 2.0 * reach)
        step = torch.where(inside, step, mid)
        nu = torch.where(done.unsqueeze(-1), nu, step)
    logx = torch.log(x) - torch.log(s)
    return torch.where(valid & (x > 0), logx, torch.full_like(logx, -torch.inf)), iters
