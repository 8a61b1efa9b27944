"""The steps of graphmax's decoder kinds as ``transformers`` logits processors: the paper's, and the context-aware
one (with a kNN datastore too). Each kind's settings and record are in ``gm_solver.decoders``.

One class per decoder, as in ``transformers.generation.logits_process``: each validates exactly its own
arguments in ``__init__`` (the message names the argument and its value) and refuses an argument that would
have no effect. :class:`GraphmaxLogitsProcessor` is their base; its :meth:`~GraphmaxLogitsProcessor.from_graph`,
the one factory, builds any registered kind, by default the decoder ``graphmax tune`` stored in a graph.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import asdict, fields
from typing import Any

import scipy.sparse as sp
import torch
from transformers import LogitsProcessor

from . import backends
from .arguments import integer, real
from .context import ContextReference
from .datastore import Datastore, HiddenStateTap
from .decoders import DecoderKind, kind, kind_of, kinds
from .decoders.choice import DecoderChoice
from .decoders.context import DIVERGENCES, MAX_MARGINAL_WEIGHT, SMOOTHINGS, ContextConfig, KnnConfig
from .decoders.paper import PaperConfig
from .distribution import get_operator, log_graphmax
from .operator import TransitionOperator
from .padding import LeftPadding
from .solve_info import SolveInfo


class GraphmaxLogitsProcessor(LeftPadding, LogitsProcessor):
    r"""The base of graphmax's decoders (every registered kind's step); :meth:`from_graph` returns the one
    ``graphmax tune`` stored in a graph. graphmax's own:

    - :class:`PaperGraphmaxLogitsProcessor`: the paper's context-free λ‖x − Ãx‖² (Liu & Yin, JAIR 2023).
    - :class:`ContextGraphmaxLogitsProcessor`: context-aware graphmax, which leans toward the corpus'
      next-token distribution for the current context.

    Both replace each step's scores by log-probabilities (the solution of a convex problem over the simplex,
    certified by its duality gap) and work with greedy search, sampling (put temperature/top-k/top-p warpers
    after them), beam search (graphmax is invariant to the per-row shift of log-softmaxed scores), decoder-only
    and encoder-decoder models, batches and left padding. ``-inf`` scores stay ``-inf``; NaN, ``+inf`` and a row
    with no finite score are refused. Scores wider than the graph (a head padded past the tokenizer, as Qwen's is)
    get ``-inf`` in the extra columns, ids the tokenizer never emits; narrower ones are refused. After each call
    ``last_info`` holds the step's :class:`SolveInfo` (per-row iterations and certified gap). The first step of a
    process compiles numba's kernels (or loads them from numba's disk cache): call :meth:`warmup` before timing
    anything. Calling this base class directly raises a TypeError.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> counts = sp.csr_matrix([[0, 3, 1], [2, 0, 0], [0, 1, 0]], dtype=float)
        >>> proc = GraphmaxLogitsProcessor.from_graph(counts)    # a graph never tuned: the context decoder
        >>> isinstance(proc, ContextGraphmaxLogitsProcessor), isinstance(proc, GraphmaxLogitsProcessor)
        (True, True)
        >>> logp = proc(torch.tensor([[1, 0]]), torch.zeros(1, 3))
        >>> round(float(logp.exp().sum()), 6)
        1.0
    """

    last_info: SolveInfo | None = None
    origin: str | None = None  # from_graph's: "stored" (the graph's stored choice), "defaults" or "given"
    kind: DecoderKind | None = None  # from_graph's: the kind of decoder it built (its name, its label)
    warmup_seconds: float | None = None  # what the last warmup() took

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is GraphmaxLogitsProcessor:
            raise TypeError("GraphmaxLogitsProcessor is the base of the two graphmax decoders and is not constructed "
                            "itself: use PaperGraphmaxLogitsProcessor(graph, lam=...) (the paper's λ‖x − Ãx‖²), "
                            "ContextGraphmaxLogitsProcessor(graph, ...) (context-aware), or "
                            "GraphmaxLogitsProcessor.from_graph(graph) (the decoder `graphmax tune` stored)")
        return super().__new__(cls)

    @classmethod
    def from_graph(cls, graph: Any, *, decoder: str | None = None, settings: Any = None,
                   **overrides: Any) -> GraphmaxLogitsProcessor:
        """The one factory of graphmax's decoders: the decoder the graph's stored choice names (``graphmax tune``;
        ``gm_solver.DecoderChoice``), or the kind ``decoder`` names, or the one ``settings`` are of. Every kind
        registered in ``gm_solver.decoders`` is built here, the CLI's, the eval's and the serving plug-ins' alike.

        The stored choice is used when it is of the kind asked for (or none is asked for); another kind starts from
        its settings' defaults. ``proc.origin`` then says which: ``"stored"``, ``"defaults"`` or ``"given"``
        (``settings``).

        Args:
            graph (``gm_graphs.Graph`` or scipy sparse matrix): the graph; a scipy matrix stores no choice.
            decoder (``str`` or ``None``, defaults to ``None``): a registered kind's name (``"context"``,
                ``"paper"``, …); ``None``: the kind of ``settings``, else the stored kind, else ``"context"``.
            settings (defaults to ``None``): the settings of a kind (``ContextConfig``, ``PaperConfig``, …) to build
                with instead of the stored ones (what ``graphmax tune`` and ``graphmax eval`` try).
            **overrides: the kind's settings (e.g. ``lam=2.0``, ``solver="paper"``), replacing the stored or given
                ones, and what else its step takes (``tokenizer=tok``, ``prompt_length``, ``device``, and for the
                context decoder ``datastore``, ``tap`` and the kNN settings of ``KnnConfig``: with a ``Datastore``
                of the model that decodes, the context choice becomes :class:`KnnContextGraphmaxLogitsProcessor`,
                with the kNN settings and λ stored with that datastore, recognised by its keys' SHA-256); one that
                the kind does not take raises a TypeError.

        Returns:
            The kind's logits processor (``ContextGraphmaxLogitsProcessor``, ``KnnContextGraphmaxLogitsProcessor``,
            ``PaperGraphmaxLogitsProcessor``, ``PaperAlgorithm1LogitsProcessor``, …). A context decoder's
            ``config.source`` records where its settings came from (``{"tuned": True, ...}`` after ``tune``;
            ``"overridden"``: the settings replaced; ``"knn"``: ``"stored"`` or ``"stored for another datastore"``
            when the graph stores kNN settings).

        Raises:
            GraphFormatError: the stored choice is malformed (one line naming the key).
            TypeError, ValueError: an unknown kind, or an override the decoder does not take or out of its range.

        Example::

            >>> import scipy.sparse as sp
            >>> counts = sp.csr_matrix([[0, 3, 1], [2, 0, 0], [0, 1, 0]], dtype=float)
            >>> GraphmaxLogitsProcessor.from_graph(counts, lam=2.0)    # never tuned: the context decoder's defaults
            ContextGraphmaxLogitsProcessor(divergence='rkl', lam=2.0, kl_share=0.15, ngram_order=4, \
order_weights=(1.0,), smoothing='kneser-ney', discount=0.75, kappa=3.0, alpha=0.5, lam_decay=0.0)
            >>> proc = GraphmaxLogitsProcessor.from_graph(counts, decoder="paper", solver="paper", lam=0.5)
            >>> proc, proc.origin
            (PaperAlgorithm1LogitsProcessor(lam=0.5), 'defaults')
        """
        stored_kind = DecoderChoice.stored_kind(graph)
        if settings is not None:
            chosen = kind_of(settings)
            if decoder not in (None, chosen.name):
                raise ValueError(f"`decoder`={decoder!r} but `settings` are those of the {chosen.name!r} decoder; "
                                 f"leave one out")
        elif decoder is not None and decoder not in kinds():
            raise ValueError(f"`decoder` must be one of {', '.join(map(repr, kinds()))} or None, got {decoder!r}")
        else:
            if decoder is None and stored_kind is not None and stored_kind not in kinds():
                DecoderChoice.from_json(graph.decoder)  # the stored record's one line: a kind not registered here
            chosen = kind(decoder or stored_kind or "context")
        own = {f.name for f in fields(chosen.settings)}
        replaced = {k: v for k, v in overrides.items() if k in own}
        rest = {k: v for k, v in overrides.items() if k not in own}
        step = chosen.step_class()
        if chosen.datastore_settings is None and ("datastore" in rest or "tap" in rest):
            takes = [k.name for k in kinds().values() if k.datastore_settings is not None]
            raise ValueError(f"`datastore` and `tap` apply to the {' or '.join(takes)} decoder, not the "
                             f"{chosen.name} one")
        takes = _keywords(step.from_choice) | ({f.name for f in fields(chosen.datastore_settings)}
                                                if chosen.datastore_settings is not None else set())
        for name in rest:
            others = [k.name for k in kinds().values() if name in {f.name for f in fields(k.settings)}]
            if name not in takes and others:
                raise ValueError(f"`{name}` applies to the {' or '.join(others)} decoder; pass decoder="
                                 f"{others[0]!r} or leave `{name}` out")
            if name not in takes:
                whose = ", the decoder this graph stores" if stored_kind == chosen.name and settings is None else ""
                raise TypeError(f"`{name}` is not an argument of {step.__name__}{whose}; construct the other "
                                f"decoder directly to use it")
        stored = dict(getattr(graph, "decoder", None) or {})
        if settings is not None:
            origin, choice = "given", DecoderChoice(dataclasses.replace(settings, **replaced))
        elif stored and stored_kind == chosen.name:
            chosen.settings(**replaced)  # a bad override is named as an override, before the stored record
            # the overrides replace the stored values before the record is checked, so that one mends a bad one
            origin, choice = "stored", DecoderChoice.from_json({**stored, **replaced})
        else:
            origin, choice = "defaults", DecoderChoice(chosen.settings(**replaced))
        proc = step.from_choice(graph, choice, overridden=tuple(sorted(replaced)), **rest)
        proc.origin, proc.kind = origin, chosen
        return proc

    @classmethod
    def from_choice(cls, graph: Any, choice: DecoderChoice, *, overridden: tuple[str, ...] = (),
                    **resources: Any) -> GraphmaxLogitsProcessor:
        """The decoder of ``choice`` (a :class:`DecoderChoice` of this class's kind) over ``graph``: what
        :meth:`from_graph` calls once it has the settings. ``overridden``: the settings the caller replaced;
        ``resources``: the step's other arguments (tokenizer, device, …). Each kind's step defines it."""
        raise NotImplementedError

    def warmup(self, device: str | torch.device | None = None,
               dtype: torch.dtype = torch.float32) -> GraphmaxLogitsProcessor:
        """Run one step on a batch of one row and one of two, so that numba compiles (or loads from its disk
        cache) every kernel a decoding step uses now rather than inside the first timed ``generate()``; on a GPU,
        so that the device's first-call costs (its kernels' loading, the tables' copy, compiling the context
        decoders' fused steps: ``gm_solver.backends.fused``) are paid here too. ``warmup_seconds`` then holds its time.

        Args:
            device (``str``, ``torch.device`` or ``None``, defaults to ``None``): where the model's scores will be
                (the model's device); ``None``: the decoder's own (the CPU, or a paper decoder's operator's).
            dtype (``torch.dtype``, defaults to ``torch.float32``): the scores' dtype (the model's), so that the first
                steps in it are paid here too.

        Returns:
            ``self``, so that ``proc = PaperGraphmaxLogitsProcessor(graph).warmup()`` reads as one step.

        Example::

            >>> import scipy.sparse as sp
            >>> proc = PaperGraphmaxLogitsProcessor(sp.csr_matrix([[0, 1.0], [1.0, 0]])).warmup()
            >>> proc.last_info is None      # the warm-up steps leave nothing behind
            True
        """
        t0 = time.perf_counter()
        width, own = self._shape()
        device = own if device is None else backends.canonical(device)
        for part in self._compiled_parts(device):  # the fused backend's steps (gm_solver.backends): compiled here
            if part.use_fused is None and device.type != "cpu":
                part.use_fused = True
        # scores spread as a model's are: on equal or evenly spread ones the paper's solve is certified where it
        # starts, and its step kernels would compile inside the first real step (7 s on the movie-review graph)
        scores = (torch.randn(width, generator=torch.Generator().manual_seed(0)) * 4).to(device, dtype)
        for rows in (1, 2):  # a batch of one and one of two take different paths through the kernels
            self._warm_step(torch.zeros(rows, 8, dtype=torch.long, device=device), scores.repeat(rows, 1))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.last_info = None
        self.warmup_seconds = time.perf_counter() - t0
        return self

    def _warm_step(self, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
        self(input_ids, scores)

    def _compiled_parts(self, device: torch.device) -> list[Any]:
        """What holds the decoder's ``use_fused`` switch on ``device`` (its reference, or its operator there)."""
        raise NotImplementedError

    def _shape(self) -> tuple[int, torch.device]:
        """The graph's number of nodes and the device the decoder computes on."""
        raise NotImplementedError

    def _settings(self) -> dict[str, Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._settings().items())})"

    def _refuse_unless_default(self, name: str, value: Any, why: str) -> None:
        """Refuse an argument set away from its default where it has no effect (transformers' generation
        config warns about such flags; a decoder that silently ignored one would mislead)."""
        # the class that declares the argument (a subclass passes its base's arguments on as **settings)
        default = next(c for c in type(self).__mro__ if name in inspect.signature(c).parameters)
        default = inspect.signature(default).parameters[name].default
        if value != default:
            raise ValueError(f"`{name}`={value!r} has no effect {why}; leave it at its default ({default!r})")


