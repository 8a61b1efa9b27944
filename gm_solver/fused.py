"""The context decoders' step on a GPU as one compiled graph (``torch.compile``).

The eager torch path of :meth:`ContextReference.step` launches a few hundred small kernels per step (the n-gram
gathers, the ν steps, the Lambert-W Newton steps), each tiny at a vocabulary of 49,152, so on a GPU it is bound by
launches, not by work. Traced once, the same operations become a few fused kernels. What is traced is exactly the
eager path's code (``ContextReference._rows_torch`` and ``divergences.solve_torch``), so the two cannot drift
apart; the tests compare both with the numba kernel.

Inside the traced step nothing is created from Python values and nothing is copied from the host: λ arrives as a
(B,) tensor on the device, the tables are the reference's device copies, and the solve runs its fixed number of ν
steps without reading a gap back (``check_every=0``), so the step is also safe to capture in a CUDA graph. The
inputs' checks run before it, asserted on the device.

Only a decoder warmed up on a GPU (``warmup(device)``, as ``graphmax generate`` does) compiles its step: each new
reference is a compile of tens of seconds, which a search over many settings (``graphmax tune``) would not repay.
A context shorter than the n-gram tail takes the eager path (another shape, and only the first steps of a
prompt of one or two tokens). The batch is a dynamic dimension (a batch of one runs as two rows) and the scores
are solved in float64 whatever the model's dtype, and autograd is off (its mode is guarded), so one compile serves
every batch size, dtype and caller.
"""

from __future__ import annotations

from typing import Any

import torch

from .divergences import solve_torch

RECOMPILE_LIMIT = 64


def fused_available(device: torch.device) -> bool:
    """Whether the step can be compiled for ``device``: a CUDA device, with Triton for inductor's kernels."""
    if device.type != "cuda" or not hasattr(torch, "compile"):
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


def context_step(reference: Any, ctx: torch.Tensor, scores: torch.Tensor, lam: torch.Tensor,
                 knn: tuple | None, max_iter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of ``reference``'s problem for every row, by the eager path's own operations: (log x in the scores'
    dtype, ν steps per row, certified gap per row).

    Args:
        reference (``ContextReference``): whose configuration, tables and reference rows are used.
        ctx (``torch.Tensor`` (B, tail) int64): each row's last ``reference.tail`` tokens.
        scores (``torch.Tensor`` (B, V) float64): the LM's scores, V ≥ the graph's nodes.
        lam (``torch.Tensor`` (B,) float64): λ_t per row, on the scores' device.
        knn (``tuple`` or ``None``): (tokens (B, k), weights (B, k) float64, share) of a kNN distribution.
        max_iter (``int``): the ν steps taken, every one (rows frozen once converged).

    Returns:
        ``(log x, iterations, gap)``, log x in float64.
    """
    cfg = reference.config
    share = 1.0 if cfg.divergence == "kl" else cfg.kl_share
    q = reference._rows_torch(ctx, scores.shape[-1], knn)
    logx, info = solve_torch(scores.to(torch.float64), q, lam, cfg.divergence, share, tol=0.0, max_iter=max_iter,
                             check_every=0)
    return logx, info.iterations, info.gap


class FusedStep:
    """:func:`context_step` compiled by ``torch.compile`` for one reference; once compiling fails it says so in
    ``failed`` and answers None, and the caller keeps the eager path.

    Args:
        reference (``ContextReference``): the reference whose steps are compiled.
        backend (``str``, defaults to ``"inductor"``): torch.compile's backend (the tests trace with
            ``"aot_eager"`` on the CPU).
        fullgraph (``bool``, defaults to ``False``): refuse a graph break (the tests ask for one graph; order
            weights beyond the first read a sparse Ãᵏ, which torch.compile leaves to eager code).
    """

    def __init__(self, reference: Any, backend: str = "inductor", fullgraph: bool = False):
        # every reference, scores' dtype and batch shape (one, then any) is an entry of the one traced function's
        # cache; at torch's default of 8 a later decoder would run eager without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.reference = reference
        self.compiled = torch.compile(context_step, backend=backend, fullgraph=fullgraph)
        self.failed: str | None = None

    def __call__(self, ctx: torch.Tensor, scores: torch.Tensor, lam: torch.Tensor, knn: tuple | None,
                 max_iter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """:func:`context_step` for ``scores`` of any dtype (log x comes back in it), or None if compiling failed."""
        rows = scores.shape[0]
        args = [ctx, scores.to(torch.float64), lam, *(() if knn is None else knn[:2])]
        # one row runs as two (torch specialises a dimension of size 1) and every input is contiguous (a slice's
        # strides are guarded): each would be one more compile
        args = [torch.cat([a, a]) if rows == 1 else a.contiguous() for a in args]
        for a in args:  # one graph for every batch size from the first call on
            torch._dynamo.maybe_mark_dynamic(a, 0)
        near = None if knn is None else (args[3], args[4], knn[2])
        try:  # without autograd whatever the caller's mode (generate() decodes under no_grad): it is guarded on
            with torch.no_grad():
                logx, iters, gap = self.compiled(self.reference, args[0], args[1], args[2], near, max_iter)
        except torch._dynamo.exc.TorchDynamoException as e:  # compiling failed (inductor, triton): eager instead
            self.failed = " ".join(f"{type(e).__name__}: {e}".split())[:500]
            return None
        return logx[:rows].to(scores.dtype), iters[:rows], gap[:rows]
