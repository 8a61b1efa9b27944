"""A built graph on disk, and ``load_graph`` that opens one by name or by folder."""

from __future__ import annotations

import hashlib
import json
import os
from functools import cached_property
from typing import Any

import numpy as np
import scipy.sparse as sp

from gm_graphs.count.ngram_counts import NgramCounts, tables_of
from gm_graphs.errors import GraphBusyError, GraphFormatError, TokenizerError
from gm_graphs.format.graph_files import (
    GraphFiles,
    read_manifest,
    read_manifest_and_key,
    remove_unreferenced,
    write_manifest,
)
from gm_graphs.format.validate import check_decoder
from gm_graphs.powers import OperatorSpec
from gm_graphs.store.folders import (
    disk_errors,
    graph_path,
    graphmax_home,
    locked,
    missing_graph,
)

__all__ = ["Graph", "graphmax_home", "load_graph"]


class Graph:
    """One operator of a graph folder: Ã (``order=1``), Ãᵏ or the mixture Ã+…+Ãⁿ.

    ``graph`` is a name (``str``, under ``$GRAPHMAX_HOME/graphs``) or a folder (``pathlib.Path``). The manifest is
    schema-checked on opening; each array is checked (structure, and SHA-256 when ``verify``) before it is first
    handed out, once per file identity. ``matrix`` is the materialised operator (memory-mapped CSR). For orders
    that were built pruned or not built at all, ``base`` (Ã) and ``spec`` give what a solver needs to apply the
    exact operator matrix-free. :func:`load_graph` opens one with more checks.

    Args:
        graph (``str`` or ``os.PathLike``): a name (under ``$GRAPHMAX_HOME/graphs``) or a folder.
        order (``int``, defaults to 1): k, for the operator Ãᵏ.
        mixture (``int`` or ``None``, defaults to ``None``): n, for the mixture Ã+…+Ãⁿ instead.
        verify (``bool``, defaults to ``True``): check each array's SHA-256 before its first use.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
        >>> from gm_graphs import build_graph
        >>> _ = build_graph(folder / "reviews.txt", tok, path=folder / "graph", orders=(1, 2), progress=False)
        >>> g = Graph(folder / "graph", order=2)
        >>> g.spec.name, g.vocab_size, g.materialized
        ('order2', 6, True)
        >>> [round(p, 3) for p in g.matrix[1].toarray()[0].tolist()]     # Ã²'s row of "the"
        [0.0, 0.0, 0.0, 0.0, 0.667, 0.333]
    """

    def __init__(self, graph: str | os.PathLike, order: int = 1, mixture: int | None = None, *, verify: bool = True):
        self.path = graph_path(graph)
        self.spec = OperatorSpec.parse(order, mixture)
        self.verify = verify
        if self.spec.kind == "mixture" and self.spec.k == 1:
            self.spec = OperatorSpec("power", 1)
        self.manifest: dict[str, Any] = {}
        self.refresh()

    def refresh(self) -> None:
        """Re-read the manifest (after another writer changed it) and forget the arrays opened so far."""
        self.manifest, key = read_manifest_and_key(self.path)
        self._files = GraphFiles(self.path, self.manifest, self.verify, key)
        for name in ("matrix", "base", "counts", "row_mass_kept", "ngrams", "stats"):
            self.__dict__.pop(name, None)

    def __repr__(self) -> str:
        return f"Graph({str(self.path)!r}, operator={self.spec.name}, vocab_size={self.vocab_size})"

    @property
    def name(self) -> str:
        return self.manifest.get("name") or self.path.name

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eps(self) -> float:
        return float(self.manifest["eps"])

    @property
    def operators(self) -> dict[str, dict]:
        return self.manifest["operators"]

    @property
    def materialized(self) -> bool:
        return self.spec.name in self.operators

    @property
    def pruned(self) -> bool:
        """True when the materialised operator dropped entries of the exact product."""
        entry = self.operators.get(self.spec.name)
        return entry is None or bool(entry.get("pruned"))

    def _operator(self, name: str) -> sp.csr_matrix:
        if name not in self.operators:
            built = ", ".join(sorted(self.operators))
            raise GraphFormatError(f"graph {self.name!r} has no materialised {name} (built: {built}); rebuild with "
                                   f"--orders/--mixture including it, or use its matrix-free form "
                                   f"(graph.base, graph.spec)")
        return self._files.csr(self.operators[name]["shards"], weights=True)

    @cached_property
    def matrix(self) -> sp.csr_matrix:
        """The operator as an N×N float32 CSR matrix, memory-mapped."""
        return self._operator(self.spec.name)

    @cached_property
    def base(self) -> sp.csr_matrix:
        """Ã, exact: applying it ``spec.k`` times (or summing the powers) gives the exact operator."""
        return self._operator("order1")

    @cached_property
    def counts(self) -> sp.csr_matrix:
        """The raw bigram counts A as an N×N int64 CSR matrix, memory-mapped."""
        return self._files.csr(self.manifest["counts"]["shards"], weights=False)

    @cached_property
    def row_mass_kept(self) -> np.ndarray:
        """Fraction of each exact row's mass the materialised operator kept (all ones when exact)."""
        entry = self.operators.get(self.spec.name, {})
        if "row_mass" not in entry:
            return np.ones(self.vocab_size, dtype=np.float32)
        return self._files.row_mass(entry["row_mass"])

    @cached_property
    def ngrams(self) -> dict[int, NgramCounts]:
        """The stored n-gram tables by order (``NgramCounts``), memory-mapped; empty if the graph has none."""
        return tables_of(self._files.ngram_levels(), self.manifest.get("ngrams", {}).get("orders", {}),
                         self.vocab_size)

    @cached_property
    def stats(self) -> dict[str, np.ndarray]:
        """Per-node int64 arrays, N long: ``row_counts`` (Σ_j A_ij), ``successors`` (#{j: A_ij > 0}),
        ``predecessors`` (#{i: A_ij > 0}) and ``column_counts`` (Σ_i A_ij).

        Memory-mapped from ``stats/``.
        """
        return self._files.stats()

    def check_unchanged(self) -> None:
        """Raise :class:`GraphBusyError` if another program opened a file of this graph's arrays for writing (``cp``
        or ``rsync --inplace`` over it) after they were handed out. The decoders call it at every step. The arrays
        stay readable, holding the bytes they were checked with (``gm_graphs.store.leases``): nothing crashes, but
        they are no longer the graph on disk; load it again."""
        self._files.check_unchanged()

    def validate(self) -> Graph:
        """Check every file of the graph now (the arrays are otherwise checked when first used); returns self."""
        self._files.check_all()
        return self

    @property
    def decoder(self) -> dict | None:
        """The decoding choice stored by ``graphmax tune`` (None when the graph was never tuned)."""
        return self.manifest.get("decoder")

    @property
    def identity(self) -> str:
        """SHA-256 of the manifest this object read, less its stored decoder: it changes with every build,
        overwrite, merge or ``add_ngrams`` that writes other counts or tables, and not with ``set_decoder``."""
        return _identity(self.manifest)

    def set_decoder(self, choice: dict, *, expected: str | None = None) -> None:
        """Store a decoding choice in the manifest; ``GraphmaxLogitsProcessor.from_graph`` reads it.

        The choice is stored only into the graph it was made on: ``expected`` (defaults to :attr:`identity`, the
        graph as this object read it) must still be the graph's identity on disk, or ``GraphBusyError`` says the
        graph was replaced meanwhile and nothing is written. Holds the graph's lock and replaces the manifest
        atomically, so a concurrent writer fails at once and a kill leaves the old manifest or the new one.
        """
        check_decoder(self.path, choice)
        json.dumps(choice)  # refuse what the manifest cannot hold before touching it
        expected = self.identity if expected is None else expected
        with locked(self.path), disk_errors(self.path):
            manifest = read_manifest(self.path)
            if _identity(manifest) != expected:
                raise GraphBusyError(
                    f"graph {self.name!r} ({self.path}) was replaced or changed (a build --overwrite, merge or "
                    f"add_ngrams) after it was opened, so a choice made on its earlier counts was not stored; "
                    f"choose again on the graph as it is now (run graphmax tune again)")
            manifest["decoder"] = choice
            write_manifest(self.path, manifest)
            remove_unreferenced(self.path, manifest)
        self.refresh()

    def check_tokenizer(self, tokenizer) -> None:
        """Raise :class:`TokenizerError` unless ``tokenizer`` has this graph's vocabulary and splits text as the
        build's tokenizer did (graphs built before the split was recorded are checked by their vocabulary).

        Args:
            tokenizer: a loaded tokenizer, or anything :func:`~gm_graphs.load_tokenizer` takes.

        Example::

            >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
            >>> from gm_graphs import build_graph, word_tokenizer
            >>> g = build_graph(folder / "reviews.txt", tok, path=folder / "graph", progress=False)
            >>> g.check_tokenizer(tok)      # the same: nothing raised
            >>> try:
            ...     g.check_tokenizer(word_tokenizer("the cat dog ran".split()))    # another vocabulary
            ... except TokenizerError as e:
            ...     print(str(e).split("; ")[-1])
            rebuild the graph with this tokenizer
        """
        from gm_graphs.tokenize.encoder import TokenizerIdentity, load_tokenizer

        ident = TokenizerIdentity.of(load_tokenizer(tokenizer))
        mine = self.manifest["tokenizer"]
        if ident.vocab_sha256 != mine["vocab_sha256"] or ident.vocab_size != mine["vocab_size"]:
            raise TokenizerError(
                f"graph {self.name!r} was built with the tokenizer {mine['name']!r} ({mine['vocab_size']} tokens, "
                f"vocabulary {mine['vocab_sha256'][:12]}…), not {ident.name!r} ({ident.vocab_size} tokens, "
                f"vocabulary {ident.vocab_sha256[:12]}…); rebuild the graph with this tokenizer"
            )
        split = mine.get("split_sha256")
        if split is not None and ident.split_sha256 != split:
            raise TokenizerError(
                f"graph {self.name!r} was built with a tokenizer that splits text differently from {ident.name!r}: "
                f"the same {ident.vocab_size}-token vocabulary, other ids for the same text (split {split[:12]}…, "
                f"not {(ident.split_sha256 or 'none')[:12]}…; transformers may pick another tokenizer class from a "
                f"folder's config.json); load the tokenizer as the build did, or rebuild the graph with this one"
            )

    def check_output_width(self, width: int) -> None:
        """Raise :class:`TokenizerError` unless a model whose head scores ``width`` tokens can decode with this
        graph: ``width`` must be at least the graph's vocabulary. A wider head (padded past the tokenizer, as
        Qwen's is) is fine; the decoders give its extra columns probability 0.

        Args:
            width (``int``): the model's output width, ``model.get_output_embeddings().weight.shape[0]`` (or
                ``model.config.vocab_size``).

        Example::

            >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
            >>> from gm_graphs import build_graph
            >>> g = build_graph(folder / "reviews.txt", tok, path=folder / "graph", progress=False)
            >>> g.check_output_width(6), g.check_output_width(8)    # as wide as the vocabulary, or padded
            (None, None)
            >>> try:
            ...     g.check_output_width(5)
            ... except TokenizerError as e:
            ...     print(str(e).split(" (")[0])
            graph 'graph' has 6 tokens but the model scores 5
        """
        if not isinstance(width, (int, np.integer)) or isinstance(width, bool) or width < 1:
            raise ValueError(f"width must be the model's output width, an int >= 1, got {width!r}")
        if width < self.vocab_size:
            raise TokenizerError(
                f"graph {self.name!r} has {self.vocab_size} tokens but the model scores {int(width)} (its head is "
                f"narrower than the vocabulary of the graph's tokenizer {self.manifest['tokenizer']['name']!r}); "
                f"decode with a model of that tokenizer, or rebuild the graph with this model's tokenizer "
                f"(graphmax build … --tokenizer MODEL_FOLDER)"
            )


