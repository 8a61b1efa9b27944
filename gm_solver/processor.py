"""``GraphmaxLogitsProcessor``: graphmax inside ``transformers``' ``generate()``."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from .context import ContextConfig, ContextReference
from .graphmax import SOLVERS, get_operator, log_graphmax
from .operator import TransitionOperator

MODES = ("paper", "context")


class GraphmaxLogitsProcessor(LogitsProcessor):
    r"""Replaces each step's scores by graphmax log-probabilities over a domain graph.

    Two modes:

    - ``mode="paper"``: the paper's context-free regulariser λ‖x − Mx‖² (it does
      not read ``input_ids``).
    - ``mode="context"``: λ·[(1−m)·D(x, q) + m·KL(x‖q)] with q = q(·|input_ids),
      leaning toward the corpus' next-token distribution for the current context
      (``gm_solver.context``);
      ``context`` holds its choices. :meth:`from_graph` uses what ``graphmax tune``
      stored in the graph, or the documented defaults.

    Works with greedy search, sampling (put temperature/top-k/top-p warpers after
    it) and beam search (which passes log-softmaxed scores: graphmax is invariant
    to a per-row shift), with decoder-only and encoder-decoder models, batches and
    left padding. ``-inf`` scores from earlier processors stay ``-inf``. Scores
    wider than the graph (padded vocabularies) treat the extra ids as isolated
    nodes (paper mode) or as tokens the corpus never continues with (context mode).

    Args:
        graph: a ``gm_graphs.Graph``, scipy sparse matrix, torch sparse CSR tensor or ``TransitionOperator``
            (context mode needs a ``Graph`` or a scipy count matrix).
        lam: paper mode's λ ≥ 0, the weight of ‖x − Mx‖²; 0 leaves the distribution as softmax.
        tol: duality gap at which each step's solve stops (certified).
        mode: "paper" or "context".
        context: a ``ContextConfig`` (context mode; default ``ContextConfig()``).
        solver: paper mode's "auto" (certified mirror descent) or "paper" (the paper's Algorithm 1).
        max_iter: paper mode's iteration budget per step.
        check_every: paper mode's iterations between convergence checks (host synchronisations); None:
            every iteration on CPU, every 8 on GPUs; 0: none at all (``max_iter`` steps, converged rows
            frozen; ``last_info.converged`` stays on the device).
        tokenizer: when given, refuse a graph built with another vocabulary.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> A = sp.random(32, 32, density=0.2, format="csr", random_state=0)
        >>> proc = GraphmaxLogitsProcessor(A, lam=1.0)
        >>> out = proc(torch.zeros(1, 3, dtype=torch.long), torch.randn(1, 32))
        >>> round(float(out.exp().sum()), 5)
        1.0
    """

    def __init__(self, graph: Any, lam: float = 1.0, tol: float = 1e-6, *, mode: str = "paper",
                 context: ContextConfig | None = None, solver: str = "auto", max_iter: int = 200,
                 check_every: int | None = None, tokenizer: Any = None, device: str | torch.device | None = None):
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        if context is not None and mode != "context":
            raise ValueError("`context` is only used with mode='context'")
        if not isinstance(lam, (int, float)) or not lam >= 0:
            raise ValueError(f"`lam` must be a float >= 0, got {lam!r}")
        if not isinstance(tol, (int, float)) or not tol > 0:
            raise ValueError(f"`tol` must be a float > 0, got {tol!r}")
        if solver not in SOLVERS:
            raise ValueError(f"`solver` must be one of {SOLVERS}, got {solver!r}")
        if not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"`max_iter` must be an int >= 1, got {max_iter!r}")
        if check_every is not None and (not isinstance(check_every, int) or check_every < 0):
            raise ValueError(f"`check_every` must be None or an int >= 0 (0: no host synchronisation), "
                             f"got {check_every!r}")
        if tokenizer is not None:
            if not hasattr(graph, "check_tokenizer"):
                raise ValueError("`tokenizer` can only be checked against a gm_graphs.Graph")
            graph.check_tokenizer(tokenizer)
        self.graph, self.lam, self.tol, self.solver, self.max_iter = graph, float(lam), float(tol), solver, max_iter
        self.mode, self.check_every = mode, check_every
        self.last_info = None
        if mode == "context":
            self.context = context or ContextConfig()
            self.reference = ContextReference(graph, self.context)
            return
        # Build (and cache) the operator now, so the first decoding step does not pay for the transpose.
        self.operator: TransitionOperator = get_operator(graph, torch.device(device or "cpu"))

    @classmethod
    def from_graph(cls, graph: Any, **kwargs) -> "GraphmaxLogitsProcessor":
        """Decode with the choice ``graphmax tune`` stored in ``graph``'s manifest, else ``ContextConfig()``.

        Example::

            from gm_graphs import load_graph
            proc = GraphmaxLogitsProcessor.from_graph(load_graph("imdb"))
            model.generate(**inputs, logits_processor=[proc])
        """
        stored = getattr(graph, "decoder", None)
        if stored and stored.get("mode") == "paper":
            return cls(graph, lam=stored["lam"], mode="paper", **kwargs)
        return cls(graph, mode="context", context=ContextConfig.from_dict(stored) if stored else ContextConfig(),
                   **kwargs)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.mode == "context":  # reference rows, solve and certificate for the batch, on the scores' device
            logp, self.last_info = self.reference.step(input_ids, scores, tol=self.tol)
            return logp
        if scores.device != self.operator.device:
            self.operator = get_operator(self.graph, scores.device)
        logp, self.last_info = log_graphmax(scores, self.operator, self.lam, tol=self.tol, solver=self.solver,
                                            max_iter=self.max_iter, check_every=self.check_every,
                                            return_info=True)
        return logp
