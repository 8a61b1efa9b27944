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

from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from gm_graphs.operators import normalize

from .divergences import DIVERGENCES

SMOOTHINGS = ("kneser-ney", "dirichlet")


@dataclass(frozen=True)
class ContextConfig:
    """The choices of context-aware graphmax: divergence, λ, its share on KL(x‖q), order weights β_k, smoothing
    (D or κ), unigram α. The regulariser is λ·[(1 − kl_share)·D(x, q) + kl_share·KL(x‖q)]."""

    divergence: str = "rkl"
    lam: float = 1.2
    kl_share: float = 0.15
    order_weights: tuple[float, ...] = (1.0,)
    smoothing: str = "kneser-ney"
    discount: float = 0.75
    ngram_order: int = 4
    kappa: float = 3.0
    alpha: float = 0.5
    source: dict = field(default_factory=lambda: {"tuned": False}, compare=False)

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        if not self.lam >= 0:
            raise ValueError(f"lam must be >= 0 (0 gives softmax), got {self.lam}")
        if not 0 <= self.kl_share <= 1:
            raise ValueError(f"kl_share must be in [0, 1] (the share of λ on KL(x‖q)), got {self.kl_share}")
        weights = tuple(float(b) for b in self.order_weights)
        if not weights or any(not b >= 0 for b in weights) or sum(weights) <= 0:
            raise ValueError(f"order_weights must be >= 0 with a positive sum (β_k for k = 1, 2, …), got {weights}")
        object.__setattr__(self, "order_weights", weights)
        if not self.kappa > 0 or not self.alpha > 0:
            raise ValueError(f"kappa and alpha must be > 0, got kappa={self.kappa}, alpha={self.alpha}")
        if self.smoothing not in SMOOTHINGS:
            raise ValueError(f"smoothing must be one of {SMOOTHINGS}, got {self.smoothing!r}")
        if not 0 < self.discount < 1:
            raise ValueError(f"discount must be in (0, 1) (Kneser–Ney's D), got {self.discount}")
        if not (isinstance(self.ngram_order, int) and self.ngram_order >= 2):
            raise ValueError(f"ngram_order must be an integer >= 2 (2: the bigram row only), got {self.ngram_order!r}")

    @property
    def divergence_label(self) -> str:
        """e.g. "rkl" or "0.85·rkl + 0.15·kl"."""
        if self.kl_share == 0 or self.divergence == "kl":
            return self.divergence
        return "kl" if self.kl_share == 1 else f"{1 - self.kl_share:g}·{self.divergence} + {self.kl_share:g}·kl"

    @property
    def smoothing_label(self) -> str:
        """e.g. "kneser-ney D=0.75" or "dirichlet κ=3"."""
        return (f"kneser-ney D={self.discount:g}" if self.smoothing == "kneser-ney"
                else f"dirichlet κ={self.kappa:g}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["order_weights"] = list(self.order_weights)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ContextConfig:
        known = {k: d[k] for k in ("divergence", "lam", "kl_share", "order_weights", "smoothing", "discount",
                                   "ngram_order", "kappa", "alpha", "source") if k in d}
        # choices stored before Kneser–Ney existed were tuned with the Dirichlet prior, before kl_share with none
        known.setdefault("smoothing", "dirichlet")
        known.setdefault("kl_share", 0.0)
        if "trigrams" in d:  # stored before n-gram tables of any order: a switch for the trigram table
            known.setdefault("ngram_order", 3 if d["trigrams"] else 2)
        return cls(**known)


class ContextReference:
    """q(· | context) from a graph's counts; call it with ``input_ids`` (B, T) to get (B, V) rows.

    Example::

        >>> import scipy.sparse as sp, torch
        >>> counts = sp.csr_matrix([[0, 3, 1], [2, 0, 0], [0, 0, 0]], dtype=float)
        >>> ref = ContextReference(counts, ContextConfig(smoothing="dirichlet", kappa=1.0))
        >>> q = ref(torch.tensor([[2, 0]]))          # previous token 0: seen 4 times
        >>> [round(v, 3) for v in q[0].tolist()]
        [0.067, 0.693, 0.24]
    """

    def __init__(self, counts: Any, config: ContextConfig = ContextConfig(), cache_rows: int = 4096):
        counts_source = counts
        counts = counts.counts if hasattr(counts, "counts") and not sp.issparse(counts) else counts
        if not sp.issparse(counts) or counts.shape[0] != counts.shape[1]:
            raise TypeError("ContextReference needs a gm_graphs.Graph or a square scipy sparse count matrix")
        self.counts = sp.csr_matrix(counts, dtype=np.float64)
        self.config = config
        self.n = self.counts.shape[0]
        self.row_counts = np.asarray(self.counts.sum(axis=1)).ravel()
        self.kneser_ney = config.smoothing == "kneser-ney"
        if self.kneser_ney:  # continuation counts: distinct predecessors of each token
            col = np.bincount(self.counts.indices, minlength=self.n).astype(np.float64)
            self.successors = np.diff(self.counts.indptr).astype(np.float64)
        else:
            col = np.asarray(self.counts.sum(axis=0)).ravel()
        self.unigram = (col + config.alpha) / (col.sum() + config.alpha * self.n)
        self.transition = normalize(self.counts, eps=0.0, dtype=np.float64)  # exact Ã: seen rows sum to 1
        tables = getattr(counts_source, "ngrams", None) or {}
        self.ngrams = {n: t for n, t in sorted(tables.items()) if n <= config.ngram_order and t.entries > 0}
        self.tail = max([self.orders, *(n - 1 for n in self.ngrams)])  # the context tokens a row reads
        self._row = lru_cache(maxsize=cache_rows)(self._row_uncached)

    @property
    def orders(self) -> int:
        return len(self.config.order_weights)

    def _row_uncached(self, token: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Ãᵏ[token] as (indices, values), by k−1 sparse vector–matrix products; order 1 discounted under Kneser–Ney."""
        if k == 1 and self.kneser_ney:
            row = self.counts[token]
            return row.indices, np.maximum(row.data - self.config.discount, 0.0) / self.row_counts[token]
        row = self.transition[token]
        for _ in range(k - 1):
            row = (row @ self.transition).tocsr()
        return row.indices, row.data

    def _order(self, context: list[int], k: int) -> np.ndarray:
        """q_k for the token k places back (present in ``context``)."""
        token = int(context[-k])
        c = self.row_counts[token] if 0 <= token < self.n else 0.0
        if c == 0:
            q = self.unigram.copy()
        elif k == 1 and self.kneser_ney:
            idx, val = self._row(token, k)
            q = self.config.discount * self.successors[token] / c * self.unigram
            q[idx] += val
        else:
            idx, val = self._row(token, k)
            kappa = self.config.kappa
            # Ãᵏ loses the mass of walks that reach a token never followed by anything: it backs off to u too
            q = (kappa + c * (1.0 - val.sum())) / (c + kappa) * self.unigram
            q[idx] += c / (c + kappa) * val
        if k == 1:
            for n, table in self.ngrams.items():
                if len(context) >= n - 1:
                    q = self._discounted(table, [int(t) for t in context[-(n - 1):]], q)
        return q

    def _discounted(self, table, history: list[int], below: np.ndarray) -> np.ndarray:
        """The counts after ``history``, discounted down to ``below``; ``below`` itself if the corpus never saw it."""
        found = table.successors(history)
        if found is None:
            return below
        nxt, cnt = found
        total, d = float(cnt.sum()), self.config.discount
        q = d * len(nxt) / total * below
        q[nxt] += np.maximum(cnt - d, 0.0) / total
        return q

    def row(self, context: list[int]) -> np.ndarray:
        """q for one context (its tokens, oldest first)."""
        q = np.zeros(self.n)
        total = 0.0
        for k, beta in enumerate(self.config.order_weights, start=1):
            if beta == 0 or len(context) < k:
                continue
            q += beta * self._order(context, k)
            total += beta
        return q / total if total > 0 else q

    def __call__(self, input_ids: torch.Tensor, width: int | None = None,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """(B, width) reference rows for the next token after each row of ``input_ids``; zeros past the graph."""
        width = self.n if width is None else width
        ids = input_ids.detach().to("cpu").tolist()
        out = np.zeros((len(ids), width))
        for b, seq in enumerate(ids):
            out[b, :self.n] = self.row(seq[-self.tail:])
        return torch.from_numpy(out).to(device=input_ids.device, dtype=dtype)
