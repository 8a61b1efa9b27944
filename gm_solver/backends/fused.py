"""The fused backend: the torch backend's own operations compiled by ``torch.compile`` for a CUDA device.

Eager, a context decoder's step launches a few hundred small kernels (the n-gram gathers, the ν steps, the
Lambert-W Newton steps) and a paper decoder's mirror step some fifty, each tiny at a vocabulary of 49,152: on a GPU
the step is bound by launches, not by work. Traced, the same operations become a few fused kernels. What is traced
is exactly ``eager``'s code, so the two cannot drift apart; the tests compare both with the numba kernels.

- ``context_step``: the reference rows and the ν solve as one graph. Nothing inside is created from Python values
  or copied from the host: λ arrives as a (B,) tensor on the device (made once per value and batch, kept), the
  tables are the reference's device copies, and the solve takes its fixed ν steps without reading a gap back, so
  the step can also be captured in a CUDA graph. The batch is a dynamic dimension (a batch of one runs as two rows:
  torch specialises a dimension of size 1), the scores are solved in float64 whatever the model's dtype, and
  autograd is off (its mode is guarded), so one compile serves every batch size, dtype and caller.
- ``mirror_step``: a mirror step's candidate and its segment search, each one graph, around the eager CSR products
  (torch.compile does not trace sparse tensors).

A decoder compiles once its ``warmup()`` runs on a GPU (``graphmax generate`` does): each compile takes tens of
seconds, which a search over many settings (``graphmax tune``) would not repay. Where compiling fails, the step
says so (``failures``) and the caller runs the torch backend instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..solve_info import SolveInfo
from . import eager

RECOMPILE_LIMIT = 64
failures: dict[str, str] = {}  # what compiling for a device raised, by device: that device runs eager from then on


def _context_step(reference: Any, ctx: torch.Tensor, scores: torch.Tensor, lam: torch.Tensor, knn: tuple | None,
                  kl_share: float, max_iter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log x float64, ν steps, gap) of one context step for every row, by ``eager``'s operations."""
    q = eager.reference_rows(reference, ctx, scores.shape[-1], knn)
    logx, info = eager.solve_rows(reference.config.divergence, scores, q, lam, kl_share, tol=0.0, max_iter=max_iter,
                                  check_every=0)
    return logx, info.iterations, info.gap


@functools.cache
def compiled(function: str, backend: str = "inductor", fullgraph: bool = False):
    """``function`` ("context_step", "mirror_propose" or "mirror_judge") compiled by torch.compile with ``backend``
    (the tests trace with ``"eager"`` or ``"aot_eager"`` on the CPU); made once."""
    # every reference, scores' dtype and batch shape (one, then any) is an entry of one traced function's cache; at
    # torch's default of 8 a later decoder would run eager without a word
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    code = {"context_step": _context_step, "mirror_propose": eager.mirror_propose,
            "mirror_judge": functools.partial(eager.mirror_judge, early=False)}[function]
    return torch.compile(code, backend=backend, fullgraph=fullgraph)


def _run(device: torch.device, function: str, *args: Any, **kwargs: Any) -> Any:
    """``compiled(function)(*args)`` without autograd (``generate()`` decodes under no_grad, and the mode is
    guarded on), or None once compiling for ``device`` has failed."""
    key = str(device)
    if key in failures:
        return None
    try:
        with torch.no_grad():
            return compiled(function, **kwargs)(*args)
    except torch._dynamo.exc.TorchDynamoException as e:  # compiling failed (inductor, triton): eager from now on
        failures[key] = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        return None


_lams: dict[tuple, torch.Tensor] = {}


def _lam_rows(lam: float | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """λ per row as a (B,) float64 tensor on ``device``; a float's tensor is made once and kept (λ is the same at
    every step unless it decays with t)."""
    if isinstance(lam, torch.Tensor):
        return lam.to(device, torch.float64)
    key = (lam, rows, str(device))
    if key not in _lams:
        if len(_lams) > 256:  # λ_t decaying with t: one per step length, dropped when many
            _lams.clear()
        _lams[key] = torch.full((rows,), lam, dtype=torch.float64, device=device)
    return _lams[key]


def context_step(reference: Any, contexts: torch.Tensor, scores: torch.Tensor, lam: float | torch.Tensor,
                 kl_share: float, *, tol: float, max_iter: int, check_every: int = 0, knn: tuple | None = None,
                 backend: str = "inductor", fullgraph: bool = False) -> tuple[torch.Tensor, SolveInfo] | None:
    """``eager.context_step`` compiled (contexts as ``ContextReference.contexts`` makes them, ``tail`` wide: one
    traced shape); None where compiling failed (the caller then runs ``eager``). ``check_every`` is always 0 here:
    the step reads nothing back. ``backend`` and ``fullgraph`` are torch.compile's (the tests trace on the CPU)."""
    rows = scores.shape[0]
    ctx = reference.contexts(contexts.to(scores.device, torch.int64))
    args = [ctx, scores.to(torch.float64), _lam_rows(lam, rows, scores.device), *(() if knn is None else knn[:2])]
    # one row runs as two (torch specialises a dimension of size 1) and every input is contiguous (a slice's
    # strides are guarded): each would be one more compile
    args = [torch.cat([a, a]) if rows == 1 else a.contiguous() for a in args]
    for a in args:  # one graph for every batch size from the first call on
        torch._dynamo.maybe_mark_dynamic(a, 0)
    near = None if knn is None else (args[3], args[4], knn[2])
    reference.on(scores.device)  # the tables' first copy to the device is no part of the traced step
    out = _run(scores.device, "context_step", reference, args[0], args[1], args[2], near, kl_share, max_iter,
               backend=backend, fullgraph=fullgraph)
    if out is None:
        return None
    logx, iters, gap = (t[:rows] for t in out)
    return logx.to(scores.dtype), SolveInfo(iters, gap, gap <= tol, 0)


def mirror_step(z, valid, diag, s, x, lx, gram, ly, f, g, t, iters, op, lam, tol, *, early=False,
                backend: str = "inductor"):
    """``eager.mirror_step`` with its candidate and its segment search compiled (``early`` is never taken: it would
    read back); the eager step where compiling failed."""
    if z.shape[0] > 1:  # one graph for every batch of two rows or more (a batch of one is its own)
        for a in (z, valid, s, x, lx, gram, ly, f, g, t, iters):
            torch._dynamo.maybe_mark_dynamic(a, 0)
    proposed = _run(z.device, "mirror_propose", valid, s, x, ly, diag, lam, backend=backend)
    if proposed is None:
        return eager.mirror_step(z, valid, diag, s, x, lx, gram, ly, f, g, t, iters, op, lam, tol)
    cand, xc = proposed
    lxc, gramc = op.residual_and_gram(xc)
    if z.shape[0] > 1:
        for a in (cand, xc, lxc, gramc):
            torch._dynamo.maybe_mark_dynamic(a, 0)
    state = _run(z.device, "mirror_judge", z, valid, s, x, lx, gram, ly, f, g, t, iters, cand, xc, lxc, gramc, lam,
                 tol, backend=backend)
    if state is None:
        return eager.mirror_judge(z, valid, s, x, lx, gram, ly, f, g, t, iters, cand, xc, lxc, gramc, lam, tol)
    return state


reference_rows = eager.reference_rows
solve_rows = eager.solve_rows
csr_layout = eager.csr_layout
csr_product = eager.csr_product
mirror_start = eager.mirror_start
mirror_score = eager.mirror_score
