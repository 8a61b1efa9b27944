"""gm_solver: graphmax, the graph-regularised softmax, in torch, and the ``transformers`` logits processors that
decode with it.

What a user calls:

- decoding inside ``model.generate()``: ``GraphmaxLogitsProcessor.from_graph(graph)`` (the decoder a graph's stored
  choice names, :class:`DecoderChoice`; with ``datastore=`` the kNN one), or a decoder directly:
  :class:`PaperGraphmaxLogitsProcessor` (the paper's λ‖x − Ãx‖², certified),
  :class:`PaperAlgorithm1LogitsProcessor` (the paper's Algorithm 1, for reproduction),
  :class:`ContextGraphmaxLogitsProcessor` (context-aware, settings in :class:`ContextConfig`),
  :class:`KnnContextGraphmaxLogitsProcessor` (with a kNN datastore), :class:`MarginalBiasLogitsProcessor` (the
  datastore's marginal bias), and the baseline :class:`InterpolationLogitsProcessor`;
- the datastore: :class:`Datastore`, :func:`build_datastore`, :func:`load_datastore`, :func:`index_datastore`,
  :class:`HiddenStateTap`;
- the distributions themselves: :func:`graphmax` / :func:`log_graphmax`, :func:`solve_toward`, with their
  certificates :func:`certificate` / :func:`certificate_toward`, and the reference :class:`ContextReference`.

The processors import ``transformers``; they are loaded on first use (PEP 562), so ``import gm_solver`` does not.
"""

from __future__ import annotations

import importlib
from typing import Any

from .backends.eager import certificate_toward
from .choice import DecoderChoice
from .context import ContextReference
from .context_config import ContextConfig
from .datastore import Datastore, HiddenStateTap, build_datastore, index_datastore, load_datastore
from .divergences import solve_toward
from .graphmax import graphmax, log_graphmax
from .objective import certificate

# name → the module that defines it, imported on first access (it imports transformers)
_LAZY = {
    "GraphmaxLogitsProcessor": "processor",
    "PaperGraphmaxLogitsProcessor": "processor",
    "PaperAlgorithm1LogitsProcessor": "processor",
    "ContextGraphmaxLogitsProcessor": "processor",
    "KnnContextGraphmaxLogitsProcessor": "processor",
    "MarginalBiasLogitsProcessor": "processor",
    "InterpolationLogitsProcessor": "baselines",
}

__all__ = [
    # decoders for model.generate(): the factory (GraphmaxLogitsProcessor.from_graph) and each decoder
    "ContextGraphmaxLogitsProcessor", "GraphmaxLogitsProcessor", "InterpolationLogitsProcessor",
    "KnnContextGraphmaxLogitsProcessor", "MarginalBiasLogitsProcessor", "PaperAlgorithm1LogitsProcessor",
    "PaperGraphmaxLogitsProcessor",
    # the choice a graph stores, and the context decoder's settings inside it
    "ContextConfig", "DecoderChoice",
    # the context decoder's reference q(· | context) (what interpolation mixes in, too)
    "ContextReference",
    # the kNN datastore: build, index, load, and the tap on the model's head
    "Datastore", "HiddenStateTap", "build_datastore", "index_datastore", "load_datastore",
    # the distributions and their certificates
    "certificate", "certificate_toward", "graphmax", "log_graphmax", "solve_toward",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
