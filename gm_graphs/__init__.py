"""gm_graphs: word-transition graphs over a language model's vocabulary, built from a domain corpus.

corpus → tokenize → bigram counts A → Ã = D⁻¹A → Ãᵏ / Ã+…+Ãⁿ → CSR shards + manifest (``docs/format.md``).

A graph is named by a ``str`` (``$GRAPHMAX_HOME/graphs/<name>``) or given as a folder (``pathlib.Path``). The package
is in layers, each importing only those below it: ``build`` (the engines) → ``graph`` → ``format`` (the graph and
datastore folders) → ``powers`` (Ã, its powers and mixtures) → ``count`` → ``tokenize`` → ``corpus`` → ``store``
(safe files and folders) → ``errors`` (every error a :class:`GraphmaxError`).

Every name is loaded from its module on first use (PEP 562): ``import gm_graphs`` imports none of numpy, numba, scipy
or pyarrow, so that a command line that refuses its arguments does so before they load.
"""

from __future__ import annotations

import importlib
from typing import Any

# name → the module that defines it (``bundled`` is that module itself), imported on first access
_LAZY = {
    "count_corpus": "build.counts", "merge_graphs": "build.counts", "write_graph": "build.counts",
    "build_graph": "build.graphs",
    "add_ngrams": "build.ngram_tables", "upgrade_graph": "build.ngram_tables",
    "bundled": "corpus.bundled",
    "expand_corpus": "corpus.read", "iter_documents": "corpus.read",
    "split_corpus": "corpus.split",
    "GraphmaxError": "errors",
    "Graph": "graph", "list_graphs": "store.folders", "load_graph": "graph",
    "PruneRule": "powers",
    "graph_path": "store.folders", "graphmax_home": "store.folders",
    "load_tokenizer": "tokenize.encoder", "word_tokenizer": "tokenize.encoder",
}

__all__ = [
    # graphs: build, open, list, merge, and where they live
    "Graph", "build_graph", "graph_path", "graphmax_home", "list_graphs", "load_graph", "merge_graphs",
    # a graph's parts: its counts in memory, the pruning of its higher orders, its n-gram tables
    "PruneRule", "add_ngrams", "count_corpus", "upgrade_graph", "write_graph",
    # corpora: reading, splitting, the bundled ones
    "bundled", "expand_corpus", "iter_documents", "split_corpus",
    # tokenizers
    "load_tokenizer", "word_tokenizer",
    # errors: every one a GraphmaxError (the kinds are in gm_graphs.errors)
    "GraphmaxError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        value = module if module.__name__.endswith(f".{name}") else getattr(module, name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