class _OperatorDecoder(GraphmaxLogitsProcessor):
    """What the paper's two decoders share: the operator M on a device, the tokenizer check and the step."""

    config: PaperConfig
    check_every: int | None = None

    def __init__(self, graph: Any, config: PaperConfig, device: str | torch.device | None, tokenizer: Any):
        target = _device(device, graph)
        if tokenizer is not None:
            if not hasattr(graph, "check_tokenizer"):
                raise ValueError(f"`tokenizer` can only be checked against a gm_graphs.Graph, got a "
                                 f"{type(graph).__name__} as `graph`")
            graph.check_tokenizer(tokenizer)
        self.config, self.graph = config, graph
        # built (and cached) now, so that the first decoding step does not pay for the transpose
        self.operator: TransitionOperator = get_operator(graph, target)
        self.last_info = None

    @property
    def lam(self) -> float:
        return self.config.lam

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        check = getattr(self.graph, "check_unchanged", None)  # a gm_graphs.Graph's: a file rewritten in place
        if check is not None:
            check()
        if scores.device != self.operator.device:
            self.operator = get_operator(self.graph, scores.device)
        scores = _without_padding(scores, self.operator.n)
        c = self.config
        logp, self.last_info = log_graphmax(scores, self.operator, c.lam, tol=c.tol, max_iter=c.max_iter,
                                            solver=c.solver,
                                            check_every=self.check_every, return_info=True)
        if check is not None:
            check()
        return logp

    @property
    def backend(self) -> str | None:
        """Which backend the last step's mirror steps took: ``"numba"``, ``"fused"`` or ``"torch"``
        (``gm_solver.backends``); None before a step, and for Algorithm 1."""
        return None if self.last_info is None else self.last_info.backend

    def _compiled_parts(self, device: torch.device) -> list[Any]:
        if device != self.operator.device:
            self.operator = get_operator(self.graph, device)
        return [self.operator]

    def _shape(self) -> tuple[int, torch.device]:
        return self.operator.n, self.operator.device

    def _device_setting(self) -> dict[str, Any]:
        return {"device": str(self.operator.device)} if self.operator.device.type != "cpu" else {}


