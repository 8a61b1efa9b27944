"""A built graph on disk, and ``load_graph`` that opens one by name or path."""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from .errors import GraphFormatError, TokenizerError
from .operators import OperatorSpec
from .storage import check_file, read_csr, read_manifest, update_manifest


def graphmax_home() -> Path:
    """``$GRAPHMAX_HOME`` or ``~/.cache/graphmax``; named graphs live in its ``graphs/``."""
    return Path(os.environ.get("GRAPHMAX_HOME") or Path.home() / ".cache" / "graphmax")


def graph_dir(name_or_path: str | os.PathLike) -> Path:
    """A path if it is one (contains a separator or exists), else ``<home>/graphs/<name>``."""
    text = os.fspath(name_or_path)
    if os.sep in text or "/" in text or Path(text).exists():
        return Path(text)
    if not text or text.startswith("."):
        raise ValueError(f"invalid graph name {text!r}; use letters, digits, '-' or '_'")
    return graphmax_home() / "graphs" / text


def list_graphs() -> list[str]:
    root = graphmax_home() / "graphs"
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "manifest.json").is_file() and not p.name.startswith("."))


class Graph:
    """One operator of a graph folder: Ã (``order=1``), Ãᵏ or the mixture Ã+…+Ãⁿ.

    ``matrix`` is the materialised operator (memory-mapped CSR). For orders that
    were built pruned or not built at all, ``base`` (Ã) and ``spec`` give what a
    solver needs to apply the exact operator matrix-free.
    """

    def __init__(self, path: str | os.PathLike, order: int = 1, mixture: int | None = None, *, verify: bool = True):
        self.path = Path(path)
        self.manifest: dict[str, Any] = read_manifest(self.path)
        self.spec = OperatorSpec.parse(order, mixture)
        self.verify = verify
        self._ngrams = None
        if self.spec.kind == "mixture" and self.spec.k == 1:
            self.spec = OperatorSpec("power", 1)

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
    def ngrams(self) -> dict:
        """The stored n-gram tables by order (``gm_graphs.ngrams``), memory-mapped; empty if the graph has none."""
        from .ngrams import FOLDER, read_ngrams

        entry = self.manifest.get(FOLDER)
        if entry is None:
            return {}
        if self._ngrams is None:
            self._ngrams = read_ngrams(self.path, entry, self.vocab_size, self.verify)
        return self._ngrams

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
                                   f"--orders/--mixture including it, or use its matrix-free form (graph.base, "
                                   f"graph.spec)")
        return read_csr(self.path, self.operators[name]["shards"], self.vocab_size, self.verify)

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
        return read_csr(self.path, self.manifest["counts"]["shards"], self.vocab_size, self.verify)

    @cached_property
    def row_mass_kept(self) -> np.ndarray:
        """Fraction of each exact row's mass the materialised operator kept (all ones when exact)."""
        entry = self.operators.get(self.spec.name, {})
        if "row_mass" not in entry:
            return np.ones(self.vocab_size, dtype=np.float32)
        return np.load(check_file(self.path, entry["row_mass"], self.verify), mmap_mode="r")

    @property
    def decoder(self) -> dict | None:
        """The decoding choice stored by ``graphmax tune`` (None when the graph was never tuned)."""
        return self.manifest.get("decoder")

    def set_decoder(self, choice: dict) -> None:
        """Store a decoding choice in the manifest (atomically); ``GraphmaxLogitsProcessor.from_graph`` reads it."""
        self.manifest = update_manifest(self.path, "decoder", choice)

    def check_tokenizer(self, tokenizer) -> None:
        """Raise :class:`TokenizerError` unless ``tokenizer`` has this graph's vocabulary."""
        from .tokenize import TokenizerIdentity, load_tokenizer

        ident = TokenizerIdentity.of(load_tokenizer(tokenizer))
        mine = self.manifest["tokenizer"]
        if ident.vocab_sha256 != mine["vocab_sha256"] or ident.vocab_size != mine["vocab_size"]:
            raise TokenizerError(
                f"graph {self.name!r} was built with the tokenizer {mine['name']!r} ({mine['vocab_size']} tokens, "
                f"vocabulary {mine['vocab_sha256'][:12]}…), not {ident.name!r} ({ident.vocab_size} tokens, "
                f"vocabulary {ident.vocab_sha256[:12]}…); rebuild the graph with this tokenizer"
            )


def load_graph(name_or_path: str | os.PathLike, order: int = 1, mixture: int | None = None, *,
               tokenizer=None, verify: bool = True) -> Graph:
    """Open a built graph by name (under ``$GRAPHMAX_HOME/graphs``) or by folder.

    ``order=k`` selects Ãᵏ, ``mixture=n`` the mixture Ã+…+Ãⁿ. Given a tokenizer
    (loaded, or anything ``--tokenizer`` accepts), refuses a graph built with
    another vocabulary. ``verify`` checks each array's SHA-256 as it is opened.
    """
    path = graph_dir(name_or_path)
    if not path.exists():
        known = ", ".join(list_graphs()) or "none"
        raise GraphFormatError(f"no graph {os.fspath(name_or_path)!r} at {path} (graphs here: {known}); "
                               f"build it with `graphmax build CORPUS --tokenizer T --name NAME`")
    graph = Graph(path, order, mixture, verify=verify)
    if tokenizer is not None:
        graph.check_tokenizer(tokenizer)
    return graph
