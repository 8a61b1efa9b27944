"""gm_solver: graphmax, the graph-regularised softmax, in torch, and the ``transformers`` logits processors that
decode with it.

What a user calls:

- decoding inside ``model.generate()``: :class:`PaperGraphmaxLogitsProcessor` (the paper's λ‖x − Ãx‖²),
  :class:`ContextGraphmaxLogitsProcessor` (context-aware, with :class:`ContextConfig`),
  ``GraphmaxLogitsProcessor.from_graph(graph)`` (the decoder ``graphmax tune`` stored), and the baseline
  :class:`InterpolationLogitsProcessor`;
- the distributions themselves: :func:`graphmax` / :func:`log_graphmax` (and their modules :class:`Graphmax` /
  :class:`LogGraphmax`), :func:`solve_toward`, with their certificates :func:`certificate` /
  :func:`certificate_toward` and the :class:`SolveInfo` they return.

The processors import ``transformers``; they are loaded on first use (PEP 562), so ``import gm_solver`` does not.
"""

from __future__ import annotations

import importlib
from typing import Any

from .context import ContextConfig, ContextReference
from .datastore import Datastore, HiddenStateTap, build_datastore, index_datastore, load_datastore
from .divergences import DIVERGENCES, certificate_toward, solve_toward
from .graphmax import Graphmax, LogGraphmax, graphmax, log_graphmax
from .objective import certificate
from .operator import TransitionOperator
from .solvers import SolveInfo

# name → the module that defines it, imported on first access (it imports transformers)
_LAZY = {
    "GraphmaxLogitsProcessor": "processor",
    "PaperGraphmaxLogitsProcessor": "processor",
    "ContextGraphmaxLogitsProcessor": "processor",
    "KnnContextGraphmaxLogitsProcessor": "processor",
    "InterpolationLogitsProcessor": "baselines",
}

__all__ = [
    # decoders for model.generate()
    "ContextGraphmaxLogitsProcessor", "GraphmaxLogitsProcessor", "InterpolationLogitsProcessor",
    "KnnContextGraphmaxLogitsProcessor", "PaperGraphmaxLogitsProcessor",
    # the kNN datastore that KnnContextGraphmaxLogitsProcessor reads: build, index, load, and the tap on the head
    "Datastore", "HiddenStateTap", "build_datastore", "index_datastore", "load_datastore",
    # the context decoder's settings, and its reference q(· | context) (what interpolation mixes in, too)
    "ContextConfig", "ContextReference",
    # the values `divergence` takes, for sweeps and command lines
    "DIVERGENCES",
    # the paper's distribution: function, modules, the operator M they apply (build once, reuse across calls)
    "Graphmax", "LogGraphmax", "TransitionOperator", "graphmax", "log_graphmax",
    # the context decoder's solve on its own (any reference q)
    "solve_toward",
    # the certificates: duality gaps of any point, to check a solution independently of the solver
    "certificate", "certificate_toward",
    # what every solve returns beside the distribution (iterations, gap, convergence)
    "SolveInfo",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