class PaperGraphmaxLogitsProcessor(_OperatorDecoder):
    r"""The paper's graphmax: each step's distribution is

        x* = argmin over the simplex of −⟨x, z⟩ + ⟨x, log x⟩ + λ‖x − Mx‖²,

    z the step's scores and M the graph operator (Ã, Ãᵏ or a mixture Ã+…+Ãⁿ); it does not read ``input_ids``.
    Solved by certified mirror descent to a duality gap ≤ ``tol`` (``gm_solver.distribution``); the paper's own
    solver, which does not converge, is :class:`PaperAlgorithm1LogitsProcessor`. Scores wider than
    the graph (padded vocabularies) treat the extra ids as isolated nodes.

    Args:
        graph (``gm_graphs.Graph``, scipy sparse matrix, torch sparse CSR tensor or ``TransitionOperator``):
            M. A ``Graph`` loaded with ``order=k`` or ``mixture=n`` gives Ãᵏ or Ã+…+Ãⁿ (pruned orders are
            applied exactly, matrix-free).
        lam (``float``, defaults to 1.0): λ ≥ 0, finite, the weight of ‖x − Mx‖²; 0 gives softmax exactly (the
            solver settings then have no effect).
        tol (``float``, defaults to 1e-6): the duality gap at which each step's solve stops (certified).
        max_iter (``int``, defaults to 200): the iteration budget per step.
        check_every (``int`` or ``None``, defaults to ``None``): iterations between the convergence checks that
            read the gaps back to the host; ``None``: every iteration on CPU, every 8 on GPUs; 0: never (each row
            runs ``max_iter`` steps, frozen once converged; ``last_info.converged`` stays on the device, and the
            input checks are asserted on the device).
        device (``str`` or ``torch.device``, defaults to ``None``): where to build the operator now, so that the
            first step does not pay for the transpose; ``None``: the CPU (or a ``TransitionOperator``'s own
            device). Scores arriving on another device get the operator built there.
        tokenizer (defaults to ``None``): when given, a graph built with another vocabulary is refused
            (``graph`` must then be a ``gm_graphs.Graph``).

    Returns (when called with ``input_ids`` (B, T) and ``scores`` (B, V)):
        ``torch.FloatTensor`` (B, V): graphmax log-probabilities in the scores' dtype.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> A = sp.csr_matrix([[0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]])    # a 3-cycle: i is followed by i + 1
        >>> proc = PaperGraphmaxLogitsProcessor(A, lam=1.0)
        >>> logp = proc(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[2.0, 1.0, 0.0]]))
        >>> [round(p, 3) for p in logp.exp()[0].tolist()], bool(proc.last_info.gap.max() <= 1e-6)
        ([0.445, 0.329, 0.225], True)
    """

    def __init__(self, graph: Any, lam: float = 1.0, *, tol: float = 1e-6, max_iter: int = 200,
                 check_every: int | None = None, device: str | torch.device | None = None, tokenizer: Any = None):
        config = PaperConfig(lam=lam, tol=tol, max_iter=max_iter)
        self.check_every = None if check_every is None else integer(
            "check_every", check_every, "None or an int >= 0 (0: never read the gaps back to the host)",
            lambda v: v >= 0)
        super().__init__(graph, config, device, tokenizer)

    @classmethod
    def from_choice(cls, graph: Any, choice: DecoderChoice, *, overridden: tuple[str, ...] = (),
                    device: str | torch.device | None = None, tokenizer: Any = None,
                    check_every: int | None = None) -> _OperatorDecoder:
        """The paper's decoder of ``choice`` (``PaperConfig``): this class, or with ``solver="paper"``
        :class:`PaperAlgorithm1LogitsProcessor`; ``device``, ``tokenizer`` and ``check_every`` as for the
        constructors (``check_every`` is the certified solver's only)."""
        c = choice.settings
        if not c.algorithm1:
            return cls(graph, c.lam, tol=c.tol, max_iter=c.max_iter, check_every=check_every, device=device,
                       tokenizer=tokenizer)
        if check_every is not None:
            raise TypeError("`check_every` is not an argument of PaperAlgorithm1LogitsProcessor (it reads no gaps "
                            "back); leave it out")
        return PaperAlgorithm1LogitsProcessor(graph, c.lam, device=device, tokenizer=tokenizer)

    @property
    def tol(self) -> float:
        return self.config.tol

    @property
    def max_iter(self) -> int:
        return self.config.max_iter

    def _settings(self) -> dict[str, Any]:
        settings = {"lam": self.lam, "tol": self.tol, "max_iter": self.max_iter}
        if self.check_every is not None:
            settings["check_every"] = self.check_every
        return {**settings, **self._device_setting()}


