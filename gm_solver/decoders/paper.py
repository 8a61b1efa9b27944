"""The paper's decoder kind (Liu & Yin, JAIR 2023): its settings (:class:`PaperConfig`), the operator of the graph
it reads (:class:`PaperGraph`) and its record in the table of kinds (:data:`KIND`). Its steps are
``gm_solver.processor.PaperGraphmaxLogitsProcessor`` (certified) and ``PaperAlgorithm1LogitsProcessor`` (the
paper's Algorithm 1), imported when first built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..arguments import choice, finite_nonnegative, finite_positive, integer, option, real
from .registry import DecoderKind

SOLVERS = ("mirror", "paper")  # certified mirror descent, or the paper's Algorithm 1 as printed
# k of Ãᵏ at most: gm_graphs.build.options.MAX_ORDER (operator names have three digits), which imports numpy and
# numba; held equal by tests/test_decoder_kinds.py
MAX_ORDER = 999


@dataclass(frozen=True)
class PaperConfig:
    """The settings of the paper's decoders (λ‖x − Mx‖²), each checked here.

    Args:
        lam (``float``, defaults to 1.0): λ ≥ 0, finite; 0 gives softmax.
        tol (``float``, defaults to 1e-6): the certified duality gap at which each step's solve stops.
        max_iter (``int``, defaults to 200): the iteration budget per step.
        solver (``str``, defaults to ``"mirror"``): ``"mirror"`` (certified mirror descent) or ``"paper"`` (the
            paper's Algorithm 1 as printed: T = 20 projected gradient steps, no convergence); with ``"paper"``,
            ``tol`` and ``max_iter`` have no effect and are refused away from their defaults.

    Raises:
        ValueError: a setting out of its range, naming it and its value.

    Example::

        >>> PaperConfig(lam=2)
        PaperConfig(lam=2.0, tol=1e-06, max_iter=200, solver='mirror')
        >>> PaperConfig(lam=1.0, max_iter=50, solver="paper")
        Traceback (most recent call last):
        ValueError: `max_iter`=50 has no effect with the paper's Algorithm 1 (its own T = 20 steps and stopping rule)
    """

    lam: float = option(1.0, "λ ≥ 0, the weight of ‖x − Ãx‖² (0 gives softmax)")
    tol: float = option(1e-6, "the duality gap each step's solve stops at")
    max_iter: int = option(200, "iterations per step")
    solver: str = option("mirror", "certified mirror descent (mirror) or the paper's Algorithm 1 (paper)",
                         choices=SOLVERS)

    def __post_init__(self):
        object.__setattr__(self, "lam", real("lam", self.lam, "a finite float >= 0 (0 gives softmax)",
                                             finite_nonnegative))
        object.__setattr__(self, "tol", real("tol", self.tol, "a finite float > 0", finite_positive))
        object.__setattr__(self, "max_iter", integer("max_iter", self.max_iter, "an int >= 1", lambda v: v >= 1))
        choice("solver", self.solver, SOLVERS)
        if self.algorithm1:
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                if f.name in ("tol", "max_iter") and value != f.default:
                    raise ValueError(f"`{f.name}`={value!r} has no effect with the paper's Algorithm 1 (its own "
                                     f"T = 20 steps and stopping rule)")

    @property
    def algorithm1(self) -> bool:
        """Whether the solver is the paper's Algorithm 1."""
        return self.solver == "paper"


@dataclass(frozen=True)
class PaperGraph:
    """Which operator M of the graph the paper's decoder reads: Ã, Ãᵏ or Ã+…+Ãⁿ (``load_graph``'s arguments).

    Args:
        order (``int``, defaults to 1): k of Ãᵏ, from 1 to ``MAX_ORDER``.
        mixture (``int`` or ``None``, defaults to ``None``): n ≥ 2 of the mixture Ã+…+Ãⁿ; ``None``: none.
    """

    order: int = option(1, "use Ãᵏ (default 1)")
    mixture: int | None = option(None, "use Ã+…+Ãⁿ (n ≥ 2)", reads="int")

    def __post_init__(self):
        integer("order", self.order, f"an int from 1 to {MAX_ORDER}", lambda v: 1 <= v <= MAX_ORDER)
        if self.mixture is not None:
            integer("mixture", self.mixture, f"an int from 2 to {MAX_ORDER} or None", lambda v: 2 <= v <= MAX_ORDER)


KIND = DecoderKind("paper", PaperConfig, "gm_solver.processor:PaperGraphmaxLogitsProcessor", "paper graphmax",
                   graph_settings=PaperGraph, kernels=("csr.product", "mirror.start_rows"))
