"""The baseline a user would try instead of graphmax: interpolating the LM with the corpus model of the context.

p = (1−w)·softmax(z) + w·q(·|context), the kNN-LM recipe with the graph as the
datastore; q is the same back-off reference that context-aware graphmax uses.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from .context import ContextConfig, ContextReference
from .divergences import restrict_reference


class InterpolationLogitsProcessor(LogitsProcessor):
    """log((1−w)·softmax(scores) + w·q(·|input_ids)); ``-inf`` scores stay ``-inf``.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> counts = sp.csr_matrix([[0, 3, 1], [2, 0, 0], [0, 0, 0]], dtype=float)
        >>> proc = InterpolationLogitsProcessor(counts, weight=0.5)
        >>> out = proc(torch.tensor([[0]]), torch.zeros(1, 3))
        >>> round(float(out.exp().sum()), 6)
        1.0
    """

    def __init__(self, graph: Any, weight: float = 0.3, context: ContextConfig | None = None):
        if not isinstance(weight, (int, float)) or not 0.0 <= weight <= 1.0:
            raise ValueError(f"`weight` must be a float in [0, 1], got {weight!r}")
        self.weight = float(weight)
        self.reference = ContextReference(graph, context or ContextConfig())

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        z = scores.to(torch.float64)
        q, _ = restrict_reference(self.reference(input_ids, width=scores.shape[-1]).to(z.device), torch.isfinite(z))
        p = (1.0 - self.weight) * torch.softmax(z, -1) + self.weight * q
        return torch.where(p > 0, torch.log(p), torch.full_like(p, -torch.inf)).to(scores.dtype)