class PaperAlgorithm1LogitsProcessor(_OperatorDecoder):
    r"""The paper's Algorithm 1 as printed (Liu & Yin, JAIR 2023), for reproducing its numbers: each step runs
    T = 20 projected gradient steps on

        −⟨x, z⟩ + ⟨x, log x⟩ + λ‖x − Mx‖²

    from softmax(z), with the paper's step rule, and returns where they end. It does not reach the optimum (its
    ``last_info.gap`` says how far it stops), so it has no tolerance or iteration budget; the certified solve of the
    same problem is :class:`PaperGraphmaxLogitsProcessor`.

    Args:
        graph (``gm_graphs.Graph``, scipy sparse matrix, torch sparse CSR tensor or ``TransitionOperator``): M, as
            for :class:`PaperGraphmaxLogitsProcessor`.
        lam (``float``, defaults to 1.0): λ ≥ 0, finite; 0 gives softmax exactly.
        device (``str`` or ``torch.device``, defaults to ``None``): where to build the operator now; ``None``: the
            CPU (or a ``TransitionOperator``'s own device).
        tokenizer (defaults to ``None``): when given, a graph built with another vocabulary is refused
            (``graph`` must then be a ``gm_graphs.Graph``).

    Returns (when called with ``input_ids`` (B, T) and ``scores`` (B, V)):
        ``torch.FloatTensor`` (B, V): log-probabilities in the scores' dtype.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> A = sp.csr_matrix([[0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]])
        >>> proc = PaperAlgorithm1LogitsProcessor(A, lam=1.0)
        >>> logp = proc(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[2.0, 1.0, 0.0]]))
        >>> round(float(logp.exp().sum()), 6), proc.last_info.iterations.tolist()
        (1.0, [20])
    """

    def __init__(self, graph: Any, lam: float = 1.0, *, device: str | torch.device | None = None,
                 tokenizer: Any = None):
        super().__init__(graph, PaperConfig(lam=lam, solver="paper"), device, tokenizer)

    def _settings(self) -> dict[str, Any]:
        return {"lam": self.lam, **self._device_setting()}


def _device(device: str | torch.device | None, graph: Any) -> torch.device:
    """The device the paper decoder builds its operator on, checked against the graph and this machine."""
    if device is None:
        return graph.device if isinstance(graph, TransitionOperator) else torch.device("cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"`device` must be a torch.device or its name ('cpu', 'cuda', 'cuda:1'), "
                         f"got {device!r}") from e
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`device`={device!r} but CUDA is not available here; use device='cpu'")
    if isinstance(graph, TransitionOperator) and target != graph.device:
        raise ValueError(f"`device`={device!r} differs from the TransitionOperator's device {graph.device}: build "
                         f"the operator there (TransitionOperator(graph, device=...)) or leave `device` out")
    return target


