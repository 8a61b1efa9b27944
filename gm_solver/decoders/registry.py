"""The table of decoder kinds: one :class:`DecoderKind` record per kind, registered once, read by everything that
names a decoder (``GraphmaxLogitsProcessor.from_graph``, the choice a graph stores, ``graphmax generate
--decoder``, the demo, the eval roster and the serving plug-ins).

A kind's record names its settings (a frozen dataclass whose fields are at once the stored keys, the command-line
options and the ``repr``), its step (the logits processor, imported when first built, since it imports torch),
its label and what else it reads. graphmax's own kinds are in this package (``context``, ``paper``); a package of
yours adds one with :func:`register_decoder`, or by an entry point in the group ``graphmax.decoders`` naming its record.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any

ENTRY_POINTS = "graphmax.decoders"  # the entry-point group a package registers its kinds in
_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")
_KINDS: dict[str, DecoderKind] = {}
_loaded = {"entry points": False}


@dataclass(frozen=True)
class DecoderKind:
    """One kind of decoder: what names it, what it is set with, what decodes, and what it says of itself.

    Args:
        name (``str``): what ``--decoder``, ``from_graph(decoder=...)`` and the stored choice's ``"mode"`` call it:
            lowercase letters, digits and dashes.
        settings (``type``): a frozen dataclass whose fields are the kind's settings, each checked by the class once;
            the fields declared with ``gm_solver.arguments.option`` are ``graphmax generate``'s options too. Its
            ``REQUIRED`` class attribute (a tuple of field names; defaults to none) lists the keys a stored choice
            must hold (a record missing one is refused rather than read with today's defaults).
        step (``str``): ``"module:Class"``, the logits processor; the class has a ``from_choice(graph, choice,
            **resources)`` classmethod (``gm_solver.processor.GraphmaxLogitsProcessor``'s subclasses do).
        label (``str``): what people read for it (``"context graphmax"``).
        graph_settings (``type`` or ``None``): a dataclass of ``load_graph``'s arguments that choose which operator
            of the graph the kind reads (the paper's Ãᵏ or a mixture); ``None``: the graph as loaded.
        datastore_settings (``type`` or ``None``): the dataclass of the kNN settings the kind takes with a datastore
            (``KnnConfig``); ``None``: it takes no datastore.
        kernels (``tuple[str, ...]``): the numba kernels its step calls first (``gm_solver.backends.ENTRY_KERNELS``'s
            names), which a first run may compile in the background.

    Example::

        >>> @dataclasses.dataclass(frozen=True)
        ... class Plain:
        ...     pass
        >>> DecoderKind("plain", Plain, "transformers:LogitsProcessor", "plain").name
        'plain'
        >>> DecoderKind("Plain!", Plain, "m:C", "plain")
        Traceback (most recent call last):
        ValueError: `name` must be lowercase letters, digits and dashes (at most 32, a letter first), got 'Plain!'
    """

    name: str
    settings: type
    step: str
    label: str
    graph_settings: type | None = None
    datastore_settings: type | None = None
    kernels: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"`name` must be lowercase letters, digits and dashes (at most 32, a letter first), "
                             f"got {self.name!r}")
        for part in ("settings", "graph_settings", "datastore_settings"):
            value = getattr(self, part)
            if (value is not None or part == "settings") and not (
                    isinstance(value, type) and dataclasses.is_dataclass(value)):
                raise ValueError(f"`{part}` of decoder {self.name!r} must be a dataclass, got {value!r}")
        if not isinstance(self.step, str) or not re.fullmatch(r"[\w.]+:\w+", self.step):
            raise ValueError(f"`step` of decoder {self.name!r} must be 'module:Class', got {self.step!r}")

    @property
    def required(self) -> tuple[str, ...]:
        """The keys a stored choice of this kind must hold."""
        return tuple(getattr(self.settings, "REQUIRED", ()))

    def step_class(self) -> type:
        """The logits processor's class, imported now (it imports torch)."""
        module, _, name = self.step.partition(":")
        return getattr(importlib.import_module(module), name)


def register_decoder(kind: DecoderKind, *, replace: bool = False) -> DecoderKind:
    """Add ``kind`` to the table of decoder kinds, where ``from_graph``, ``graphmax generate --decoder``, the stored
    choice, the eval and the serving plug-ins find it by its name.

    Args:
        kind (``DecoderKind``): the record.
        replace (``bool``, defaults to ``False``): replace a kind of the same name (else refused).

    Returns:
        ``kind``, so that a module may write ``KIND = register_decoder(DecoderKind(...))``.

    Example::

        >>> import dataclasses
        >>> @dataclasses.dataclass(frozen=True)
        ... class Shift:
        ...     by: float = 1.0
        >>> register_decoder(DecoderKind("shift", Shift, "mypackage.shift:ShiftLogitsProcessor", "shifted")).name
        'shift'
        >>> "shift" in kinds(); unregister_decoder("shift")
        True
    """
    if not isinstance(kind, DecoderKind):
        raise TypeError(f"`kind` must be a DecoderKind, got {type(kind).__name__}")
    if kind.name in _KINDS and not replace and _KINDS[kind.name] != kind:
        raise ValueError(f"a decoder kind named {kind.name!r} is registered already; choose another name")
    _KINDS[kind.name] = kind
    return kind


def unregister_decoder(name: str) -> None:
    """Remove the kind ``name`` (one a test or a package added); graphmax's own stay."""
    if name in BUILT_IN:
        raise ValueError(f"{name!r} is one of graphmax's own decoder kinds and stays registered")
    _KINDS.pop(name, None)


def kinds() -> dict[str, DecoderKind]:
    """Every registered kind by name, graphmax's first, then those of entry points and :func:`register_decoder`."""
    _load_entry_points()
    return dict(_KINDS)


def kind(name: str) -> DecoderKind:
    """The kind named ``name``.

    Raises:
        ValueError: no kind of that name, in one line listing those there are.
    """
    found = kinds().get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"no decoder kind is named {name!r}; the kinds are {', '.join(map(repr, kinds()))}")
    return found


def kind_of(settings: Any) -> DecoderKind:
    """The kind whose settings ``settings`` is an instance of."""
    for k in kinds().values():
        if type(settings) is k.settings:
            return k
    raise TypeError(f"`settings` must be the settings of a registered decoder kind, got {type(settings).__name__}")


BUILT_IN = ("context", "paper")  # graphmax's own kinds (this package's context and paper modules)


def _load_entry_points() -> None:
    """Register the kinds packages declare in :data:`ENTRY_POINTS`, once; a package whose entry point fails to load
    or names no ``DecoderKind`` is skipped with one line on stderr, so that it breaks no command."""
    if _loaded["entry points"]:
        return
    _loaded["entry points"] = True
    try:
        points = metadata.entry_points(group=ENTRY_POINTS)
    except Exception:  # noqa: BLE001 - a broken installed distribution's metadata must not break graphmax
        return
    for point in points:
        try:
            register_decoder(point.load())
        except Exception as e:  # noqa: BLE001 - another package's error, reported and skipped
            print(f"graphmax: skipped the decoder kind of entry point {point.name!r} ({point.value}): "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
