"""gm_solver: the graphmax distribution in torch, and a transformers logits processor that decodes with it."""

from .baselines import InterpolationLogitsProcessor
from .context import ContextConfig, ContextReference
from .divergences import DIVERGENCES, certificate_toward, solve_toward
from .graphmax import Graphmax, LogGraphmax, get_operator, graphmax, log_graphmax
from .processor import GraphmaxLogitsProcessor
from .objective import certificate, dual, primal
from .operator import TransitionOperator
from .solvers import SolveInfo, project_simplex

__all__ = [
    "ContextConfig", "ContextReference", "DIVERGENCES", "certificate_toward", "solve_toward",
    "Graphmax", "GraphmaxLogitsProcessor", "InterpolationLogitsProcessor", "LogGraphmax", "SolveInfo", "TransitionOperator", "certificate", "dual", "get_operator",
    "graphmax", "log_graphmax", "primal", "project_simplex",
]