class ContextGraphmaxLogitsProcessor(GraphmaxLogitsProcessor):
    r"""Context-aware graphmax: each step's distribution is

        x* = argmin over the simplex of −⟨x, z⟩ + ⟨x, log x⟩ + λ·[(1 − m)·D(x, q) + m·KL(x‖q)],

    z the step's scores, m = ``kl_share`` and q = q(· | input_ids) the corpus' next-token distribution for the
    current context (``gm_solver.context``): the Kneser–Ney-smoothed bigram row of the previous token,
    conditioned on up to ``ngram_order`` − 1 tokens where the graph stores n-gram tables, mixed with the rows of
    Ãᵏ for the tokens k back by ``order_weights``. Each step is solved to rounding (its search for the normaliser
    stops at |log Σx| ≤ 1e-7/max(1, λ); certified gaps are ~1e-15, in ``last_info.gap``), so unlike the paper's
    decoder it has no tolerance or iteration budget to set.
    Scores wider than the graph (padded vocabularies) treat the extra ids as tokens the corpus never continues
    with. Without ``graphmax tune`` the defaults are what the README's evaluation measured (rkl, λ = 1.2,
    m = 0.15, Kneser–Ney D = 0.75); :meth:`from_graph` uses the tuned choice.

    Args:
        graph (``gm_graphs.Graph`` or scipy sparse matrix): the graph whose bigram counts (and n-gram tables)
            give q: a ``Graph`` loaded at order 1 (``load_graph(name)``), or a square count matrix.
        divergence (``str``, defaults to ``"rkl"``): D: ``"rkl"`` KL(q‖x) (keeps mass on every token the corpus
            continues with), ``"kl"`` KL(x‖q) (closed form) or ``"l2"`` ‖x − q‖².
        lam (``float``, defaults to 1.2): λ ≥ 0, finite; 0 gives softmax exactly (the other settings then have no
            effect).
        kl_share (``float``, defaults to 0.15): m in [0, 1], the share of λ on KL(x‖q); it tempers the LM's logits
            and leans them geometrically toward q. With ``divergence="kl"`` it has no effect (take 0 or the default).
        ngram_order (``int``, defaults to 4): the longest n-gram that conditions q, as far as the graph has
            tables (``graphmax build --ngrams 3,4``); 2: the bigram row only. A value above the graph's largest
            table is refused, as it would have no effect.
        order_weights (sequence of ``float``, defaults to ``(1.0,)``): β_k ≥ 0 with a positive sum, the weight of
            q_k for the token k back (q_1 the n-gram row, q_k for k ≥ 2 the row of Ãᵏ).
        smoothing (``str``, defaults to ``"kneser-ney"``): the bigram row's smoothing, ``"kneser-ney"``
            (interpolated absolute discounting with the continuation unigram) or ``"dirichlet"`` (a prior κ).
        discount (``float``, defaults to 0.75): Kneser–Ney's D in (0, 1), also the discount of the n-gram tables.
        kappa (``float``, defaults to 3.0): κ > 0, the Dirichlet prior of ``smoothing="dirichlet"`` and of the
            orders k ≥ 2.
        alpha (``float``, defaults to 0.5): α > 0, the add-α smoothing of the unigram every row backs off to.
        lam_decay (``float``, defaults to 0.0): γ ≥ 0, finite: the step after t tokens of context (``input_ids``'
            length, left padding included) uses λ_t = λ·t^(−γ), since the more of a document the LM has seen, the
            less it needs the corpus (held-out perplexity over 64 tokens: ``graphmax tune`` chooses γ); 0 keeps λ
            constant.
        prompt_length (``int``, defaults to 0): leading columns of ``input_ids`` that are read before the text
            being written (few-shot examples put before each prompt): λ_t's t counts the columns after them (at
            least 1), as ``graphmax tune`` and ``graphmax eval`` count a document's own tokens. Accepted at
            ``lam_decay=0``, where it has no effect (unlike the settings below): a caller who puts examples before
            a prompt need not know whether the stored decoder's λ falls.
        tokenizer (defaults to ``None``): when given, a graph built with another vocabulary is refused
            (``graph`` must then be a ``gm_graphs.Graph``).

    An argument that the others switch off is refused when set away from its default: ``kappa`` with
    Kneser–Ney and one order, ``discount`` with the Dirichlet prior and no n-gram tables in use, ``divergence``
    at ``kl_share=1``.

    Returns (when called with ``input_ids`` (B, T) and ``scores`` (B, V)):
        ``torch.FloatTensor`` (B, V): log-probabilities in the scores' dtype.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> counts = sp.csr_matrix([[0, 5, 1], [2, 0, 3], [4, 0, 0]], dtype=float)   # bigram counts
        >>> proc = ContextGraphmaxLogitsProcessor(counts, lam=2.0)
        >>> logp = proc(torch.tensor([[2, 0]]), torch.zeros(1, 3))    # after token 0 the corpus says 1 (5 of 6)
        >>> [round(p, 3) for p in logp.exp()[0].tolist()], bool(proc.last_info.gap.max() <= 1e-6)
        ([0.167, 0.627, 0.206], True)
    """

    DIVERGENCES = DIVERGENCES
    SMOOTHINGS = SMOOTHINGS

    def __init__(self, graph: Any, *, divergence: str = "rkl", lam: float = 1.2, kl_share: float = 0.15,
                 ngram_order: int = 4, order_weights: tuple[float, ...] = (1.0,), smoothing: str = "kneser-ney",
                 discount: float = 0.75, kappa: float = 3.0, alpha: float = 0.5, lam_decay: float = 0.0,
                 prompt_length: int = 0, tokenizer: Any = None):
        config = ContextConfig(divergence=divergence, lam=lam, kl_share=kl_share, order_weights=order_weights,
                               smoothing=smoothing, discount=discount, ngram_order=ngram_order, kappa=kappa,
                               alpha=alpha, lam_decay=lam_decay)
        self.prompt_length = integer("prompt_length", prompt_length, "an int >= 0 (columns of input_ids before "
                                     "the text being written; 0: none)", lambda v: v >= 0)
        divergence, kl_share, ngram_order, weights = config.divergence, config.kl_share, config.ngram_order, \
            config.order_weights
        smoothing, discount, kappa = config.smoothing, config.discount, config.kappa
        tables = _ngram_tables(graph)
        in_use = [n for n in tables if n <= ngram_order]
        if ngram_order > max(tables, default=2):
            self._refuse_unless_default(
                "ngram_order", ngram_order,
                f"on a graph whose n-gram tables are {tables or 'none'}: add tables (`graphmax build --ngrams 3,4` "
                f"or gm_graphs.add_ngrams) or choose an order it has")
        if divergence == "kl" and kl_share != 0:
            self._refuse_unless_default("kl_share", kl_share, "with divergence='kl': λ·KL(x‖q) whatever the share")
        if kl_share == 1:
            self._refuse_unless_default("divergence", divergence, "at kl_share=1: all of λ is on KL(x‖q)")
        if smoothing == "kneser-ney" and not any(b > 0 for b in weights[1:]):
            self._refuse_unless_default("kappa", kappa, "with smoothing='kneser-ney' and one order: κ is the prior "
                                        "of smoothing='dirichlet' and of the orders k >= 2 (order_weights)")
        if smoothing == "dirichlet" and not in_use:
            self._refuse_unless_default("discount", discount, "with smoothing='dirichlet' and no n-gram tables in "
                                        "use: D is Kneser–Ney's discount and the tables'")
        if tokenizer is not None:
            if not hasattr(graph, "check_tokenizer"):
                raise ValueError(f"`tokenizer` can only be checked against a gm_graphs.Graph, got a "
                                 f"{type(graph).__name__} as `graph`")
            graph.check_tokenizer(tokenizer)
        self.config = config
        self.reference = ContextReference(graph, self.config)
        self.last_info = None

    @classmethod
    def from_choice(cls, graph: Any, choice: DecoderChoice, *, overridden: tuple[str, ...] = (),
                    tokenizer: Any = None, prompt_length: int = 0, datastore: Datastore | None = None,
                    tap: HiddenStateTap | None = None, **knn: Any) -> ContextGraphmaxLogitsProcessor:
        """The context decoder of ``choice`` (``ContextConfig``, and the kNN settings stored with a datastore):
        this class, or with ``datastore`` :class:`KnnContextGraphmaxLogitsProcessor`, whose kNN settings are ``knn``
        over those ``choice`` stored for that datastore (recognised by its keys' SHA-256; λ too, tuned again with
        them), else over ``KnnConfig``'s defaults. ``config.source`` records where the settings came from.

        Example::

            >>> import scipy.sparse as sp
            >>> counts = sp.csr_matrix([[0, 3, 1], [2, 0, 0], [0, 1, 0]], dtype=float)
            >>> proc = ContextGraphmaxLogitsProcessor.from_choice(counts, DecoderChoice(ContextConfig(lam=0.5)))
            >>> proc.config.divergence, proc.config.lam
            ('rkl', 0.5)
        """
        settings = choice.settings.to_dict()
        source = settings.pop("source")
        if overridden:
            source = {**source, "overridden": list(overridden)}
        if datastore is None:
            if tap is not None:
                raise ValueError("`tap` applies with a `datastore` only")
            if knn:
                raise TypeError(f"`{next(iter(knn))}` is not an argument of {cls.__name__}; pass a `datastore` to "
                                f"use it")
            proc = cls(graph, **settings, tokenizer=tokenizer, prompt_length=prompt_length)
        else:
            tuned = choice.knn
            if tuned is not None and isinstance(datastore, Datastore) and tuned.datastore_sha256 == \
                    datastore.keys_sha256:
                knn = {**asdict(tuned.config), **knn}
                if "lam" not in overridden:  # λ was tuned again with the datastore
                    settings["lam"] = tuned.lam
                source = {**source, "knn": "stored"}
            elif tuned is not None:
                source = {**source, "knn": "stored for another datastore"}
            if tap is None and knn.get("knn_weight", KnnConfig.knn_weight) > 0:
                tap = HiddenStateTap()
            proc = KnnContextGraphmaxLogitsProcessor(graph, datastore, tap, **knn, **settings, tokenizer=tokenizer,
                                                     prompt_length=prompt_length)
        proc._set_source(source)
        return proc

    def _set_source(self, source: dict) -> None:
        # where the settings came from (tune's record) is no decoding setting, so it is not a constructor argument
        self.config = self.reference.config = ContextConfig(**{**self.config.to_dict(), "source": source})

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # reference rows, solve and certificate for the whole batch in one call, on the scores' device (at λ_t = 0,
        # softmax with its info: solvers.softmax_solution)
        return self.step_rows(*self._rows(input_ids), scores)

    def step_rows(self, contexts: torch.Tensor, lengths: Any, scores: torch.Tensor,
                  lams: Any = None) -> torch.Tensor:
        """One decoding step for rows that each bring their own context and length: the engine-neutral step that
        ``__call__`` (a transformers batch) and the serving plug-ins (``gm_solver.serving``) share.

        Args:
            contexts (``torch.LongTensor`` (B, T)): each row's last tokens, −1 where it has none
                (``ContextReference.contexts``).
            lengths (sequence of ``int`` or ``None``): each row's own length, for λ_t; ``None``: T.
            scores (``torch.FloatTensor`` (B, V)): the LM's scores; columns past the graph get ``-inf``.
            lams (sequence of ``float`` or ``None``, defaults to ``None``): each row's own λ (λ_t decays from it as
                from the config's); ``None``: the config's.

        Returns:
            ``torch.FloatTensor`` (B, V): log-probabilities in the scores' dtype; ``last_info`` holds the solve's.

        Example::

            >>> import scipy.sparse as sp, torch
            >>> proc = ContextGraphmaxLogitsProcessor(sp.csr_matrix([[0, 5, 1], [2, 0, 3], [4, 0, 0]]))
            >>> rows = proc.step_rows(torch.tensor([[-1, 0], [2, 0]]), [1, 2], torch.zeros(2, 3), lams=[2.0, 2.0])
            >>> torch.equal(rows[0], rows[1])    # one context: the same row, whatever came before it
            True
        """
        scores = _without_padding(scores, self.reference.n)
        lam = None if lams is None else self.reference.lam_rows(lengths, scores.shape[0], scores.device, lams)
        logp, self.last_info = self.reference.step(contexts, scores, lengths=lengths, lam=lam)
        return logp

    def _rows(self, input_ids: Any) -> tuple[Any, Any]:
        """(contexts, lengths) of a transformers batch: each row's last tokens without its padding, and its own
        length after the examples (``prompt_length``), for λ_t."""
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
            return input_ids, None  # (malformed ids are the reference's to refuse)
        rows, width = input_ids.shape
        starts = self.row_starts(rows)
        if starts is None:
            return input_ids, [width - self.prompt_length] * rows
        return self.reference.contexts(input_ids, starts), (width - self.prompt_length - starts).tolist()

    @property
    def backend(self) -> str | None:
        """Which backend the last step took: ``"numba"`` (the CPU kernel), ``"fused"`` (the compiled GPU step) or
        ``"torch"`` (eager, wherever compiling is unavailable) (``gm_solver.backends``); None before a step."""
        return self.reference.backend

    def _compiled_parts(self, device: torch.device) -> list[Any]:
        return [self.reference]

    def _shape(self) -> tuple[int, torch.device]:
        return self.reference.n, torch.device("cpu")

    def _settings(self) -> dict[str, Any]:
        c = self.config
        return {"divergence": c.divergence, "lam": c.lam, "kl_share": c.kl_share, "ngram_order": c.ngram_order,
                "order_weights": c.order_weights, "smoothing": c.smoothing, "discount": c.discount,
                "kappa": c.kappa, "alpha": c.alpha, "lam_decay": c.lam_decay,
                **({"prompt_length": self.prompt_length} if self.prompt_length else {})}


