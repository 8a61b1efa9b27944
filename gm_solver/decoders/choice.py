"""The decoder a graph stores: one record, :class:`DecoderChoice`, written by ``graphmax tune`` and read by
:func:`gm_solver.from_graph`.

A graph's manifest keeps the record as JSON it does not read (``Graph.set_decoder``); this module owns its keys and
checks every one when it reads them back: ``"mode"`` names the decoder kind (``gm_solver.decoders``), the other keys
are the fields of that kind's settings, which validate themselves, so a stored value is held to exactly what the
decoder would accept; ``"knn"``, for a kind that takes a datastore, holds the settings tuned with one.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from gm_graphs.errors import GraphFormatError

from ..arguments import finite_nonnegative, finite_positive, integer, real
from .context import ContextConfig, KnnConfig
from .registry import DecoderKind, kind, kind_of, kinds

_SHA256 = re.compile(r"[0-9a-f]{64}")
KIND_KEY = "mode"  # the stored record's key naming the kind (the format's, since the first stored choices)


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
        return {**settings_json(self.config), "lam": self.lam, "datastore_sha256": self.datastore_sha256, **extra}

    @classmethod
    def from_json(cls, d: Any) -> KnnChoice:
        if not isinstance(d, dict):
            raise ValueError(f"`knn` must be an object, got {d!r}")
        own = {"lam", "datastore_sha256", "datastore_keys", "perplexity"}
        config = settings_from_json(KnnConfig, {k: v for k, v in d.items() if k not in own}, "knn")
        missing = [k for k in ("lam", "datastore_sha256") if k not in d]
        if missing:
            raise ValueError(f"`knn` has no {missing}; store it again with `graphmax tune --datastore`")
        return cls(config, d["lam"], d["datastore_sha256"], d.get("datastore_keys"), d.get("perplexity"))


@dataclass(frozen=True)
class DecoderChoice:
    """The decoder a graph stores: ``graphmax tune`` writes one (:meth:`to_json` → ``Graph.set_decoder``) and
    :func:`gm_solver.from_graph` builds the decoder it names (:meth:`of`).

    Args:
        settings (defaults to ``ContextConfig()``): the decoder's settings, an instance of a registered kind's
            settings class (``ContextConfig``, ``PaperConfig``, …), which names the kind.
        knn (``KnnChoice`` or ``None``): for a kind that takes a datastore, the settings tuned with one, used when
            the decoder is given that datastore.

    Raises:
        ValueError: settings of no registered kind, or ``knn`` for a kind that takes no datastore.

    Example::

        >>> choice = DecoderChoice(ContextConfig(lam=0.8, source={"tuned": True}))
        >>> stored = choice.to_json()
        >>> stored["mode"], stored["lam"], stored["source"], choice.kind.name
        ('context', 0.8, {'tuned': True}, 'context')
        >>> DecoderChoice.from_json(stored) == choice
        True
        >>> DecoderChoice.from_json({"mode": "paper", "lam": -1})
        Traceback (most recent call last):
        gm_graphs.errors.GraphFormatError: the graph's stored decoder: `lam` must be a finite float >= 0 (0 gives \
softmax), got -1
    """

    settings: Any = field(default_factory=ContextConfig)
    knn: KnnChoice | None = None

    def __post_init__(self):
        found = kind_of(self.settings)  # a TypeError naming the settings' type otherwise
        if self.knn is not None and (found.datastore_settings is None or not isinstance(self.knn, KnnChoice)):
            raise ValueError(f"`knn` must be a KnnChoice of a decoder that takes a datastore, got {self.knn!r} "
                             f"with decoder {found.name!r}")

    @property
    def kind(self) -> DecoderKind:
        """The kind of decoder the choice names."""
        return kind_of(self.settings)

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
        return cls(config, KnnChoice(KnnConfig(**knn), lam, datastore.keys_sha256, len(datastore), perplexity))

    @staticmethod
    def stored_kind(graph: Any) -> str | None:
        """The name of the kind of decoder ``graph`` stores, read before the record is checked (an override may mend
        a bad stored value); ``None`` when it stores none (or is a matrix).

        Example::

            >>> DecoderChoice.stored_kind(type("G", (), {"decoder": {"mode": "paper", "lam": 2.0}})())
            'paper'
        """
        stored = getattr(graph, "decoder", None)
        if not stored:
            return None
        name = stored.get(KIND_KEY, "context") if isinstance(stored, dict) else "context"
        return name if isinstance(name, str) else "context"

    @classmethod
    def of(cls, graph: Any) -> DecoderChoice:
        """The choice ``graph`` stores (``graph.decoder``), checked; the context decoder's defaults when it stores
        none (or is a matrix)."""
        stored = getattr(graph, "decoder", None)
        return cls() if not stored else cls.from_json(stored)

    def to_json(self) -> dict:
        """The record as the manifest keeps it: plain JSON types, the keys ``from_json`` reads."""
        return {KIND_KEY: self.kind.name, **settings_json(self.settings),
                **({"knn": self.knn.to_json()} if self.knn else {})}

    @classmethod
    def from_json(cls, d: Any) -> DecoderChoice:
        """The record from the manifest's JSON, every key, type and range checked (by the settings' own classes).

        Raises:
            GraphFormatError: one line naming the key and its value.
        """
        try:
            if not isinstance(d, dict):
                raise ValueError(f"it must be an object, got {d!r}")
            name = d.get(KIND_KEY, "context")
            try:
                found = kind(name)
            except ValueError:
                raise ValueError(f"`{KIND_KEY}` must be one of {tuple(kinds())}, got "
                                 f"{name!r}") from None
            rest = {k: v for k, v in d.items() if k not in (KIND_KEY, "knn")}
            if "knn" in d and found.datastore_settings is None:
                rest["knn"] = d["knn"]  # refused below as a key no decoder of this kind reads
            settings = settings_from_json(found.settings, rest, "decoder")
            knn = KnnChoice.from_json(d["knn"]) if "knn" in d else None
            return cls(settings, knn)
        except (TypeError, ValueError) as e:
            raise GraphFormatError(f"the graph's stored decoder: {e}") from None


def settings_json(settings: Any) -> dict:
    """A kind's settings as stored: every field, tuples as lists."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(settings).items()}


def settings_from_json(cls: type, d: dict, where: str) -> Any:
    """The settings ``cls`` of a stored record ``d``: a key that is no field is refused, and so is a missing one
    of those ``cls.REQUIRED`` lists (the rest take their defaults); the values are checked by ``cls`` itself."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names), key=str)
    if unknown:
        raise ValueError(f"`{where}` has keys no decoder reads: {unknown}; store it again with `graphmax tune`")
    missing = [k for k in getattr(cls, "REQUIRED", ()) if k not in d]
    if missing:
        again = "graphmax tune --datastore" if where == "knn" else "graphmax tune"
        raise ValueError(f"`{where}` has no {missing}; store it again with `{again}`")
    for f in dataclasses.fields(cls):  # a list stored for a tuple field (JSON has no tuples; an override may be one)
        if f.name in d and isinstance(f.default, tuple):
            if not isinstance(d[f.name], (list, tuple)):
                raise ValueError(f"`{f.name}` must be a list of numbers, got {d[f.name]!r}")
            d = {**d, f.name: tuple(d[f.name])}
    return cls(**d)
