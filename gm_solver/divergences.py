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
from .checks import ALL_MASKED, NAN, POSINF, logit_value_checks, raise_unless
from .objective import gap
from .solvers import SolveInfo, softmax_solution

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
    # far tokens (``lambert_kernel.FAR``): the dual logit log x + c, c making softmax(y) agree with x on the others,
    # and the Fenchel–Young residual of that dual point (``lambert_kernel.far_term``)
    a = lam * q
    far = finite & (a > 0) & (x > 0) & (z - torch.logsumexp(z, -1, keepdim=True) < -lambert_kernel.FAR)
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
    """``lambert_kernel.nu_step`` for every row at once."""
    g = s * d2s / (ds * ds) - 1.0
    g = g.clamp(0.0, 1.0) if divergence == "rkl" else g.clamp(-1.0, 0.0)
    log_s = torch.log(s)
    small = g.abs() < 1e-12
    return torch.where(small, -s * log_s / ds, -s * torch.expm1(g * log_s) / (torch.where(small, 1.0, g) * ds))


def solve_toward(z: torch.Tensor, q: torch.Tensor, lam: float | torch.Tensor, divergence: str = "rkl", *,
                 kl_share: float = 0.0, tol: float = 1e-6, max_iter: int = 60, backend: str = "auto",
                 check_every: int | None = None) -> tuple[torch.Tensor, SolveInfo]:
    """log of argmin over the simplex of −⟨x,z⟩ + ⟨x,log x⟩ + λ·[(1−m)·D(x, q) + m·KL(x‖q)], m = ``kl_share``,
    per row, with its certificate.

    ``z`` and ``q`` are (B, V) in the working dtype; ``-inf`` logits get x = 0
    whatever q says (q is renormalised over the allowed tokens), and a row of q
    with no mass there leaves that row as softmax. ``lam`` is one λ ≥ 0 for
    every row or a (B,) tensor of them (λ = 0: softmax, gap 0). ``backend``:
    "numba" (the CPU kernel, float64, every row in one call), "torch" (any
    device and dtype) or "auto" (numba where it applies). ``kl_share`` = 0 is D
    alone, 1 is KL(x‖q) alone (``"kl"``). ``check_every`` (torch path): ν steps
    between the convergence checks that read a value back to the host (None:
    every step on CPU, every 8 on other devices); 0 never reads one: ``max_iter``
    ν steps, converged rows frozen, the input checks asserted on the device, and
    ``info.converged`` left there.

    Args:
        z (``torch.Tensor`` (B, V)): the logits, floating point; ``-inf`` masks a token.
        q (``torch.Tensor`` (B, V)): the reference rows, ≥ 0 (renormalised over the allowed tokens).
        lam (``float`` or ``torch.Tensor`` (B,)): λ ≥ 0, one for all rows or one per row.
        divergence (``str``, defaults to ``"rkl"``): D, one of ``DIVERGENCES`` (``"kl"``, ``"rkl"``, ``"l2"``).
        kl_share (``float``, defaults to 0.0): m in [0, 1], the share of λ on KL(x‖q).
        tol (``float``, defaults to 1e-6): the duality gap below which a row counts as converged.
        max_iter (``int``, defaults to 60): the ν steps per row at most.
        backend (``str``, defaults to ``"auto"``): ``"numba"``, ``"torch"`` or ``"auto"``.
        check_every (``int`` or ``None``, defaults to ``None``): ν steps between host-side convergence checks
            (torch path; 0: never).

    Returns:
        ``tuple[torch.Tensor, SolveInfo]``: log x (B, V) in ``z``'s dtype, and the per-row iterations and gaps.

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
    if backend not in ("auto", "numba", "torch"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'torch', got {backend!r}")
    if check_every is not None and (not isinstance(check_every, int) or check_every < 0):
        raise ValueError(f"check_every must be None or an int >= 0 (0: no host synchronisation), got {check_every!r}")
    sync = check_every != 0
    lam = check_inputs(z, q, lam, kl_share, tol, max_iter, sync=sync)
    if divergence == "kl":  # KL(x‖q) shared with itself is itself
        kl_share = 1.0
    numba_fits = z.device.type == "cpu" and z.dtype == torch.float64
    if backend == "numba" and not numba_fits:
        raise ValueError(f"the numba kernel takes float64 CPU tensors, got {z.dtype} on {z.device}; "
                         f"use backend='torch'")
    if isinstance(lam, float) and lam == 0.0:
        return softmax_solution(z)
    if backend == "numba" or (backend == "auto" and numba_fits):
        logx, iters, g = _solve_rows_numba(divergence, z, q, lam, kl_share, max_iter)
        return logx, SolveInfo(iters, g, g <= tol, 0)
    return solve_torch(z, q, lam, divergence, kl_share, tol=tol, max_iter=max_iter, check_every=check_every)


def check_inputs(z: torch.Tensor, q: torch.Tensor | None, lam: float | torch.Tensor, kl_share: float, tol: float,
                 max_iter: int, *, sync: bool = True, skip_z_values: bool = False,
                 name: str = "z") -> float | torch.Tensor:
    """Refuse what the solvers cannot take, each with a one-line ValueError; returns λ as a float or a (B,) tensor.

    Shapes and settings are checked on the host; the values of ``z``, ``q``
    and a λ tensor with one host synchronisation, or asserted on the device
    when ``sync`` is False (a failure then surfaces as a device-side assert).
    ``q`` None: the caller builds the reference itself (``ContextReference.step``);
    ``skip_z_values``: the caller's kernel checks z's values in its first pass, before it reads them otherwise.
    ``name``: what the messages call z.
    """
    if not isinstance(z, torch.Tensor) or not z.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch tensor, got {type(z).__name__}")
    if z.dim() != 2 or z.shape[-1] == 0:
        raise ValueError(f"{name} must have shape (B, V) with V >= 1, got {tuple(z.shape)}")
    if q is not None:
        if not isinstance(q, torch.Tensor) or not q.is_floating_point():
            raise TypeError(f"q must be a floating-point torch tensor, got {type(q).__name__}")
        if q.shape != z.shape:
            raise ValueError(f"q has shape {tuple(q.shape)} but {name} has {tuple(z.shape)}: give one reference row "
                             f"per row of {name}, as wide as {name} (zeros for tokens the reference does not cover)")
        if q.device != z.device:
            raise ValueError(f"q is on {q.device} but {name} on {z.device}; move them to one device")
    if not 0.0 <= kl_share <= 1.0:
        raise ValueError(f"kl_share must be in [0, 1] (the share of λ on KL(x‖q)), got {kl_share}")
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be > 0, got {tol!r}")
    if not (isinstance(max_iter, int) and max_iter >= 1):
        raise ValueError(f"max_iter must be an int >= 1, got {max_iter!r}")
    checks = {} if skip_z_values else logit_value_checks(z, name)
    if q is not None:
        checks["q contains NaN or ±inf; the reference must be finite"] = torch.isfinite(q).all()
        checks["q has negative entries; the reference must be ≥ 0 (it is renormalised over the allowed tokens)"] = \
            ~(q < 0).any()
    if isinstance(lam, torch.Tensor):
        if lam.shape != (z.shape[0],) or not lam.is_floating_point():
            raise ValueError(f"lam must be a float or a floating-point tensor of shape ({z.shape[0]},), one λ per row, "
                             f"got {lam.dtype} of shape {tuple(lam.shape)}")
        lam = lam.to(device=z.device, dtype=torch.float64)
        checks["lam must be finite and >= 0 in every row (0 gives softmax)"] = (torch.isfinite(lam) & (lam >= 0)).all()
    elif isinstance(lam, (int, float)) and not isinstance(lam, bool):
        if not (math.isfinite(lam) and lam >= 0):
            raise ValueError(f"lam must be finite and >= 0 (0 gives softmax), got {lam}")
        lam = float(lam)
    else:
        raise ValueError(f"lam must be a float or a (B,) tensor, got {type(lam).__name__}")
    raise_unless(checks, sync)
    return lam


def raise_for_status(status: int, name: str) -> None:
    """The ValueError for what ``lambert_kernel.solve_batch`` found wrong with the logits ``name``, if anything."""
    messages = {lambert_kernel.HAS_NAN: NAN, lambert_kernel.HAS_POSINF: POSINF, lambert_kernel.ALL_MASKED: ALL_MASKED}
    if status != lambert_kernel.FINE:
        raise ValueError(messages[status].format(name=name))


def solve_torch(z: torch.Tensor, q: torch.Tensor, lam: float | torch.Tensor, divergence: str, kl_share: float, *,
                 tol: float, max_iter: int, check_every: int | None) -> tuple[torch.Tensor, SolveInfo]:
    """``solve_toward`` in torch, every row at once, on any device and dtype: the same steps as the kernel.

    A share m of λ on KL(x‖q) is solved as D alone at z′ = (z + λm·log q)/(1+λm) and λ′ = λ(1−m)/(1+λm),
    whose certificate scales by 1+λm (``lambert_kernel.solve_batch`` does the same).
    """
    rows = z.shape[0]
    lam = torch.as_tensor(lam, dtype=z.dtype, device=z.device).expand(rows).unsqueeze(-1)
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
        logx, iters = _solve_rows_torch(divergence, t, (lam_s if divergence == "rkl" else 2.0 * lam_s) * q, lam_s,
                                        max_iter, check_every)
    logx = torch.where(soft, softmax_t, logx)
    g = scale.squeeze(-1) * certificate_toward(logx, t, torch.where(has_q, q, 1.0), lam_d, divergence)
    g = torch.where(soft.squeeze(-1), 0.0, g)
    iters = torch.where(soft.squeeze(-1), 0, iters)
    return logx, SolveInfo(iters, g, g <= tol, 0)


def _solve_rows_numba(divergence: str, z: torch.Tensor, q: torch.Tensor, lam: float | torch.Tensor, kl_share: float,
                     max_iter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row by the CPU kernel (``lambert_kernel.solve_batch``) in one call: log x, ν steps and certificate."""
    kind = lambert_kernel.L2 if divergence == "l2" else lambert_kernel.RKL  # kl: share 1, no ν steps
    z_np, q_np = z.contiguous().numpy(), q.to(torch.float64).contiguous().numpy()
    rows = z_np.shape[0]
    lam_np = (lam.detach().to(torch.float64).contiguous().numpy() if isinstance(lam, torch.Tensor)
              else np.full(rows, float(lam)))
    # the kernel reads log q where q > 0: the context kernel's call and this one then have one signature, and the
    # kernel compiled for the decoder (setup.sh's warm-up) is loaded from the cache here, not compiled again (40 s)
    logq = np.log(q_np, out=np.full_like(q_np, -np.inf), where=q_np > 0)
    out = np.empty_like(z_np)
    iters = np.empty(rows, dtype=np.int64)
    gaps = np.empty(rows)
    with lambert_kernel.one_task_at_a_time():
        status = lambert_kernel.solve_batch(kind, z_np, q_np, logq, lam_np, float(kl_share), max_iter,
                                            lambert_kernel.TABLE, np.empty((2, *z_np.shape)), out, iters, gaps,
                                            lambert_kernel.schedule(rows))
    raise_for_status(status, "z")
    return torch.from_numpy(out), torch.from_numpy(iters), torch.from_numpy(gaps)


def _solve_rows_torch(divergence: str, t: torch.Tensor, a: torch.Tensor, lam: torch.Tensor, max_iter: int,
                      check_every: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """All rows at once in torch (any device): the kernel's ν steps, kept inside a bracket by bisection
    (also taken when a step does not halve |log Σx|). ``lam`` is (B, 1), > 0. ``check_every`` as in
    :func:`solve_toward`: 0 takes ``max_iter`` steps with no host synchronisation, rows frozen once converged."""
    if check_every is None:
        check_every = 1 if t.device.type == "cpu" else 8
    valid = torch.isfinite(t)
    c = 2.0 * lam
    tolerance = lambert_kernel.NU_TOL / lam.clamp_min(1.0)
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