class KnnContextGraphmaxLogitsProcessor(ContextGraphmaxLogitsProcessor):
    r"""Context-aware graphmax whose reference also reads the whole context through a kNN datastore:

        q′ = (1 − β)·q(· | input_ids) + β·p_knn(· | h),

    q the corpus' n-gram reference of :class:`ContextGraphmaxLogitsProcessor`, h the LM's last hidden state
    (taken by ``tap``) and p_knn the distribution of the tokens that followed its ``knn_k`` nearest keys in
    ``datastore``, weighted by softmax(−d/T) of their squared distances d (Khandelwal et al., ICLR 2020). With
    ``marginal_weight`` w > 0 the scores first go through :class:`MarginalBiasLogitsProcessor` (z + b, the
    datastore's unigram marginal adaptation). The problem, its solve and its certificate are those of the base
    class with q′ for q (and z + b for z). Each step searches the datastore (every key, or the lists of its
    index): its cost grows with the datastore; the bias costs one addition.

    Args:
        graph (``gm_graphs.Graph`` or scipy sparse matrix): the graph, as for the base class.
        datastore (``gm_solver.datastore.Datastore``): keys from this model (``build_datastore``), values in the
            graph's vocabulary.
        tap (``gm_solver.datastore.HiddenStateTap``): attached to the model that decodes
            (``HiddenStateTap(model)``), so that each step's hidden states are those of the scores' rows; one
            ``generate()`` at a time per tap. ``datastore.check_model(model)`` checks the model is the datastore's.
        knn_weight (``float``, defaults to 0.5): β in [0, 1], the share of p_knn in the reference; 0: no search,
            the datastore's marginal bias alone (``marginal_weight``), and ``tap`` may be ``None``.
        knn_k (``int``, defaults to 1024): the neighbours read, ≥ 1 (at most the datastore's size).
        knn_temperature (``float``, defaults to 50.0): T > 0, finite, in the squared distances' units
            (``graphmax tune --datastore`` chooses it on held-out text).
        marginal_weight (``float``, defaults to 0.0): w in [0, 10], the weight of the datastore's marginal bias
            on the scores (0: none; the datastore must record marginals otherwise; ``graphmax tune --datastore``
            chooses it). The four kNN settings are checked by ``KnnConfig`` and
            kept as ``knn``.
        **settings: the base class's arguments (``divergence``, ``lam``, ``kl_share``, ``lam_decay``, …,
            ``tokenizer``).

    Returns (when called with ``input_ids`` (B, T) and ``scores`` (B, V)):
        ``torch.FloatTensor`` (B, V): log-probabilities in the scores' dtype.

    Example::

        >>> import numpy as np, scipy.sparse as sp, torch
        >>> counts = sp.csr_matrix([[0, 5, 1], [2, 0, 3], [4, 0, 0]], dtype=float)
        >>> store = Datastore(np.eye(3, 4), np.array([2, 2, 1]), vocab_size=3)   # keys in a 4-d hidden space
        >>> tap = HiddenStateTap()
        >>> tap.states = torch.tensor([[0.0, 0.9, 0.0, 0.0]])                  # what the model's head saw
        >>> proc = KnnContextGraphmaxLogitsProcessor(counts, store, tap, knn_k=2, knn_temperature=0.1, lam=2.0)
        >>> logp = proc(torch.tensor([[2, 0]]), torch.zeros(1, 3))    # the corpus says 1, the neighbours say 2
        >>> [round(p, 3) for p in logp.exp()[0].tolist()], bool(proc.last_info.gap.max() <= 1e-6)
        ([0.113, 0.384, 0.503], True)
    """

    def __init__(self, graph: Any, datastore: Datastore, tap: HiddenStateTap, *, knn_weight: float = 0.5,
                 knn_k: int = 1024, knn_temperature: float = 50.0, marginal_weight: float = 0.0,
                 **settings: Any):
        super().__init__(graph, **settings)
        if not isinstance(datastore, Datastore):
            raise TypeError(f"`datastore` must be a gm_solver.datastore.Datastore (load_datastore or "
                            f"build_datastore), got {type(datastore).__name__}")
        if not isinstance(tap, HiddenStateTap) and not (tap is None and knn_weight == 0):
            raise TypeError(f"`tap` must be a gm_solver.datastore.HiddenStateTap attached to the model, got "
                            f"{type(tap).__name__}")
        manifest = getattr(graph, "manifest", None)
        if isinstance(manifest, dict) and "tokenizer" in manifest:  # a Graph: its vocabulary, by its SHA-256
            record = manifest["tokenizer"]
            datastore.check_tokenizer(record["vocab_sha256"], record["vocab_size"], record.get("split_sha256"))
        elif datastore.vocab_size > self.reference.n:
            raise ValueError(f"`datastore` holds token ids of a {datastore.vocab_size}-token vocabulary, the graph "
                             f"has {self.reference.n}; build both with one tokenizer")
        self.knn = KnnConfig(knn_weight=knn_weight, knn_k=knn_k, knn_temperature=knn_temperature,
                             marginal_weight=marginal_weight)
        self.datastore, self.tap = datastore, tap
        self.marginal_bias = MarginalBiasLogitsProcessor(datastore, self.knn.marginal_weight) \
            if self.knn.marginal_weight > 0 else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        searches = self.config.lam != 0 and self.knn.knn_weight != 0  # (else the tap is not read)
        return self.step_rows(*self._rows(input_ids), scores, hidden=self.tap.last if searches else None)

    def step_rows(self, contexts: torch.Tensor, lengths: Any, scores: torch.Tensor, lams: Any = None, *,
                  hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The base class' engine-neutral step with the datastore: the marginal bias on the scores, then the step
        toward the n-gram reference mixed with the neighbours of ``hidden`` (B, d), the LM head's inputs for these
        rows, an explicit input (``__call__`` takes them from the tap). ``hidden`` is not read at λ = 0 or
        ``knn_weight`` = 0.

        Raises:
            ValueError: ``hidden`` missing where it is read, or not one row per row of scores.
        """
        if self.marginal_bias is not None:
            scores = self.marginal_bias(None, scores)
        if self.config.lam == 0 or self.knn.knn_weight == 0:
            return super().step_rows(contexts, lengths, scores, lams)
        if hidden is None or hidden.shape[0] != scores.shape[0]:
            got = "none" if hidden is None else f"{hidden.shape[0]}"
            raise ValueError(f"the kNN decoder searches its datastore with the LM's hidden states: got {got} for "
                             f"{scores.shape[0]} rows of scores; attach the tap to the model that produces these "
                             f"scores")
        knn = self.knn
        scores = _without_padding(scores, self.reference.n)
        tokens, weights = self.datastore.distribution(hidden, knn.knn_k, knn.knn_temperature)
        lam = None if lams is None else self.reference.lam_rows(lengths, scores.shape[0], scores.device, lams)
        logp, self.last_info = self.reference.step(contexts, scores, lengths=lengths, lam=lam,
                                                   knn=(tokens, weights, knn.knn_weight))
        return logp

    def _warm_step(self, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
        """A step with a neighbour in each row's reference (the tap is left as it was), and one search."""
        if self.knn.knn_weight == 0:  # the marginal bias alone: no search
            super()._warm_step(input_ids, scores)
            return
        rows, device = scores.shape[0], scores.device
        one = (torch.zeros(rows, 1, dtype=torch.long, device=device),
               torch.ones(rows, 1, dtype=torch.float64, device=device), self.knn.knn_weight)
        self.reference.step(input_ids, scores, knn=one)
        self.datastore.neighbours(torch.zeros(1, self.datastore.dim, device=device), self.knn.knn_k)

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), **asdict(self.knn), "datastore_keys": len(self.datastore)}


