"""The numba backend: every operation by CPU kernels in float64, every row of a batch in one call.

The kernels live beside this module, one file per solve: ``lambert.py`` (the ν solve toward q, Lambert's W from a
table), ``context.py`` (the context decoders' reference rows and their whole step), ``mirror.py`` (the paper
decoder's mirror steps) and ``csr.py`` (the CSR products), over ``vector_math.py``'s exp and log. Each row stops at
its certificate: no fixed step budget is paid by a row that converged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from ...checks import ALL_MASKED, NAN, POSINF
from ...solve_info import SolveInfo
from . import context, csr, lambert, mirror


def raise_for_status(status: int, name: str) -> None:
    """The ValueError for what ``lambert.solve_batch`` found wrong with the logits ``name``, if anything."""
    messages = {lambert.HAS_NAN: NAN, lambert.HAS_POSINF: POSINF, lambert.ALL_MASKED: ALL_MASKED}
    if status != lambert.FINE:
        raise ValueError(messages[status].format(name=name))


def solve_rows(divergence: str, z: torch.Tensor, q: torch.Tensor, lam: float | torch.Tensor, kl_share: float, *,
               tol: float, max_iter: int, check_every: int = 1) -> tuple[torch.Tensor, SolveInfo]:
    """Every row by ``lambert.solve_batch`` in one call: log x (float64 CPU), ν steps and certificate per row.
    ``check_every`` is the torch backend's: the kernel checks every row at every step."""
    kind = lambert.L2 if divergence == "l2" else lambert.RKL  # kl: share 1, no ν steps
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
    with lambert.one_task_at_a_time():
        status = lambert.solve_batch(kind, z_np, q_np, logq, lam_np, float(kl_share), max_iter, lambert.TABLE,
                                     np.empty((2, *z_np.shape)), out, iters, gaps, lambert.schedule(rows))
    raise_for_status(status, "z")
    g = torch.from_numpy(gaps)
    return torch.from_numpy(out), SolveInfo(torch.from_numpy(iters), g, g <= tol, 0)


def reference_rows(reference: Any, contexts: torch.Tensor, width: int, knn: tuple | None = None) -> torch.Tensor:
    """``reference``'s rows q(· | context) (B, ``width``) in float64 on the CPU, by ``context.reference_rows``."""
    q = np.empty((contexts.shape[0], width))
    context.reference_rows(*reference.kernel_args(contexts, knn), q, np.empty_like(q))
    return torch.from_numpy(q)


def context_step(reference: Any, contexts: torch.Tensor, scores: torch.Tensor, lam: float | torch.Tensor,
                 kl_share: float, *, tol: float, max_iter: int, check_every: int = 1,
                 knn: tuple | None = None) -> tuple[torch.Tensor, SolveInfo]:
    """One step of the context decoders in one kernel call (``context.decode_step``): the reference rows and the ν
    solve together; the kernel checks the scores' values in its first pass. log x comes back in the scores' dtype."""
    rows, width = scores.shape
    # float64 copies of the scores and of log x, q, log q and the solve's scratch: buffers kept from step to step
    # (fresh ones cost page faults at every step); log x is handed out as a new tensor of the scores' dtype
    work = reference.scratch((6, rows, width))
    z, out = work[0], work[1]
    torch.from_numpy(z).copy_(scores.detach())
    if scores.dtype == torch.float64:
        out = np.empty_like(z)
    lam_np = lam.detach().numpy() if isinstance(lam, torch.Tensor) else np.full(rows, lam)
    iters = np.empty(rows, dtype=np.int64)
    gaps = np.empty(rows)
    kind = lambert.L2 if reference.config.divergence == "l2" else lambert.RKL  # kl: share 1, no ν steps
    with lambert.one_task_at_a_time():
        status = context.decode_step(kind, z, *reference.kernel_args(contexts, knn), lam_np, kl_share, max_iter,
                                     lambert.TABLE, work[2:], out, iters, gaps, lambert.schedule(rows))
    raise_for_status(status, "scores")
    g = torch.from_numpy(gaps)
    return torch.from_numpy(out).to(scores.dtype), SolveInfo(torch.from_numpy(iters), g, g <= tol, 0)


def csr_layout(m: sp.csr_matrix, device: torch.device) -> tuple[np.ndarray, ...]:
    """M laid out for ``csr.product`` (``csr.compact``); ``device`` is the CPU."""
    return csr.compact(m)


def csr_product(layout: tuple, v: torch.Tensor, base: torch.Tensor, residual: bool,
                rows: torch.Tensor | None) -> torch.Tensor:
    """``base − Mv`` (``residual``) or ``Mv`` for every row of ``v``, or for ``rows`` only (the others are 0)."""
    out = torch.empty_like(v)
    which = np.arange(v.shape[0]) if rows is None else rows.numpy()
    csr.product(*layout, v.contiguous().numpy(), base.contiguous().numpy(), residual, which, out.numpy())
    return out


def mirror_start(z, valid, diag, lam):
    """(log x, x) where the mirror descent starts (``mirror.start_rows``)."""
    z = z.contiguous()
    s, x = torch.empty_like(z), torch.empty_like(z)
    mirror.start_rows(z.numpy(), valid.contiguous().numpy(), diag.numpy(), lam, s.numpy(), x.numpy(),
                      *(np.empty_like(s.numpy()) for _ in range(3)))
    return s, x


def mirror_score(z, valid, s, x, lx, gram, lam):
    """(f, gap, log softmax(y)) of the rows x = exp(s) with their (Lx, LᵀLx) (``mirror.score_rows``)."""
    f, g, ly = (torch.empty_like(z[:, 0]), torch.empty_like(z[:, 0]), torch.empty_like(z))
    mirror.score_rows(z.numpy(), valid.numpy(), s.numpy(), x.numpy(), lx.numpy(), gram.numpy(), lam, ly.numpy(),
                      f.numpy(), g.numpy())
    return f, g, ly


def mirror_step(z, valid, diag, s, x, lx, gram, ly, f, g, t, iters, op, lam, tol, *, early=False):
    """The torch backend's ``mirror_step`` in ``mirror``'s fused passes; the kernels and the products pass over the
    rows already at gap ≤ tol (``early`` is the torch backend's: these kernels stop each row themselves)."""
    state = [u.contiguous() for u in (s, x, lx, gram, ly, f, g, t, iters)]
    s, x, lx, gram, ly, f, g, t, iters = (u.numpy() for u in state)  # updated in place by the kernels
    active = np.flatnonzero(g > tol)
    if active.size == 0:
        return state
    z, valid = z.contiguous().numpy(), valid.contiguous().numpy()
    cand, xc = np.empty_like(s), np.empty_like(s)
    mirror.propose_rows(valid, s, x, ly, diag.numpy(), lam, g, tol, cand, xc)
    lxc, gramc = op.residual_and_gram(torch.from_numpy(xc), rows=torch.from_numpy(active))
    mirror.judge_rows(z, valid, lam, tol, cand, xc, lxc.numpy(), gramc.numpy(), s, x, lx, gram, ly, f, g, t, iters,
                      np.empty_like(s))
    return state
