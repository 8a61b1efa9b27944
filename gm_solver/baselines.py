"""The baseline a user would try instead of graphmax: interpolating the LM with the corpus model of the context.

p = (1−w)·softmax(z) + w·q(·|context), the kNN-LM recipe with the graph as the
datastore; q is the same back-off reference that context-aware graphmax uses.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from transformers import LogitsProcessor

from .context import ContextReference
from .decoders.context import ContextConfig
from .padding import LeftPadding

# ContextConfig's fields that set graphmax's solve, not q: interpolation has no solve
_SOLVE_FIELDS = ("divergence", "lam", "kl_share")


class InterpolationLogitsProcessor(LeftPadding, LogitsProcessor):
    """log((1−w)·softmax(scores) + w·q(·|input_ids)); ``-inf`` scores stay ``-inf``. A left-padded batch decodes each
    row as alone inside ``proc.padding(attention_mask)`` (``gm_solver.padding``).

    Args:
        graph (``gm_graphs.Graph`` or scipy sparse matrix): the graph whose counts give q, as for
            ``ContextGraphmaxLogitsProcessor``.
        weight (``float``, defaults to 0.3): w in [0, 1], the weight of q.
        context (``ContextConfig`` or ``None``, defaults to ``None``): how q is smoothed (``ContextConfig()``:
            the context decoder's defaults); its solve settings (divergence, λ, kl_share) do not apply here and
            are refused when set away from their defaults.

    Returns (when called with ``input_ids`` (B, T) and ``scores`` (B, V)):
        ``torch.FloatTensor`` (B, V): the log of the mixture, in the scores' dtype.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> counts = sp.csr_matrix([[0, 3, 1], [2, 0, 0], [0, 0, 0]], dtype=float)
        >>> proc = InterpolationLogitsProcessor(counts, weight=0.5)
        >>> out = proc(torch.tensor([[0]]), torch.zeros(1, 3))
        >>> round(float(out.exp().sum()), 6)
        1.0
    """

    def __init__(self, graph: Any, weight: float = 0.3, context: ContextConfig | None = None):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not 0.0 <= weight <= 1.0:
            raise ValueError(f"`weight` must be a float in [0, 1], got {weight!r}")
        if context is not None and not isinstance(context, ContextConfig):
            raise TypeError(f"`context` must be a ContextConfig or None, got {type(context).__name__}")
        context = context or ContextConfig()
        for name in _SOLVE_FIELDS:
            if getattr(context, name) != getattr(ContextConfig(), name):
                raise ValueError(f"`context` sets {name}={getattr(context, name)!r}, which interpolation does not "
                                 f"use (it mixes softmax and q by `weight`); leave it at its default")
        self.weight = float(weight)
        self.reference = ContextReference(graph, context)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        z = scores.to(torch.float64)
        starts = self.row_starts(input_ids.shape[0]) if torch.is_tensor(input_ids) and input_ids.dim() == 2 else None
        q = self.reference.restricted(input_ids if starts is None else self.reference.contexts(input_ids, starts), z)
        p = (1.0 - self.weight) * torch.softmax(z, -1) + self.weight * q
        return torch.where(p > 0, torch.log(p), torch.full_like(p, -torch.inf)).to(scores.dtype)