class MarginalBiasLogitsProcessor(LogitsProcessor):
    r"""The datastore's unigram marginal adaptation (Kneser, Peters & Klakow, 1997) on the scores:

        z′ = z + w·log((c + δ)/(e + δ)),

    c the tokens' counts at the datastore's positions, e the model's expected counts there (its marginals) and
    δ = 0.5 (``Datastore.marginal_bias``): each token's probability moves by (c/e)^w before any renormalisation.
    Scores wider than the vocabulary (a padded head) get 0 there; the caller's scores are left as they were. Put it
    before a graphmax decoder (the bias alone, no search) or give ``KnnContextGraphmaxLogitsProcessor`` a
    ``marginal_weight`` (which applies this processor).

    Args:
        datastore (``gm_solver.datastore.Datastore``): a datastore that records the model's marginals
            (``build_datastore``).
        weight (``float``): w in (0, 10], the bias' weight (``graphmax tune --datastore`` chose 0.75 on drug
            reviews and news).

    Returns (when called with ``input_ids`` (B, T) and ``scores`` (B, V)):
        ``torch.FloatTensor`` (B, V): the biased scores, in the scores' dtype.

    Example::

        >>> import numpy as np, scipy.sparse as sp, torch
        >>> from transformers import LogitsProcessorList
        >>> store = Datastore(np.eye(4, 2), np.array([0, 0, 0, 1]), vocab_size=3, marginals=[1.0, 1.0, 2.0])
        >>> bias = MarginalBiasLogitsProcessor(store, 1.0)
        >>> [round(v, 3) for v in bias(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 3))[0].tolist()]
        [0.847, 0.0, -1.609]
        >>> counts = sp.csr_matrix([[0, 5, 1], [2, 0, 3], [4, 0, 0]], dtype=float)
        >>> decode = LogitsProcessorList([bias, ContextGraphmaxLogitsProcessor(counts)])   # the bias alone
        >>> round(float(decode(torch.tensor([[2, 0]]), torch.zeros(1, 3)).exp().sum()), 6)
        1.0
    """

    def __init__(self, datastore: Datastore, weight: float):
        if not isinstance(datastore, Datastore):
            raise TypeError(f"`datastore` must be a gm_solver.datastore.Datastore (load_datastore or "
                            f"build_datastore), got {type(datastore).__name__}")
        self.weight = real("weight", weight, f"a float in (0, {MAX_MARGINAL_WEIGHT:g}] (the marginal bias' weight)",
                           lambda v: 0 < v <= MAX_MARGINAL_WEIGHT)
        self.datastore = datastore
        # (V,) on the datastore's device
        self.bias = datastore.marginal_bias(self.weight)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not torch.is_tensor(scores) or scores.dim() < 1:
            return scores  # (malformed scores are the decoder's to refuse)
        cols = min(scores.shape[-1], self.bias.shape[0])
        scores = scores.clone()  # the caller's scores stay as they were
        scores[..., :cols] += self.bias[:cols].to(scores.device, scores.dtype)
        return scores

    def __repr__(self) -> str:
        return f"MarginalBiasLogitsProcessor(weight={self.weight!r}, datastore_keys={len(self.datastore)})"


