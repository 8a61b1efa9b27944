"""Engine-neutral serving: a request's graphmax arguments, the graphs a server serves, and one step over the rows of
many requests.

A request opts in with ``{"graphmax": {"graph": NAME, ...}}`` among its extra arguments (vLLM's
``SamplingParams.extra_args``), or flat, as vLLM's OpenAI-compatible server takes them (its ``vllm_xargs`` hold no
nested object): ``{"graphmax": NAME, "graphmax_lam": 2.0, ...}``. Besides ``graph``, it may name the
``decoder`` (``"context"`` or ``"paper"``; default: the one ``graphmax tune`` stored in the graph, else context) and
that decoder's settings, as ``graphmax generate`` takes them (e.g. ``"lam": 2.0``); anything else is refused. The
graph is a *name* among those the server serves (:class:`Graphs`), never a path: a remote client cannot make the
server open a file of its choosing.

Rows of requests that share a graph and settings are decoded in one call, each with its own context, length and λ
(``ContextGraphmaxLogitsProcessor.step_rows``): a request decodes as it does alone, whatever else is in the batch.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gm_graphs import GraphmaxError, list_graphs, load_graph
from gm_graphs.store.folders import check_name

from ..arguments import options
from ..decoders import kinds
from ..decoders.choice import DecoderChoice
from ..processor import ContextGraphmaxLogitsProcessor, GraphmaxLogitsProcessor

__all__ = ["ARGUMENT", "GRAPHS_VARIABLE", "Graphs", "Request", "Rows", "parse"]

ARGUMENT = "graphmax"  # the key of a request's extra arguments
FLAT = "graphmax_"  # the flat form's settings: graphmax_lam, graphmax_decoder, …
GRAPHS_VARIABLE = "GRAPHMAX_SERVE_GRAPHS"  # the graphs a server serves: names, comma-separated
log = logging.getLogger("graphmax.serving")


@dataclass(frozen=True)
class Request:
    """What one request asks of graphmax: the graph, the decoder kind (``None``: the graph's stored one) and the
    settings it overrides; ``lam`` apart, since the context decoder takes a λ per row.

    Example::

        >>> parse({"graphmax": {"graph": "amazon", "lam": 2.0, "order_weights": [0.8, 0.2]}})
        Request(graph='amazon', decoder=None, settings=(('order_weights', (0.8, 0.2)),), lam=2.0)
    """

    graph: str
    decoder: str | None = None
    settings: tuple[tuple[str, Any], ...] = ()
    lam: float | None = None

    def key(self, kind: str) -> tuple:
        """What decoders are shared by: the context decoder's rows each carry their λ, the paper decoder's do not."""
        return (self.graph, kind, self.settings, None if kind == "context" else self.lam)


def parse(extra_args: Any) -> Request | None:
    """The graphmax arguments of a request's extra arguments, their form checked; ``None`` when it asks for none.

    Raises:
        ValueError: one line naming the argument and the fix (a server answers it as a bad request).

    Example::

        >>> parse({"other": 1}) is None
        True
        >>> parse({"graphmax": "amazon", "graphmax_lam": 2})      # the flat form of vLLM's server
        Request(graph='amazon', decoder=None, settings=(), lam=2.0)
        >>> parse({"graphmax": {"graph": "../../etc"}})
        Traceback (most recent call last):
        ValueError: graphmax: "graph" must be the name of a graph the server serves, got '../../etc'
    """
    if extra_args is None or not isinstance(extra_args, Mapping):
        return None
    flat = {str(k)[len(FLAT):]: v for k, v in extra_args.items() if str(k).startswith(FLAT)}
    if ARGUMENT not in extra_args:
        if flat:
            raise ValueError(f"graphmax: {_show(FLAT + next(iter(flat)))} given without {_show(ARGUMENT)}; name the "
                             f'graph too, e.g. {{"{ARGUMENT}": "NAME", "{FLAT}lam": 2.0}}')
        return None
    args = extra_args[ARGUMENT]
    if isinstance(args, str):  # the flat form
        args = {"graph": args, **flat}
    elif not isinstance(args, Mapping):
        raise ValueError(f'graphmax: the "{ARGUMENT}" argument must be an object such as {{"graph": "NAME", '
                         f'"lam": 2.0}} or a graph name, got {_show(args)}')
    elif flat:
        raise ValueError(f'graphmax: give the settings inside "{ARGUMENT}" or as {FLAT}* arguments beside a graph '
                         f"name, not both")
    graph = args.get("graph")
    if not isinstance(graph, str):
        raise ValueError(f'graphmax: "graph" must name a graph the server serves, got {_show(graph)}')
    try:
        check_name(graph)
    except (GraphmaxError, TypeError, ValueError):
        raise ValueError(f'graphmax: "graph" must be the name of a graph the server serves, got {_show(graph)}') \
            from None
    decoder = args.get("decoder")
    served = kinds()
    if decoder is not None and decoder not in served:
        if decoder == "knn":
            raise ValueError("graphmax: the kNN decoder reads the model's hidden states, which a serving engine's "
                             "logits processors do not see; use decoder \"context\" or \"paper\"")
        raise ValueError(f'graphmax: "decoder" must be one of {", ".join(served)}, got {_show(decoder)}')
    known = {"graph", "decoder", *(_settings(decoder) if decoder else
                                   {name for k in served for name in _settings(k)})}
    unknown = sorted(str(k) for k in args if k not in known)
    if unknown:
        whose = f"the {decoder} decoder" if decoder else "graphmax"
        raise ValueError(f"graphmax: {_show(unknown[0])} is not an argument of {whose}; it takes graph, decoder and "
                         f"{', '.join(_settings(decoder or 'context'))}")
    lam = args.get("lam")
    if lam is not None and (isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam < float("inf")):
        raise ValueError(f'graphmax: "lam" must be a finite number >= 0, got {_show(lam)}')
    settings = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in args.items()
                            if k not in ("graph", "decoder", "lam")))
    return Request(graph, decoder, settings, None if lam is None else float(lam))


def _settings(kind: str) -> tuple[str, ...]:
    """The settings a request may give the decoder kind ``kind``: its settings' options."""
    return tuple(f.name for f in options(kinds()[kind].settings))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def served_names(variable: str | None = None) -> tuple[str, ...]:
    """The graphs a server serves: the names in ``$GRAPHMAX_SERVE_GRAPHS`` (comma-separated), else every graph under
    ``$GRAPHMAX_HOME/graphs``.

    Raises:
        ValueError: the variable names something that is not a graph name.
    """
    value = os.environ.get(GRAPHS_VARIABLE) if variable is None else variable
    if value is None or not value.strip():
        return tuple(list_graphs())
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    for name in names:
        try:
            check_name(name)
        except (GraphmaxError, TypeError, ValueError):
            raise ValueError(f"{GRAPHS_VARIABLE} names {name!r}, which is not a graph name; give names of graphs "
                             f"under $GRAPHMAX_HOME/graphs, comma-separated") from None
    return names


class Graphs:
    """The graphs a server serves, each loaded once (memory-mapped) and shared by every request that names it, and
    the decoders built from them, one per graph and settings.

    Args:
        names (sequence of ``str`` or ``None``, defaults to ``None``): the allow-list; ``None``:
            :func:`served_names`.

    Example::

        >>> Graphs(names=("amazon",)).decoder(Request("news"))
        Traceback (most recent call last):
        ValueError: graphmax: graph 'news' is not served here; this server serves amazon (GRAPHMAX_SERVE_GRAPHS)
    """

    def __init__(self, names: Sequence[str] | None = None):
        self.names = served_names() if names is None else tuple(names)
        self._graphs: dict[str, Any] = {}
        self._decoders: dict[tuple, GraphmaxLogitsProcessor] = {}

    def graph(self, name: str) -> Any:
        if name not in self.names:
            served = ", ".join(self.names) or "no graph"
            raise ValueError(f"graphmax: graph {name!r} is not served here; this server serves {served} "
                             f"({GRAPHS_VARIABLE})")
        if name not in self._graphs:
            try:
                self._graphs[name] = load_graph(name)
            except GraphmaxError as e:
                raise ValueError(f"graphmax: graph {name!r} cannot be served: {e}") from None
        return self._graphs[name]

    def decoder(self, request: Request) -> GraphmaxLogitsProcessor:
        """The decoder ``request`` asks for (``GraphmaxLogitsProcessor.from_graph``: the graph's stored choice with
        the request's settings over it), made once per graph and settings.

        Raises:
            ValueError: a graph not served, or settings the decoder refuses (one line).
        """
        graph = self.graph(request.graph)
        kind = request.decoder or DecoderChoice.stored_kind(graph) or "context"
        key = request.key(kind)
        if key not in self._decoders:
            settings = dict(request.settings)
            if kind != "context" and request.lam is not None:  # (the context decoder takes λ per row)
                settings["lam"] = request.lam
            try:
                self._decoders[key] = GraphmaxLogitsProcessor.from_graph(graph, decoder=kind, **settings)
            except (GraphmaxError, TypeError, ValueError) as e:
                raise ValueError(f"graphmax: {e}") from None
        return self._decoders[key]

    def warm(self, device: torch.device | str = "cpu") -> float:
        """Load every served graph and warm its default decoder on ``device`` (numba's kernels, a GPU's first
        calls), so that no request pays for it; returns the seconds it took."""
        seconds = 0.0
        for name in self.names:
            seconds += self.decoder(Request(name)).warmup(device).warmup_seconds
        return seconds


@dataclass
class Row:
    """One request's row: its decoder, its own λ, and its tokens (the prompt's, and the output as the engine
    appends to it; or, where an engine keeps the tokens itself, the last few of them and the row's ``length``)."""

    decoder: GraphmaxLogitsProcessor
    lam: float | None
    prompt: Sequence[int]
    output: Sequence[int] = field(default_factory=list)
    length: int | None = None  # the tokens the row has seen; None: its prompt's and output's

    @property
    def seen(self) -> int:
        return len(self.prompt) + len(self.output) if self.length is None else self.length

    def context(self, tail: int) -> list[int]:
        """The row's last ``tail`` tokens, oldest first, −1 before its first."""
        own = list(self.output[-tail:]) if tail else []
        if len(own) < tail and self.prompt:
            own = list(self.prompt[-(tail - len(own)):]) + own
        return [-1] * (tail - len(own)) + own


class Rows:
    """The rows of a batch that decode with graphmax, by their index in the batch, followed as requests join,
    leave and move; :meth:`apply` decodes them and leaves every other row as it was, bit for bit.

    Args:
        graphs (``Graphs``): the graphs served.

    Example::

        >>> import scipy.sparse as sp
        >>> graphs = Graphs(names=())
        >>> rows = Rows(graphs)
        >>> proc = ContextGraphmaxLogitsProcessor(sp.csr_matrix([[0, 5, 1], [2, 0, 3], [4, 0, 0]]))
        >>> rows.rows[1] = Row(proc, 2.0, [0, 2])
        >>> logits = torch.zeros(2, 3)
        >>> out = rows.apply(logits)
        >>> out[0].tolist(), round(float(out[1].exp().sum()), 6)    # row 0 asked for nothing
        ([0.0, 0.0, 0.0], 1.0)
    """

    def __init__(self, graphs: Graphs):
        self.graphs = graphs
        self.rows: dict[int, Row] = {}
        self._warned: set[str] = set()

    def add(self, index: int, request: Request | None, prompt: Sequence[int] | None, output: Sequence[int]) -> None:
        """Row ``index`` is now this request (``None``: one without graphmax)."""
        self.rows.pop(index, None)
        if request is not None:
            self.rows[index] = Row(self.graphs.decoder(request), request.lam, prompt or (), output)

    def remove(self, index: int) -> None:
        self.rows.pop(index, None)

    def move(self, source: int, target: int, swap: bool) -> None:
        """The request at ``source`` moves to ``target`` (``swap``: and the one there to ``source``)."""
        moving, there = self.rows.pop(source, None), self.rows.pop(target, None)
        if moving is not None:
            self.rows[target] = moving
        if swap and there is not None:
            self.rows[source] = there

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Each graphmax row of ``logits`` (B, V) replaced, in place, by its decoder's log-probabilities; rows of one
        decoder in one call, each with its own context, length and λ. A step that fails is logged once per message
        and leaves its rows as they were: one request never stops the engine serving the others."""
        groups: dict[int, list[int]] = defaultdict(list)
        for index, row in self.rows.items():
            if index < logits.shape[0]:
                groups[id(row.decoder)].append(index)
        for members in groups.values():
            members.sort()
            rows = [self.rows[i] for i in members]
            proc = rows[0].decoder
            where = torch.tensor(members, device=logits.device)
            try:
                out = self._step(proc, rows, logits[where])
            except Exception as e:  # noqa: BLE001 (any failure of a step: the engine goes on)
                message = f"graphmax: a step of {len(members)} row(s) failed and left them as plain decoding: " \
                          f"{type(e).__name__}: {e}"
                if message not in self._warned:
                    self._warned.add(message)
                    log.warning(message)
                continue
            logits[where] = out.to(logits.dtype)
        return logits

    @staticmethod
    def _step(proc: GraphmaxLogitsProcessor, rows: list[Row], scores: torch.Tensor) -> torch.Tensor:
        if not isinstance(proc, ContextGraphmaxLogitsProcessor):  # the paper's decoders read no context
            return proc(torch.zeros(len(rows), 1, dtype=torch.long, device=scores.device), scores)
        tail = proc.reference.tail
        contexts = torch.tensor([r.context(tail) for r in rows], dtype=torch.long, device=scores.device)
        lengths = [r.seen for r in rows]
        lams = None if all(r.lam is None for r in rows) else [proc.config.lam if r.lam is None else r.lam
                                                              for r in rows]
        return proc.step_rows(contexts, lengths, scores, lams)
