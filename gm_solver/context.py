"""The corpus' next-token distribution for a context: the reference q that context-aware graphmax leans toward.

For the token k places back, w_{t−k}, the graph gives the row Ãᵏ[w_{t−k}] (the
paper's n-gram mixture, made conditional), smoothed toward a unigram u; with
c = the bigram count of the context token v = w_{t−k}, n(v) = its number of
distinct successors and A the bigram counts:

- ``smoothing="kneser-ney"`` (default; order 1): interpolated absolute
  discounting with the continuation unigram (how many distinct tokens precede
  w), the standard smoothing of n-gram language models:
  q_1(w) = max(A[v,w] − D, 0)/c + D·n(v)/c · u_cont(w)
- ``smoothing="dirichlet"``, and every order k ≥ 2: a Dirichlet prior of
  strength κ toward the frequency unigram (u_cont under Kneser–Ney):
  q_k = (c·Ãᵏ[v] + κ·u) / (c + κ)

    q = Σ_k β_k q_k / Σ_k β_k

When the graph stores n-gram counts (``gm_graphs.add_ngrams``, orders 3 and 4),
q_1 conditions on the last ``ngram_order`` − 1 tokens: each order's counts T
are discounted (D) down to the order below, starting from the bigram q_1 above,
q_1(w | h) = max(T[h,w] − D, 0)/T[h] + D·n(h)/T[h] · q_1(w | h′), with h′ the
context h without its oldest token; a context the corpus never saw keeps
q_1(w | h′).

A context the corpus never saw (c = 0) backs off to u, and a frequent one
trusts its row; so does the mass of Ãᵏ's walks that reach a token the corpus
never continues (Ã is substochastic there). Orders whose token lies before the start of ``input_ids`` are
left out. u is add-α smoothed, so every graph token has q > 0; ids beyond the
graph (padded vocabularies) get q = 0.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from gm_graphs.count.ngram_trie import empty_view
from gm_graphs.errors import GraphFormatError
from gm_graphs.format import validate
from gm_graphs.powers import normalize

from . import backends
from .backends import eager
from .backends import numba as numba_backend
from .checks import logit_value_checks, raise_unless
from .decoders.context import ContextConfig
from .divergences import check_inputs
from .solve_info import SolveInfo, softmax_solution


def graph_stats(graph: Any, indptr: np.ndarray, indices: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
    """Per-token statistics of the bigram counts A: ``row_counts`` Σ_j A_ij, ``successors`` #{j: A_ij > 0},
    ``predecessors`` #{i: A_ij > 0} (Kneser–Ney's continuation counts) and ``column_counts`` Σ_i A_ij, int64.

    The one place that reads them: from ``graph.stats`` when the graph stores them (computed at build time,
    so start-up reads N-long arrays instead of passing over the non-zeros), else from the CSR arrays of the
    counts in one pass.
    """
    stored = getattr(graph, "stats", None)
    if stored:
        return stored
    keys = ("row_counts", "successors", "predecessors", "column_counts")
    return dict(zip(keys, numba_backend.context.count_stats(indptr, indices, counts, len(indptr) - 1)))


def _is_graph(source: Any) -> bool:
    from gm_graphs import Graph

    return isinstance(source, Graph)


def _check_structure(counts: sp.csr_matrix, tables: dict) -> None:
    """Refuse counts that are not counts, and CSR arrays or n-gram tables that would send the kernels out of
    bounds (one line each)."""
    n = counts.shape[0]
    indptr, indices, data = np.asarray(counts.indptr), np.asarray(counts.indices), np.asarray(counts.data)
    if not np.all((data >= 0) & (data == np.floor(data))):
        raise ValueError("ContextReference needs bigram counts (integers >= 0), got other values; pass the graph or "
                         "its count matrix (graph.counts), not a normalised operator")
    if indptr[0] != 0 or indptr[-1] != indices.size or (np.diff(indptr) < 0).any():
        raise ValueError("the count matrix's indptr is not monotone from 0 to nnz; pass a valid scipy CSR matrix")
    if indices.size and (indices.min() < 0 or indices.max() >= n):
        raise ValueError(f"the count matrix has column indices outside [0, {n}); pass a valid scipy CSR matrix")
    for order, t in tables.items():
        try:
            parents = n
            for level in t.levels:
                validate.check_level("(in memory)", level.depth, level.arrays, parents, level.nodes, n,
                                     level.depth == order)
                parents = level.nodes
        except (GraphFormatError, KeyError) as e:
            raise ValueError(f"the order-{order} n-gram table is malformed ({e}); rebuild it with "
                             f"gm_graphs.add_ngrams") from None


def _frozen(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as a read-only ndarray of ``dtype`` (a view when it already is one), so that the kernel sees one type
    whether the arrays come memory-mapped from a graph or from memory."""
    a = np.ascontiguousarray(a, dtype=dtype).view(np.ndarray)
    a.flags.writeable = False
    return a


