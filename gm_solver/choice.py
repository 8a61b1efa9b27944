"""The decoder a graph stores: one record, :class:`DecoderChoice`, written by ``graphmax tune`` and read by
:func:`gm_solver.from_graph`.

A graph's manifest keeps the record as JSON it does not read (``Graph.set_decoder``); this module owns its keys and
checks every one when it reads them back. The settings inside it are the decoders' own settings objects, which
validate themselves: :class:`~gm_solver.ContextConfig` (context-aware graphmax), :class:`PaperConfig` (the paper's
decoders) and :class:`KnnConfig` (the kNN datastore's share, neighbours, temperature and marginal bias), so a stored
value is held to exactly what the decoder would accept.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from gm_graphs.errors import GraphFormatError

from .checks import finite_nonnegative, finite_positive, integer, real
from .context_config import ContextConfig
from .datastore import MAX_MARGINAL_WEIGHT

MODES = ("context", "paper")
PAPER_SOLVERS = ("mirror", "paper")  # the stored "solver" of a paper choice: certified, or the paper's Algorithm 1
_CONTEXT_KEYS = tuple(f.name for f in dataclasses.fields(ContextConfig))
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PaperConfig:
    """The settings of the paper's decoders (λ‖x − Mx‖²), each checked here.

    Args:
        lam (``float``, defaults to 1.0): λ ≥ 0, finite; 0 gives softmax.
        tol (``float``, defaults to 1e-6): the certified duality gap at which each step's solve stops.
        max_iter (``int``, defaults to 200): the iteration budget per step.
        algorithm1 (``bool``, defaults to ``False``): the paper's Algorithm 1 as printed (T = 20 projected gradient
            steps, no convergence) instead of the certified solve; ``tol`` and ``max_iter`` then have no effect and
            are refused away from their defaults.

    Raises:
        ValueError: a setting out of its range, naming it and its value.

    Example::

        >>> PaperConfig(lam=2)
        PaperConfig(lam=2.0, tol=1e-06, max_iter=200, algorithm1=False)
        >>> PaperConfig(lam=1.0, max_iter=50, algorithm1=True)
        Traceback (most recent call last):
        ValueError: `max_iter`=50 has no effect with the paper's Algorithm 1 (its own T = 20 steps and stopping rule)
    """

    lam: float = 1.0
    tol: float = 1e-6
    max_iter: int = 200
    algorithm1: bool = False

    def __post_init__(self):
        object.__setattr__(self, "lam", real("lam", self.lam, "a finite float >= 0 (0 gives softmax)",
                                             finite_nonnegative))
        object.__setattr__(self, "tol", real("tol", self.tol, "a finite float > 0", finite_positive))
        object.__setattr__(self, "max_iter", integer("max_iter", self.max_iter, "an int >= 1", lambda v: v >= 1))
        if not isinstance(self.algorithm1, bool):
            raise ValueError(f"`algorithm1` must be a bool, got {self.algorithm1!r}")
        if self.algorithm1:
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                if f.name in ("tol", "max_iter") and value != f.default:
                    raise ValueError(f"`{f.name}`={value!r} has no effect with the paper's Algorithm 1 (its own "
                                     f"T = 20 steps and stopping rule)")


@dataclass(frozen=True)
class KnnConfig:
    """The kNN decoder's own settings (``KnnContextGraphmaxLogitsProcessor``), each checked here.

    Args:
        knn_weight (``float``, defaults to 0.5): β in (0, 1], the share of p_knn in the reference.
        knn_k (``int``, defaults to 1024): the neighbours read, ≥ 1.
        knn_temperature (``float``, defaults to 50.0): T > 0, finite, of softmax(−d/T) over squared distances.
        marginal_weight (``float``, defaults to 0.0): w in [0, 10], the weight of the datastore's marginal bias
            (``MarginalBiasLogitsProcessor``) on the scores; 0: none.

    Raises:
        ValueError: a setting out of its range, naming it and its value.

    Example::

        >>> KnnConfig(knn_weight=0.35, knn_temperature=100)
        KnnConfig(knn_weight=0.35, knn_k=1024, knn_temperature=100.0, marginal_weight=0.0)
    """

    knn_weight: float = 0.5
    knn_k: int = 1024
    knn_temperature: float = 50.0
    marginal_weight: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "knn_weight", real(
            "knn_weight", self.knn_weight, "a float in (0, 1] (the share of p_knn in q; for the marginal bias alone "
            "put MarginalBiasLogitsProcessor before ContextGraphmaxLogitsProcessor)", lambda v: 0 < v <= 1))
        object.__setattr__(self, "knn_k", integer("knn_k", self.knn_k, "an int >= 1", lambda v: v >= 1))
        object.__setattr__(self, "knn_temperature", real("knn_temperature", self.knn_temperature,
                                                         "a finite float > 0", finite_positive))
        object.__setattr__(self, "marginal_weight", real(
            "marginal_weight", self.marginal_weight, f"a float in [0, {MAX_MARGINAL_WEIGHT:g}] (0: no marginal bias)",
            lambda v: 0 <= v <= MAX_MARGINAL_WEIGHT))


@dataclass(frozen=True)
class KnnChoice:
    """What ``graphmax tune --datastore`` chose with one datastore: the kNN settings, λ tuned again with them, and
    what identifies the datastore (its keys' SHA-256) and records the choice (its size, the held-out perplexity)."""

    config: KnnConfig
    lam: float
    datastore_sha256: str
    datastore_keys: int | None = None
    perplexity: float | None = None

    def __post_init__(self):
        if not isinstance(self.config, KnnConfig):
            raise ValueError(f"`config` must be a KnnConfig, got {type(self.config).__name__}")
        object.__setattr__(self, "lam", real("lam", self.lam, "a finite float >= 0 (0 gives softmax)",
                                             finite_nonnegative))
        if not (isinstance(self.datastore_sha256, str) and _SHA256.fullmatch(self.datastore_sha256)):
            raise ValueError(f"`datastore_sha256` must be 64 lowercase hex digits, got {self.datastore_sha256!r}")
        if self.datastore_keys is not None:
            integer("datastore_keys", self.datastore_keys, "an int >= 1", lambda v: v >= 1)
        if self.perplexity is not None:
            real("perplexity", self.perplexity, "a finite float > 0", finite_positive)

    def to_json(self) -> dict:
        extra = {k: v for k, v in (("datastore_keys", self.datastore_keys), ("perplexity", self.perplexity))
                 if v is not None}
        return {**dataclasses.asdict(self.config), "lam": self.lam, "datastore_sha256": self.datastore_sha256,
                **extra}

    @classmethod
    def from_json(cls, d: Any) -> KnnChoice:
        if not isinstance(d, dict):
            raise ValueError(f"`knn` must be an object, got {d!r}")
        known = {f.name for f in dataclasses.fields(KnnConfig)} | {"lam", "datastore_sha256", "datastore_keys",
                                                                   "perplexity"}
        _refuse_unknown(d, known, "knn")
        missing = [k for k in (*(f.name for f in dataclasses.fields(KnnConfig)), "lam", "datastore_sha256")
                   if k not in d]
        if missing:
            raise ValueError(f"`knn` has no {missing}; store it again with `graphmax tune --datastore`")
        config = KnnConfig(**{f.name: d[f.name] for f in dataclasses.fields(KnnConfig)})
        return cls(config, d["lam"], d["datastore_sha256"], d.get("datastore_keys"), d.get("perplexity"))


@dataclass(frozen=True)
class DecoderChoice:
    """The decoder a graph stores: ``graphmax tune`` writes one (:meth:`to_json` → ``Graph.set_decoder``) and
    :func:`gm_solver.from_graph` builds the decoder it names (:meth:`of`).

    Args:
        mode (``str``, defaults to ``"context"``): ``"context"`` (context-aware graphmax) or ``"paper"``.
        config (``ContextConfig`` or ``PaperConfig``, defaults to ``ContextConfig()``): the decoder's settings, of
            the mode's type.
        knn (``KnnChoice`` or ``None``): with mode ``"context"``, the settings tuned with a kNN datastore, used
            when the decoder is given that datastore.

    Raises:
        ValueError: an argument of the wrong type, or ``knn`` with the paper's mode.

    Example::

        >>> choice = DecoderChoice(config=ContextConfig(lam=0.8, source={"tuned": True}))
        >>> stored = choice.to_json()
        >>> stored["mode"], stored["lam"], stored["source"]
        ('context', 0.8, {'tuned': True})
        >>> DecoderChoice.from_json(stored) == choice
        True
        >>> DecoderChoice.from_json({"mode": "paper", "lam": -1})
        Traceback (most recent call last):
        gm_graphs.errors.GraphFormatError: the graph's stored decoder: `lam` must be a finite float >= 0 (0 gives \
softmax), got -1
    """

    mode: str = "context"
    config: ContextConfig | PaperConfig = field(default_factory=ContextConfig)
    knn: KnnChoice | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {self.mode!r}")
        kind = ContextConfig if self.mode == "context" else PaperConfig
        if not isinstance(self.config, kind):
            raise ValueError(f"`config` of mode {self.mode!r} must be a {kind.__name__}, got "
                             f"{type(self.config).__name__}")
        if self.knn is not None and (self.mode != "context" or not isinstance(self.knn, KnnChoice)):
            raise ValueError(f"`knn` must be a KnnChoice of mode 'context', got {self.knn!r} with mode {self.mode!r}")

    @classmethod
    def with_knn(cls, config: ContextConfig, knn: dict, lam: float, datastore: Any,
                 perplexity: float | None = None) -> DecoderChoice:
        """The context choice ``config`` with kNN settings tuned on ``datastore`` (a ``Datastore`` loaded from its
        folder, recognised later by its keys' SHA-256): ``knn`` the ``KnnConfig`` fields, ``lam`` λ tuned with them,
        ``perplexity`` the held-out perplexity they reached.

        Example::

            >>> import tempfile, numpy as np; from pathlib import Path
            >>> from gm_graphs.format.datastore_files import write_datastore
            >>> from gm_solver import load_datastore
            >>> tok = {"name": "t", "vocab_size": 3, "vocab_sha256": "0" * 64}
            >>> store = load_datastore(write_datastore(Path(tempfile.mkdtemp()) / "ds", [(np.eye(3, 4), np.arange(3))],
            ...     dim=4, tokenizer=tok, model="m", model_sha256="1" * 64, positions=8, documents=1))
            >>> choice = DecoderChoice.with_knn(ContextConfig(), {"knn_weight": 0.35}, 1.5, store)
            >>> choice.knn.config.knn_weight, choice.to_json()["knn"]["datastore_keys"]
            (0.35, 3)
        """
        return cls(config=config, knn=KnnChoice(KnnConfig(**knn), lam, datastore.keys_sha256, len(datastore),
                                                perplexity))

    @staticmethod
    def stored_mode(graph: Any) -> str | None:
        """The kind of decoder ``graph`` stores, ``"context"`` or ``"paper"``, read before the record is checked
        (an override may mend a bad stored value); ``None`` when it stores none (or is a matrix).

        Example::

            >>> DecoderChoice.stored_mode(type("G", (), {"decoder": {"mode": "paper", "lam": 2.0}})())
            'paper'
        """
        stored = getattr(graph, "decoder", None)
        if not stored:
            return None
        return "paper" if isinstance(stored, dict) and stored.get("mode") == "paper" else "context"

    @classmethod
    def of(cls, graph: Any) -> DecoderChoice:
        """The choice ``graph`` stores (``graph.decoder``), checked; the context decoder's defaults when it stores
        none (or is a matrix)."""
        stored = getattr(graph, "decoder", None)
        return cls() if not stored else cls.from_json(stored)

    def to_json(self) -> dict:
        """The record as the manifest keeps it: plain JSON types, the keys ``from_json`` reads."""
        if self.mode == "paper":
            c = self.config
            return {"mode": "paper", "lam": c.lam, "tol": c.tol, "max_iter": c.max_iter,
                    "solver": PAPER_SOLVERS[c.algorithm1]}
        return {"mode": "context", **self.config.to_dict(), **({"knn": self.knn.to_json()} if self.knn else {})}

    @classmethod
    def from_json(cls, d: Any) -> DecoderChoice:
        """The record from the manifest's JSON, every key, type and range checked (by the settings' own classes).

        Raises:
            GraphFormatError: one line naming the key and its value.
        """
        try:
            if not isinstance(d, dict):
                raise ValueError(f"it must be an object, got {d!r}")
            mode = d.get("mode", "context")
            if mode == "paper":
                _refuse_unknown(d, {"mode", "lam", "tol", "max_iter", "solver"}, "decoder")
                solver = d.get("solver", "mirror")
                if solver not in PAPER_SOLVERS:
                    raise ValueError(f"`solver` must be one of {PAPER_SOLVERS}, got {solver!r}")
                settings = {k: d[k] for k in ("lam", "tol", "max_iter") if k in d}
                return cls("paper", PaperConfig(**settings, algorithm1=solver == "paper"))
            if mode != "context":
                raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
            _refuse_unknown(d, {"mode", "knn", *_CONTEXT_KEYS}, "decoder")
            knn = KnnChoice.from_json(d["knn"]) if "knn" in d else None
            return cls("context", ContextConfig(**_context_fields(d)), knn)
        except (TypeError, ValueError) as e:
            raise GraphFormatError(f"the graph's stored decoder: {e}") from None


def _context_fields(d: dict) -> dict:
    """The ContextConfig fields of a stored context choice: every one ``to_json`` writes."""
    missing = [k for k in _CONTEXT_KEYS if k not in d]
    if missing:
        raise ValueError(f"`decoder` has no {missing}; store it again with `graphmax tune`")
    if not isinstance(d["order_weights"], (list, tuple)):
        raise ValueError(f"`order_weights` must be a list of numbers, got {d['order_weights']!r}")
    return {k: d[k] for k in _CONTEXT_KEYS}


def _refuse_unknown(d: dict, known: set, where: str) -> None:
    unknown = sorted(set(d) - known, key=str)
    if unknown:
        raise ValueError(f"`{where}` has keys no decoder reads: {unknown}; store it again with `graphmax tune`")
