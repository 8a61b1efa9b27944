"""The options of a build, one record every engine takes, checked once when it is made."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gm_graphs.count.ngram_counts import check_orders
from gm_graphs.count.runs import RUN_ENTRIES
from gm_graphs.errors import OptionError
from gm_graphs.format.graph_files import (
    DEFAULT_SHARD_NNZ,
)
from gm_graphs.powers import PruneRule

MAX_ORDER = 999  # operator names have at most three digits (gm_graphs.format.validate)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclass(frozen=True)
class BuildOptions:
    """What a build counts and writes. ``build_graph`` makes one from its keyword arguments and every engine takes
    it; an out-of-range option is refused with one line when the record is made, before any work.

    Args:
        text_column (``str``, defaults to ``"text"``): the column or JSONL key holding the text.
        orders (sequence of ``int``, defaults to ``(1,)``): the powers Ãᵏ to materialise.
        mixture (``int`` or ``None``, defaults to ``None``): also materialise Ã+…+Ãⁿ for this n.
        eps (``float``, defaults to 1e-8): ε in D_ii = Σ_j A_ij + ε.
        clean (``bool``, defaults to ``False``): unescape HTML entities and drop ``<br />`` tags.
        bos_eos (``bool``, defaults to ``False``): add BOS→first and last→EOS edges per document.
        prune (``PruneRule``, defaults to ``PruneRule()``): what the higher orders keep of each row.
        shard_nnz (``int``, defaults to 2²⁶): non-zeros per CSR shard file.
        batch_docs (``int``, defaults to 2048): documents tokenized per batch.
        ngrams (sequence of ``int``, defaults to ``()``): n-gram orders (each ≥ 3) to count and store.
        ngram_run_entries (``int``, defaults to 2²⁴): entries of each order buffered in memory before they are
            sorted into a run on disk.
        allow_duplicate_files (``bool``, defaults to ``False``): count corpus files that hold the same bytes, each
            once, on purpose; otherwise an engine refuses them in one line naming them.

    Example::

        >>> BuildOptions(orders=[1, 2], ngrams=[4, 3]).ngrams
        (3, 4)
        >>> BuildOptions(orders=[0])
        Traceback (most recent call last):
        ...
        gm_graphs.errors.OptionError: orders are integers from 1 to 999 (powers Ãᵏ), got [0]; e.g. --orders 1,2
    """

    text_column: str = "text"
    orders: Sequence[int] = (1,)
    mixture: int | None = None
    eps: float = 1e-8
    clean: bool = False
    bos_eos: bool = False
    prune: PruneRule = PruneRule()
    shard_nnz: int = DEFAULT_SHARD_NNZ
    batch_docs: int = 2048
    ngrams: Sequence[int] = ()
    ngram_run_entries: int = RUN_ENTRIES
    allow_duplicate_files: bool = False

    def __post_init__(self) -> None:
        check_options(orders=self.orders, mixture=self.mixture, eps=self.eps, prune=self.prune,
                      shard_nnz=self.shard_nnz)
        if self.ngrams:
            object.__setattr__(self, "ngrams", check_orders(self.ngrams))
        else:
            object.__setattr__(self, "ngrams", ())
        if not _is_int(self.ngram_run_entries) or self.ngram_run_entries < 1:
            raise OptionError(f"ngram_run_entries is an integer >= 1, got {self.ngram_run_entries!r}")
        object.__setattr__(self, "orders", tuple(self.orders))
        if not isinstance(self.allow_duplicate_files, bool):
            raise OptionError(f"allow_duplicate_files is True or False, got {self.allow_duplicate_files!r}")

    @property
    def counting(self) -> dict:
        """The counting options a manifest records (and merges compare)."""
        return {"text_column": self.text_column, "clean": self.clean, "bos_eos": self.bos_eos}


def check_options(*, orders: Sequence[int] = (1,), mixture: int | None = None, eps: float = 1e-8,
                  prune: PruneRule = PruneRule(), shard_nnz: int = DEFAULT_SHARD_NNZ) -> None:
    """Refuse out-of-range options of the operators a graph is written with, with one line each, before any work."""
    if isinstance(orders, (int, str)) or not all(_is_int(k) and 1 <= k <= MAX_ORDER for k in orders):
        raise OptionError(f"orders are integers from 1 to {MAX_ORDER} (powers Ãᵏ), got {orders!r}; e.g. --orders 1,2")
    if mixture is not None and not (_is_int(mixture) and 1 <= mixture <= MAX_ORDER):
        raise OptionError(f"mixture is an integer from 1 to {MAX_ORDER} (Ã+…+Ãⁿ), got {mixture!r}")
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0):
        raise OptionError(f"eps is a finite number >= 0 (D_ii = Σ_j A_ij + eps), got {eps!r}")
    if not isinstance(prune, PruneRule):
        raise OptionError(f"prune is a gm_graphs.PruneRule, got {type(prune).__name__}")
    if prune.top_k is not None and not (_is_int(prune.top_k) and prune.top_k >= 1):
        raise OptionError(f"prune top_k is an integer >= 1 or None (keep all), got {prune.top_k!r}")
    if not (isinstance(prune.min_value, (int, float)) and math.isfinite(prune.min_value) and prune.min_value >= 0):
        raise OptionError(f"prune min_value is a finite number >= 0, got {prune.min_value!r}")
    if not (_is_int(shard_nnz) and shard_nnz >= 1):
        raise OptionError(f"shard_nnz is an integer >= 1, got {shard_nnz!r}")
