"""``GraphmaxLogitsProcessor``: graphmax inside ``transformers``' ``generate()``."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from .graphmax import SOLVERS, get_operator, log_graphmax
from .operator import TransitionOperator


class GraphmaxLogitsProcessor(LogitsProcessor):
    r"""Replaces each step's scores by graphmax log-probabilities over a domain graph.

    Works with greedy search, sampling (put temperature/top-k/top-p warpers after
    it) and beam search (which passes log-softmaxed scores: graphmax is invariant
    to a per-row shift), with decoder-only and encoder-decoder models, batches and
    left padding (the regulariser does not read ``input_ids``). ``-inf`` scores
    from earlier processors stay ``-inf``. Scores wider than the graph (padded
    vocabularies) treat the extra ids as isolated nodes.

    Args:
        graph: a ``gm_graphs.Graph``, scipy sparse matrix, torch sparse CSR tensor or ``TransitionOperator``.
        lam: λ ≥ 0, the weight of ‖x − Mx‖²; 0 leaves the distribution as softmax.
        tol: duality gap at which each step's solve stops (certified).
        solver: "auto" (certified mirror descent) or "paper" (the paper's Algorithm 1).
        tokenizer: when given, refuse a graph built with another vocabulary.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> A = sp.random(32, 32, density=0.2, format="csr", random_state=0)
        >>> proc = GraphmaxLogitsProcessor(A, lam=1.0)
        >>> out = proc(torch.zeros(1, 3, dtype=torch.long), torch.randn(1, 32))
        >>> round(float(out.exp().sum()), 5)
        1.0
    """

    def __init__(self, graph: Any, lam: float = 1.0, tol: float = 1e-6, *, solver: str = "auto",
                 max_iter: int = 200, tokenizer: Any = None, device: str | torch.device | None = None):
        if not isinstance(lam, (int, float)) or not lam >= 0:
            raise ValueError(f"`lam` must be a float >= 0, got {lam!r}")
        if not isinstance(tol, (int, float)) or not tol > 0:
            raise ValueError(f"`tol` must be a float > 0, got {tol!r}")
        if solver not in SOLVERS:
            raise ValueError(f"`solver` must be one of {SOLVERS}, got {solver!r}")
        if not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"`max_iter` must be an int >= 1, got {max_iter!r}")
        if tokenizer is not None:
            if not hasattr(graph, "check_tokenizer"):
                raise ValueError("`tokenizer` can only be checked against a gm_graphs.Graph")
            graph.check_tokenizer(tokenizer)
        self.graph, self.lam, self.tol, self.solver, self.max_iter = graph, float(lam), float(tol), solver, max_iter
        # Build (and cache) the operator now, so the first decoding step does not pay for the transpose.
        self.operator: TransitionOperator = get_operator(graph, torch.device(device or "cpu"))
        self.last_info = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.device != self.operator.device:
            self.operator = get_operator(self.graph, scores.device)
        logp, self.last_info = log_graphmax(scores, self.operator, self.lam, tol=self.tol, solver=self.solver,
                                            max_iter=self.max_iter, return_info=True)
        return logp