def _identity(manifest: dict) -> str:
    rest = {k: v for k, v in manifest.items() if k != "decoder"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def load_graph(graph: str | os.PathLike, order: int = 1, mixture: int | None = None, *,
               tokenizer=None, verify: bool = True) -> Graph:
    """Open a built graph by name (``str``, under ``$GRAPHMAX_HOME/graphs``) or by folder (``pathlib.Path``).

    ``order=k`` selects Ãᵏ, ``mixture=n`` the mixture Ã+…+Ãⁿ. Given a tokenizer (loaded, or anything
    ``--tokenizer`` accepts), refuses a graph built with another vocabulary. Arrays are checked before first use:
    their structure always, their SHA-256 when ``verify``, each once per file identity (a verification cache
    under ``$GRAPHMAX_HOME``), so reopening a multi-GB graph does not re-hash it.

    Args:
        graph (``str`` or ``os.PathLike``): a name (under ``$GRAPHMAX_HOME/graphs``) or a folder.
        order (``int``, defaults to 1): k, for the operator Ãᵏ.
        mixture (``int`` or ``None``, defaults to ``None``): n, for the mixture Ã+…+Ãⁿ instead.
        tokenizer (defaults to ``None``): when given, a graph built with another vocabulary is refused.
        verify (``bool``, defaults to ``True``): check each array's SHA-256 before its first use.

    Returns:
        ``Graph``: the opened graph.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
        >>> from gm_graphs import build_graph
        >>> _ = build_graph(folder / "reviews.txt", tok, path=folder / "graph", progress=False)
        >>> g = load_graph(folder / "graph", tokenizer=tok)
        >>> g.counts[1].toarray().tolist()       # "the" is followed by "cat" twice and "dog" once
        [[0, 0, 2, 1, 0, 0]]
    """
    if (missing := missing_graph(graph)) is not None:
        raise missing
    opened = Graph(graph_path(graph), order, mixture, verify=verify)
    if tokenizer is not None:
        opened.check_tokenizer(tokenizer)
    return opened
