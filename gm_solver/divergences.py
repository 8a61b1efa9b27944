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

import torch

from . import backends
from .checks import logit_value_checks, raise_unless
from .decoders.context import DIVERGENCES  # the names the context settings accept; each is solved here
from .solve_info import SolveInfo, softmax_solution


def solve_toward(z: torch.Tensor, q: torch.Tensor, lam: float | torch.Tensor, divergence: str = "rkl", *,
                 kl_share: float = 0.0, tol: float = 1e-6, max_iter: int | None = None, backend: str = "auto",
                 check_every: int | None = None) -> tuple[torch.Tensor, SolveInfo]:
    """log of argmin over the simplex of −⟨x,z⟩ + ⟨x,log x⟩ + λ·[(1−m)·D(x, q) + m·KL(x‖q)], m = ``kl_share``,
    per row, with its certificate.

    ``z`` and ``q`` are (B, V) in the working dtype; ``-inf`` logits get x = 0
    whatever q says (q is renormalised over the allowed tokens), and a row of q
    with no mass there leaves that row as softmax. ``lam`` is one λ ≥ 0 for
    every row or a (B,) tensor of them (λ = 0: softmax, gap 0). ``backend``
    (``gm_solver.backends``): "numba" (the CPU kernel, float64, every row in one
    call), "torch" (any device and dtype) or "auto" (numba where it applies).
    ``kl_share`` = 0 is D alone, 1 is KL(x‖q) alone (``"kl"``). ``check_every``
    (torch): ν steps between the convergence checks that read a value back to
    the host; 0 never reads one: ``max_iter`` ν steps, converged rows frozen, the
    input checks asserted on the device, and ``info.converged`` left there. Both
    default to ``backends.DEFAULTS`` for the device: on the CPU 60 steps at most,
    checked at each; elsewhere 8 steps, none read back.

    Args:
        z (``torch.Tensor`` (B, V)): the logits, floating point; ``-inf`` masks a token.
        q (``torch.Tensor`` (B, V)): the reference rows, ≥ 0 (renormalised over the allowed tokens).
        lam (``float`` or ``torch.Tensor`` (B,)): λ ≥ 0, one for all rows or one per row.
        divergence (``str``, defaults to ``"rkl"``): D, one of ``DIVERGENCES`` (``"kl"``, ``"rkl"``, ``"l2"``).
        kl_share (``float``, defaults to 0.0): m in [0, 1], the share of λ on KL(x‖q).
        tol (``float``, defaults to 1e-6): the duality gap below which a row counts as converged.
        max_iter (``int`` or ``None``, defaults to ``None``): the ν steps per row at most (None: the device's default).
        backend (``str``, defaults to ``"auto"``): ``"numba"``, ``"torch"``, ``"fused"`` or ``"auto"``.
        check_every (``int`` or ``None``, defaults to ``None``): ν steps between host-side convergence checks
            (torch; 0: never; None: the device's default).

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
    if check_every is not None and (not isinstance(check_every, int) or check_every < 0):
        raise ValueError(f"check_every must be None or an int >= 0 (0: no host synchronisation), got {check_every!r}")
    name = backends.choose(z.device, backend, float64_only=z.dtype != torch.float64)
    budget = backends.defaults(z.device)
    max_iter = budget.nu_steps if max_iter is None else max_iter
    check_every = budget.check_every if check_every is None else check_every
    lam = check_inputs(z, q, lam, kl_share, tol, max_iter, sync=check_every != 0)
    if divergence == "kl":  # KL(x‖q) shared with itself is itself
        kl_share = 1.0
    if isinstance(lam, float) and lam == 0.0:
        return softmax_solution(z)
    logx, info = backends.room(name).solve_rows(divergence, z, q, lam, kl_share, tol=tol, max_iter=max_iter,
                                                check_every=check_every)
    info.backend = name
    return logx, info


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