def _without_padding(scores: Any, n: int) -> Any:
    """``scores`` with ``-inf`` in its columns past the graph's ``n`` tokens: a head padded past the tokenizer scores
    ids the tokenizer never emits, which no distribution over the tokenizer's tokens gives any probability."""
    if not torch.is_tensor(scores) or scores.dim() == 0 or scores.shape[-1] <= n:
        return scores  # (malformed or narrower scores are the solver's to refuse)
    scores = scores.clone()  # the caller's scores stay as they were
    scores[..., n:] = -torch.inf
    return scores


def _keywords(function: Any) -> set[str]:
    """The keyword arguments ``function`` (a ``from_choice``) names, past the graph, the choice and ``overridden``."""
    return {p.name for p in inspect.signature(function).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.name != "overridden"}


def _ngram_tables(graph: Any) -> list[int]:
    """The orders of the graph's non-empty n-gram tables; checks that ``graph`` is something q can come from."""
    counts = graph.counts if hasattr(graph, "counts") and not sp.issparse(graph) else graph
    if not sp.issparse(counts) or counts.shape[0] != counts.shape[1]:
        raise TypeError(f"`graph` must be a gm_graphs.Graph or a square scipy sparse count matrix, got "
                        f"{type(graph).__name__}")
    spec = getattr(graph, "spec", None)
    if spec is not None and spec.name != "order1":
        raise ValueError(f"`graph` is loaded as {spec.name}, but the context decoder reads the graph's counts, so "
                         f"that choice would have no effect: pass load_graph(name) (order 1) and weigh the rows of "
                         f"Ãᵏ with `order_weights`")
    return sorted(n for n, table in (getattr(graph, "ngrams", None) or {}).items() if table.entries > 0)

