"""What every solve returns beside the distribution (:class:`SolveInfo`), and the solution at λ = 0."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SolveInfo:
    """Per-row iterations and duality gap, total operator applications, and traces when asked for: what every
    solve returns beside the distribution.

    Args:
        iterations (``torch.Tensor`` (B,)): the iterations (or ν steps) each row took.
        gap (``torch.Tensor`` (B,)): each row's certified duality gap.
        converged (``torch.Tensor`` (B,) of ``bool``): rows whose gap reached the tolerance.
        operator_applications (``int``): products with M or Mᵀ, all rows together.
        gap_trace (``list[torch.Tensor]``, defaults to ``[]``): the gaps after each iteration (``trace=True``).
        step_trace (``list[torch.Tensor]``, defaults to ``[]``): the step sizes of each iteration (``trace=True``).
        backend (``str`` or ``None``, defaults to ``None``): the backend that ran the solve (``gm_solver.backends``).

    Example::

        >>> import scipy.sparse as sp, torch
        >>> from gm_solver import graphmax
        >>> x, info = graphmax(torch.tensor([[1.0, 0.0]]), sp.csr_matrix([[0, 1.0], [1.0, 0]]), return_info=True)
        >>> bool(info.converged.all()), bool(info.gap.max() <= 1e-6), info.operator_applications > 0
        (True, True, True)
    """

    iterations: torch.Tensor
    gap: torch.Tensor
    converged: torch.Tensor
    operator_applications: int
    gap_trace: list[torch.Tensor] = field(default_factory=list)
    step_trace: list[torch.Tensor] = field(default_factory=list)
    backend: str | None = None


def softmax_solution(z: torch.Tensor) -> tuple[torch.Tensor, SolveInfo]:
    """The exact solution at λ = 0, where no regulariser is left: log softmax(z) in ``z``'s dtype, with the info of a
    solve that took no step (0 iterations, gap 0, converged). Every solver's entry returns it at λ = 0.

    The callers hand it their working dtype (float64) and round its result once to the scores' dtype, as they do
    every solution: a float32 log-sum-exp over SmolLM2's 49,152 logits is 1e-5 to 2.5e-5 low, by an amount that
    depends on the CPU's vector width (twice as far with AVX2 as with AVX-512), where float64 rounded to float32
    is within half a float32 ulp of log softmax(z) on any CPU.

    Args:
        z (``torch.Tensor`` (B, V)): the logits in the working dtype; ``-inf`` masks a token (x = 0 there).

    Returns:
        ``tuple[torch.Tensor, SolveInfo]``: log softmax(z), and the info of a solve certified where it starts.
    """
    zeros = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
    return torch.log_softmax(z, dim=-1), SolveInfo(zeros.long(), zeros, torch.ones_like(zeros, dtype=torch.bool), 0)