def _kernel_tables(ngrams: dict, n: int) -> tuple:
    """The kernel's view of the n-gram tables: (chains, orders), each table's trie levels 2 … as read-only arrays,
    padded with empty levels to one length (at least 3) and with empty tables to at least two (order 0), so that
    the usual graphs (no tables, or orders 3 and 4) share one compiled kernel."""
    depth = max([4, *ngrams]) - 1
    empty = empty_view(n)
    chains, orders = [], []
    for order, t in ngrams.items():
        views = list(t.kernel_views())
        chains.append(tuple(views + [empty] * (depth - len(views))))
        orders.append(order)
    while len(chains) < 2:
        chains.append((empty,) * depth)
        orders.append(0)
    return tuple(chains), np.array(orders, dtype=np.int64)


@dataclass
class _DeviceTables:
    """What the torch path of the reference reads, as tensors on one device (``ContextReference.on``)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    counts: torch.Tensor
    row_counts: torch.Tensor
    successors: torch.Tensor
    unigram: torch.Tensor
    row_width: int  # the most successors of any token: the fixed width of a gathered bigram row
    ngrams: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]]
    transition_t: torch.Tensor | None  # Ãᵀ as sparse CSR, for orders k ≥ 2


class ContextReference:
    """q(· | context) from a graph's counts; call it with ``input_ids`` (B, T) to get (B, V) rows, or decode with
    :meth:`step`.

    On CPU the rows are built by ``backends.numba.context`` from the graph's arrays as
    they are (memory-mapped, never copied); on other devices by torch on that
    device, from tensors copied there once (:meth:`on`). Orders k ≥ 2 need Ã, which
    is normalised on first use only.

    Args:
        counts (``gm_graphs.Graph`` or scipy sparse matrix): the bigram counts A (a ``Graph`` loaded at order 1
            also gives its n-gram tables), or a square count matrix.
        config (``ContextConfig`` or ``None``, defaults to ``None``, i.e. ``ContextConfig()``): the smoothing, orders
            and (for :meth:`step`) the solve.
        cache_rows (``int``, defaults to 4096): rows of Ãᵏ (orders k ≥ 2) kept once computed.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> counts = sp.csr_matrix([[0, 3, 1], [2, 0, 0], [0, 0, 0]], dtype=float)
        >>> ref = ContextReference(counts, ContextConfig(smoothing="dirichlet", kappa=1.0))
        >>> q = ref(torch.tensor([[2, 0]]))          # previous token 0: seen 4 times
        >>> [round(v, 3) for v in q[0].tolist()]
        [0.067, 0.693, 0.24]
    """

    def __init__(self, counts: Any, config: ContextConfig | None = None, cache_rows: int = 4096):
        config = ContextConfig() if config is None else config
        source = counts
        counts = counts.counts if hasattr(counts, "counts") and not sp.issparse(counts) else counts
        if not sp.issparse(counts) or counts.shape[0] != counts.shape[1]:
            raise TypeError("ContextReference needs a gm_graphs.Graph or a square scipy sparse count matrix")
        counts = counts if counts.format == "csr" else counts.tocsr()
        self.config = config
        self.n = counts.shape[0]
        tables = getattr(source, "ngrams", None) or {}
        if not _is_graph(source):  # a Graph's arrays are checked at load (gm_graphs); these reach numba unchecked
            _check_structure(counts, tables)
        self._graph = source if _is_graph(source) else None
        self.indptr = _frozen(counts.indptr, np.int64)
        self.indices = _frozen(counts.indices, np.int32)
        self.counts = _frozen(counts.data, np.int64)
        stats = graph_stats(source, self.indptr, self.indices, self.counts)
        self.row_counts = np.asarray(stats["row_counts"], dtype=np.float64)
        self.successors = np.asarray(stats["successors"], dtype=np.float64)
        self.kneser_ney = config.smoothing == "kneser-ney"
        # the unigram backed off to: continuation counts (distinct predecessors) under Kneser–Ney, else frequencies
        col = np.asarray(stats["predecessors" if self.kneser_ney else "column_counts"], dtype=np.float64)
        self.unigram = (col + config.alpha) / (col.sum() + config.alpha * self.n)
        self.log_unigram = np.log(self.unigram)
        self.ngrams = {n: t for n, t in sorted(tables.items()) if n <= config.ngram_order and t.entries > 0}
        self.tail = max([self.orders, *(n - 1 for n in self.ngrams)])  # the context tokens a row reads
        self._tables = _kernel_tables(self.ngrams, self.n)
        self._transition = None
        self._row = lru_cache(maxsize=cache_rows)(self._power_row)
        self._devices: dict[str, _DeviceTables] = {}
        # the fused backend's compiled step: True uses it wherever it is available, False never; None, until a
        # decoder's warmup on a GPU turns it on (compiling is paid there)
        self.use_fused: bool | None = None
        self.backend: str | None = None  # which path the last step took: "numba", "torch" or "fused"
        self._local = threading.local()

    @property
    def orders(self) -> int:
        return len(self.config.order_weights)

    @property
    def transition(self) -> sp.csr_matrix:
        """Ã = D⁻¹A, exact (float64): read by orders k ≥ 2 only, so normalised on first use."""
        if self._transition is None:
            counts = sp.csr_matrix((self.counts, self.indices, self.indptr), shape=(self.n, self.n))
            self._transition = normalize(counts, eps=0.0, dtype=np.float64)
        return self._transition

    def _power_row(self, token: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Ãᵏ[token] as (indices, values), by k−1 sparse vector–matrix products."""
        row = self.transition[token]
        for _ in range(k - 1):
            row = (row @ self.transition).tocsr()
        return row.indices, row.data

    def contexts(self, tokens: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' contexts as every decoding step reads them: (B, ``tail``) int64 ids, oldest first, −1 where a
        row has no token (before its first: a row shorter than the tail, or left padding). Engine-neutral: a
        serving engine passes each request's own last tokens, and a row's decoding never depends on its batch.

        Args:
            tokens (``torch.Tensor`` (B, T)): ids, any T ≥ 0 (the last ``tail`` columns are read; −1 means none).
            starts (``torch.Tensor`` (B,) or ``None``): the column of each row's first token (a left-padded batch's
                padding, from its attention mask); ``None``: every column is a token.

        Returns:
            ``torch.LongTensor`` (B, ``tail``) on ``tokens``' device; ``tokens`` itself when it already is one.

        Example::

            >>> import scipy.sparse as sp, torch
            >>> ref = ContextReference(sp.csr_matrix([[0, 3], [2, 0]]), ContextConfig(order_weights=(1.0, 0.5)))
            >>> ref.contexts(torch.tensor([[1]])), ref.contexts(torch.tensor([[0, 0, 1]]), starts=torch.tensor([2]))
            (tensor([[-1,  1]]), tensor([[-1,  1]]))
        """
        width = tokens.shape[1]
        ctx = tokens[:, max(width - self.tail, 0):]
        if starts is not None:  # the columns before a row's start are padding, not context
            column = torch.arange(width - ctx.shape[1], width, device=ctx.device)
            ctx = torch.where(column[None, :] >= starts.to(ctx.device)[:, None], ctx, -1)
        if ctx.shape[1] < self.tail:
            ctx = torch.cat([torch.full((ctx.shape[0], self.tail - ctx.shape[1]), -1, dtype=ctx.dtype,
                                        device=ctx.device), ctx], 1)
        return ctx if ctx.dtype == torch.int64 else ctx.long()

    def weights(self, ctx: torch.Tensor) -> torch.Tensor:
        """β_k / Σβ for k = 1, 2, … per row of ``ctx`` (:meth:`contexts`), over the orders its context reaches (the
        token k back present; 0 for the others): (B, K) float64 on ``ctx``'s device, with no host synchronisation."""
        betas = [(ctx[:, self.tail - k] >= 0).to(torch.float64) * b
                 for k, b in enumerate(self.config.order_weights, start=1)]
        total = betas[0]
        for b in betas[1:]:  # summed in order, as the host's sum of the same floats
            total = total + b
        safe = torch.where(total > 0, total, 1.0)
        return torch.stack([torch.where(total > 0, b / safe, 0.0) for b in betas], 1)

    def lam_rows(self, lengths: Any, rows: int, device: torch.device,
                 lams: Any = None) -> float | torch.Tensor:
        """λ_t of each row after ``lengths`` tokens of its own (``ContextConfig.lam_at``), from the config's λ or each
        row's own (``lams``, a sequence; a serving engine's requests): a float when every row has the same (the
        config's λ, not decaying; 0: softmax), else a (B,) float64 tensor on ``device``."""
        if lams is None and (self.config.lam_decay == 0 or self.config.lam == 0):
            return self.config.lam
        lengths = lengths.tolist() if torch.is_tensor(lengths) else list(lengths)
        lams = [None] * len(lengths) if lams is None else list(lams)
        if not len(lengths) == len(lams) == rows:
            raise ValueError(f"lengths and lams have {len(lengths)} and {len(lams)} entries for {rows} rows; one per "
                             f"row")
        return torch.tensor([self.config.lam_at(t, lam) for t, lam in zip(lengths, lams)], dtype=torch.float64,
                            device=device)

    def _extra(self, ctx: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, ...]:
        """Orders k ≥ 2 for every row of ``ctx``, weighted by its row of ``weights`` (B, K): unigram coefficients
        (B,) and the rows of Ãᵏ as CSR."""
        rows, length = ctx.shape
        alpha = np.zeros(rows)
        ptr, idx, val = np.zeros(rows + 1, dtype=np.int64), [np.zeros(0, np.int32)], [np.zeros(0)]
        kappa = self.config.kappa
        filled = 0
        for b in range(rows):
            for k in range(2, weights.shape[1] + 1):
                beta = weights[b, k - 1]
                if beta == 0.0:
                    continue
                token = int(ctx[b, length - k])
                c = self.row_counts[token] if 0 <= token < self.n else 0.0
                if c == 0.0:
                    alpha[b] += beta
                    continue
                i, v = self._row(token, k)
                # Ãᵏ loses the mass of walks that reach a token never followed by anything: it backs off to u too
                alpha[b] += beta * (kappa + c * (1.0 - v.sum())) / (c + kappa)
                idx.append(i.astype(np.int32))
                val.append(beta * c / (c + kappa) * v)
                filled += len(i)
            ptr[b + 1] = filled
        return alpha, ptr, np.concatenate(idx), np.concatenate(val)

    def kernel_args(self, contexts: torch.Tensor, knn: tuple | None = None) -> tuple:
        """The arguments of ``backends.numba.context.reference_rows`` up to its output rows, for ``contexts``
        (:meth:`contexts`; or ids, whose last ``tail`` columns are read) and a kNN distribution mixed in (its tokens
        and weights join the sparse pieces of each row)."""
        ctx_t = self.contexts(contexts.detach().cpu())
        ctx = np.ascontiguousarray(ctx_t.numpy(), dtype=np.int64)
        weights = self.weights(ctx_t).numpy()
        if knn is not None:
            weights = (1.0 - knn[2]) * weights
        extra = self._extra(ctx, weights)
        if knn is not None:
            extra = (extra[0], *_append_pieces(*extra[1:], knn[0].cpu().numpy(), knn[2] * knn[1].cpu().numpy()))
        return (ctx, np.ascontiguousarray(weights[:, 0]), self.indptr, self.indices, self.counts, self.row_counts,
                self.successors, self.unigram, self.log_unigram, self._tables, self.kneser_ney, self.config.discount,
                self.config.kappa, *extra)

    def _check_knn(self, knn: Any, rows: int, width: int, sync: bool = True) -> tuple | None:
        """``knn`` = (tokens (B, k) ids below ``width``, weights (B, k) ≥ 0 summing to 1 per row, share in [0, 1]);
        the values checked with a host synchronisation, or asserted on the device when ``sync`` is False (as
        ``check_inputs`` does)."""
        if knn is None:
            return None
        if not (isinstance(knn, tuple) and len(knn) == 3):
            raise ValueError("knn must be a tuple (tokens (B, k), weights (B, k), share)")
        tokens, weights, share = knn
        if not (torch.is_tensor(tokens) and torch.is_tensor(weights) and tokens.dim() == 2
                and tokens.shape == weights.shape and tokens.shape[0] == rows and tokens.shape[1] >= 1
                and not tokens.is_floating_point() and not tokens.is_complex()
                and (weights.is_floating_point() or weights.dtype == torch.int64)):
            raise ValueError(f"knn must be (tokens (B, k) integer, weights (B, k) real, share) with B = {rows} rows "
                             f"and k >= 1")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"the kNN share must be a float in [0, 1], got {share!r}")
        weights = weights.detach().double()
        checks = {f"kNN tokens must be ids in [0, {width})": ((tokens >= 0) & (tokens < width)).all(),
                  "kNN weights must be finite, >= 0 and sum to 1 in each row (a distribution)":
                      (torch.isfinite(weights) & (weights >= 0)).all() & ((weights.sum(1) - 1.0).abs() <= 1e-6).all()}
        raise_unless(checks, sync)
        return tokens.detach().long(), weights, float(share)

    def _check_ids(self, input_ids: torch.Tensor, rows: int | None = None) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(f"input_ids must be an integer tensor of shape (B, T), got "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} of shape "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        if rows is not None and input_ids.shape[0] != rows:
            raise ValueError(f"input_ids has {input_ids.shape[0]} rows but scores has {rows}; one context per row")

    def __call__(self, input_ids: torch.Tensor, width: int | None = None,
                 dtype: torch.dtype = torch.float64, knn: tuple | None = None) -> torch.Tensor:
        """(B, width) reference rows for the next token after each row of ``input_ids``; zeros past the graph.
        ``knn`` = (tokens (B, k), weights (B, k), β) mixes a sparse distribution in: (1 − β)·q + β·p_knn."""
        self._check_ids(input_ids)
        width = self.n if width is None else width
        if width < self.n:
            raise ValueError(f"width {width} is narrower than the graph's {self.n} tokens")
        knn = self._check_knn(knn, input_ids.shape[0], width)
        self._check_graph()
        room = backends.room(backends.choose(input_ids.device))
        q = room.reference_rows(self, input_ids, width, knn)
        self._check_graph()
        return q.to(dtype)

    def _check_graph(self) -> None:
        """Raise ``GraphBusyError`` if the graph the counts came from had a file rewritten in place since
        (``gm_graphs.Graph.check_unchanged``); nothing for counts given as a matrix."""
        if self._graph is not None:
            self._graph.check_unchanged()

    def restricted(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """q(· | ``input_ids``) over the tokens ``scores`` allows: zero where a score is ``-inf``, renormalised over
        the rest; a row with no mass left stays all zeros. The q that graphmax's context decoder leans toward and
        that ``InterpolationLogitsProcessor`` mixes in.

        Args:
            input_ids (``torch.LongTensor`` (B, T)): the contexts, one per row.
            scores (``torch.FloatTensor`` (B, V)): the step's scores, V at least the graph's size; only which are
                finite is read.

        Returns:
            ``torch.DoubleTensor`` (B, V): the rows of q, float64, on the scores' device.

        Example::

            >>> import scipy.sparse as sp, torch
            >>> counts = sp.csr_matrix([[0, 3, 1], [2, 0, 0], [0, 0, 0]], dtype=float)
            >>> ref = ContextReference(counts, ContextConfig(smoothing="dirichlet", kappa=1.0))
            >>> q = ref.restricted(torch.tensor([[2, 0]]), torch.tensor([[0.0, 0.0, -torch.inf]]))
            >>> [round(v, 3) for v in q[0].tolist()]            # token 2 is masked: q moves to 0 and 1
            [0.088, 0.912, 0.0]
        """
        q = self(input_ids, width=scores.shape[-1]).to(scores.device)
        return eager.restrict_reference(q, torch.isfinite(scores))[0]

    def step(self, contexts: torch.Tensor, scores: torch.Tensor, *, lengths: Any = None,
             lam: float | torch.Tensor | None = None, tol: float = 1e-6, max_iter: int | None = None,
             check_every: int | None = None, backend: str = "auto",
             knn: tuple | None = None) -> tuple[torch.Tensor, SolveInfo]:
        """One decoding step: log x of the config's problem toward q(· | context) for each row of ``scores``, in
        ``scores``' dtype and on its device, with the solve's info (certificate per row).

        The engine-neutral step: each row brings its own context and length, so a row decodes the same whatever
        else is in the batch (``transformers``' processors, a serving engine's requests).

        Args:
            contexts (``torch.LongTensor`` (B, T)): each row's last tokens, oldest first, −1 where it has none
                (:meth:`contexts`); ids of any width T (the last ``tail`` columns are read).
            scores (``torch.Tensor`` (B, V)): the LM's scores, V at least the graph's size.
            lengths (sequence of ``int`` or ``torch.Tensor`` (B,), defaults to ``None``): each row's t for λ_t
                (``ContextConfig.lam_at``); ``None``: T for every row.
            lam (``float`` or ``torch.Tensor`` (B,), defaults to ``None``): λ_t itself, per row or for all,
                overriding ``lengths``.
            tol, max_iter, check_every: the certificate's tolerance and the ν solve's budget (``max_iter`` and
                ``check_every`` default to ``backends.DEFAULTS``: on the CPU 60 ν steps at most, each checked;
                elsewhere 8 ν steps with nothing read back, rows frozen once converged).
            backend (``str``, defaults to ``"auto"``): ``gm_solver.backends``: "numba" (CPU only, one kernel call
                for everything), "torch" (on the scores' device: eager, or compiled once ``use_fused`` is on), "fused"
                (the same compiled; CUDA), "auto" (numba on the CPU, else as "torch"); ``backends.choose``.
            knn (``tuple`` or ``None``): (tokens (B, k), weights (B, k), β): the reference is (1 − β)·q + β·p_knn,
                p_knn the sparse rows given (``gm_solver.datastore``).

        Returns:
            ``(torch.Tensor (B, V), SolveInfo)``: log x and the solve's info.

        Example::

            >>> import scipy.sparse as sp, torch
            >>> counts = sp.csr_matrix([[0, 3, 1], [2, 0, 0], [1, 1, 0]])
            >>> ref = ContextReference(counts, ContextConfig(lam=2.0))
            >>> logp, info = ref.step(torch.tensor([[2, 0]]), torch.zeros(1, 3))
            >>> [round(v, 3) for v in logp.exp()[0].tolist()], bool(info.gap.max() <= 1e-6)
            ([0.206, 0.583, 0.211], True)
        """
        self._check_graph()
        out = self._solve(contexts, scores, lengths, lam, tol, max_iter, check_every, backend, knn)
        self._check_graph()  # a file rewritten during the step may have been read as zeros (gm_graphs.store.leases)
        return out

    def _solve(self, contexts: torch.Tensor, scores: torch.Tensor, lengths: Any, lam: float | torch.Tensor | None,
               tol: float, max_iter: int | None, check_every: int | None, backend: str,
               knn: tuple | None) -> tuple[torch.Tensor, SolveInfo]:
        backends.check_request(backend)
        if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
            raise ValueError(f"scores must be a (B, V) tensor, got {tuple(getattr(scores, 'shape', ()))}")
        self._check_ids(contexts, scores.shape[0])
        if scores.shape[-1] < self.n:
            raise ValueError(f"scores have {scores.shape[-1]} entries but the graph has {self.n} nodes; "
                             f"rebuild the graph with this model's tokenizer")
        budget = backends.defaults(scores.device)
        check_every = budget.check_every if check_every is None else check_every
        max_iter = budget.nu_steps if max_iter is None else max_iter
        # the compiled step reads nothing back (every context is ``tail`` wide: one traced shape)
        name = backends.choose(scores.device, backend, fused=bool(self.use_fused), reads_back=check_every != 0)
        kernel = name == "numba"
        knn = self._check_knn(knn, scores.shape[0], scores.shape[-1], sync=kernel or check_every != 0)
        share = 1.0 if self.config.divergence == "kl" else self.config.kl_share
        if lam is None:
            lam = self.config.lam_at(contexts.shape[1]) if lengths is None else \
                self.lam_rows(lengths, scores.shape[0], scores.device)
        # the kernel checks the scores' values in its first pass (one pass fewer)
        lam = check_inputs(scores, None, lam, share, tol, max_iter, sync=check_every != 0, skip_z_values=kernel,
                           name="scores")
        if isinstance(lam, float) and lam == 0.0:
            if kernel:  # (no kernel runs to check them)
                raise_unless(logit_value_checks(scores, "scores"), True)
            logx, info = softmax_solution(scores.to(torch.float64))
            return logx.to(scores.dtype), info
        ctx = self.contexts(contexts)
        out = backends.room(name).context_step(self, ctx, scores, lam, share, tol=tol, max_iter=max_iter,
                                               check_every=check_every, knn=knn)
        if out is None:  # compiling failed (``fused.failures``): the eager step
            name, out = "torch", eager.context_step(self, ctx, scores, lam, share, tol=tol, max_iter=max_iter,
                                                    check_every=check_every, knn=knn)
        self.backend = out[1].backend = name
        return out

    def scratch(self, shape: tuple[int, ...]) -> np.ndarray:
        """A float64 buffer of ``shape`` kept for this thread from step to step (a reference may serve several
        threads at once), for the numba kernel's copies and scratch."""
        work = getattr(self._local, "work", None)
        if work is None or work.shape != shape:
            work = self._local.work = np.empty(shape)
        return work

    def on(self, device: torch.device | str) -> _DeviceTables:
        """The arrays the torch path reads, as tensors on ``device`` (copied there once, then cached)."""
        device = backends.canonical(device)
        key = str(device)
        if key in self._devices:
            return self._devices[key]

        def tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a), device="cpu").to(device=device, dtype=dtype)

        with warnings.catch_warnings():  # read-only memory maps (torch only reads them); sparse CSR "in beta"
            warnings.simplefilter("ignore", UserWarning)
            ngrams = []
            for order, t in self.ngrams.items():
                contexts, indptr, nxt, counts = t.dense()
                ngrams.append((order, tensor(contexts, torch.int64), tensor(indptr, torch.int64),
                               tensor(nxt, torch.int64), tensor(counts, torch.float64), int(np.diff(indptr).max())))
            transition_t = None
            if any(b > 0 for b in self.config.order_weights[1:]):
                a_t = self.transition.T.tocsr()
                transition_t = torch.sparse_csr_tensor(tensor(a_t.indptr, torch.int64),
                                                       tensor(a_t.indices, torch.int64),
                                                       tensor(a_t.data, torch.float64), size=a_t.shape,
                                                       check_invariants=False)
            tables = _DeviceTables(tensor(self.indptr, torch.int64), tensor(self.indices, torch.int64),
                                   tensor(self.counts, torch.float64), tensor(self.row_counts, torch.float64),
                                   tensor(self.successors, torch.float64), tensor(self.unigram, torch.float64),
                                   int(self.successors.max()) if self.n else 0, ngrams, transition_t)
        self._devices[key] = tables
        return tables


def _append_pieces(ptr: np.ndarray, idx: np.ndarray, val: np.ndarray, tokens: np.ndarray,
                   weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CSR pieces (ptr, idx, val) with each row's (tokens, weights) appended after its own pieces."""
    rows, k = tokens.shape
    own = np.diff(ptr)
    new_ptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(own + k, out=new_ptr[1:])
    new_idx = np.empty(new_ptr[-1], dtype=np.int32)
    new_val = np.empty(new_ptr[-1])
    at = np.arange(idx.size) + np.repeat(np.arange(rows, dtype=np.int64) * k, own)
    new_idx[at], new_val[at] = idx, val
    tail = (new_ptr[:-1] + own)[:, None] + np.arange(k)
    new_idx[tail], new_val[tail] = tokens, weights
    return new_ptr, new_idx, new_val
