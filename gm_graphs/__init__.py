"""gm_graphs: word-transition graphs over a language model's vocabulary, built from a domain corpus.

corpus → tokenize → bigram counts A → Ã = D⁻¹A → Ãᵏ / Ã+…+Ãⁿ → CSR shards + manifest.

A graph is named by a ``str`` (``$GRAPHMAX_HOME/graphs/<name>``) or given as a folder (``pathlib.Path``).
"""

from . import bundled
from .build import ENGINES, CorpusCounts, add_ngrams, build_graph, count_corpus, load_counts, merge_graphs, write_graph
from .corpus import ReadStats, expand_corpus, iter_documents
from .counts import BigramCounts
from .datastore import check_datastore_target, open_datastore, write_datastore
from .errors import (
    CorpusError,
    DatastoreError,
    GraphBusyError,
    GraphExistsError,
    GraphFormatError,
    GraphmaxError,
    GraphNameError,
    MergeError,
    NotOwnedError,
    OptionError,
    StorageError,
    TokenizerError,
)
from .folders import claim_folder, graph_path, graphmax_home
from .graph import Graph, list_graphs, load_graph
from .ngrams import ORDERS as NGRAM_ORDERS
from .ngrams import RUN_ENTRIES as NGRAM_RUN_ENTRIES
from .ngrams import NgramCounts, count_ngrams, merge_ngrams
from .operators import OperatorSpec, PruneRule
from .split import CorpusSplit, split_corpus
from .tokenize import TokenizerIdentity, load_tokenizer, word_tokenizer

__all__ = [
    # graphs: build, open, merge, list
    "CorpusCounts", "Graph", "OperatorSpec", "PruneRule", "add_ngrams", "build_graph", "count_corpus", "graph_path",
    "graphmax_home", "list_graphs", "load_counts", "load_graph", "merge_graphs", "write_graph",
    # counts and n-gram tables
    "BigramCounts", "NgramCounts", "count_ngrams", "merge_ngrams",
    # corpora: reading, splitting, the bundled ones, and an output folder graphmax may write into
    "CorpusSplit", "ReadStats", "bundled", "claim_folder", "expand_corpus", "iter_documents", "split_corpus",
    # tokenizers
    "TokenizerIdentity", "load_tokenizer", "word_tokenizer",
    # kNN datastores' folders (gm_solver computes and searches them)
    "check_datastore_target", "open_datastore", "write_datastore",
    # defaults and choices: the n-gram orders add_ngrams counts, n-grams buffered per sorted run, build engines
    "ENGINES", "NGRAM_ORDERS", "NGRAM_RUN_ENTRIES",
    # errors: every one a GraphmaxError
    "CorpusError", "DatastoreError", "GraphBusyError", "GraphExistsError", "GraphFormatError", "GraphNameError",
    "GraphmaxError", "MergeError", "NotOwnedError", "OptionError", "StorageError", "TokenizerError",
]
