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

Every name is loaded on first use (PEP 562): ``import gm_solver`` imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

# name → the module that defines it, imported on first access: ``import gm_solver`` loads neither torch nor
# transformers, so that ``graphmax``'s parser reads the decoder kinds (gm_solver.decoders) before they load
_LAZY = {
    "GraphmaxLogitsProcessor": "processor",
    "PaperGraphmaxLogitsProcessor": "processor",
    "PaperAlgorithm1LogitsProcessor": "processor",
    "ContextGraphmaxLogitsProcessor": "processor",
    "KnnContextGraphmaxLogitsProcessor": "processor",
    "MarginalBiasLogitsProcessor": "processor",
    "InterpolationLogitsProcessor": "baselines",
    "certificate_toward": "backends.eager",
    "DecoderChoice": "decoders.choice",
    "ContextReference": "context",
    "ContextConfig": "decoders.context",
    "PaperConfig": "decoders.paper",
    "DecoderKind": "decoders.registry",
    "register_decoder": "decoders.registry",
    "Datastore": "datastore",
    "HiddenStateTap": "datastore",
    "build_datastore": "datastore",
    "index_datastore": "datastore",
    "load_datastore": "datastore",
    "solve_toward": "divergences",
    "graphmax": "distribution",
    "log_graphmax": "distribution",
    "certificate": "objective",
}

__all__ = [
    # decoders for model.generate(): the factory (GraphmaxLogitsProcessor.from_graph) and each decoder
    "ContextGraphmaxLogitsProcessor", "GraphmaxLogitsProcessor", "InterpolationLogitsProcessor",
    "KnnContextGraphmaxLogitsProcessor", "MarginalBiasLogitsProcessor", "PaperAlgorithm1LogitsProcessor",
    "PaperGraphmaxLogitsProcessor",
    # the choice a graph stores, the decoders' settings inside it, and the table of decoder kinds
    "ContextConfig", "DecoderChoice", "DecoderKind", "PaperConfig", "register_decoder",
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
