"""gm_graphs: word-transition graphs over a language model's vocabulary, built from a domain corpus.

corpus → tokenize → bigram counts A → Ã = D⁻¹A → Ãᵏ / Ã+…+Ãⁿ → CSR shards + manifest.

A graph is named by a ``str`` (``$GRAPHMAX_HOME/graphs/<name>``) or given as a folder (``pathlib.Path``).
"""

from .build import (CorpusCounts, add_ngrams, build_graph, count_corpus, load_counts, merge_graphs,
                    write_graph)
from .counts import BigramCounts
from . import bundled
from .errors import (CorpusError, GraphBusyError, GraphExistsError, GraphFormatError, GraphmaxError, GraphNameError,
                     MergeError, NotOwnedError, OptionError, StorageError, TokenizerError)
from .folders import graph_path, graphmax_home
from .graph import Graph, list_graphs, load_graph
from .ngrams import NgramCounts, count_ngrams, merge_ngrams
from .operators import OperatorSpec, PruneRule
from .split import CorpusSplit, split_corpus
from .tokenize import TokenizerIdentity, load_tokenizer

__all__ = [
    "BigramCounts", "CorpusCounts", "CorpusError", "CorpusSplit", "Graph", "GraphBusyError", "GraphExistsError",
    "GraphFormatError", "GraphNameError", "GraphmaxError", "MergeError", "NgramCounts", "NotOwnedError",
    "OperatorSpec", "OptionError", "PruneRule", "StorageError", "TokenizerError", "TokenizerIdentity", "add_ngrams",
    "build_graph", "count_corpus", "count_ngrams", "graph_path", "graphmax_home", "list_graphs", "load_counts",
    "load_graph", "load_tokenizer", "merge_graphs", "merge_ngrams", "split_corpus", "write_graph",
]
