"""gm_graphs: word-transition graphs over a language model's vocabulary, built from a domain corpus.

corpus → tokenize → bigram counts A → Ã = D⁻¹A → Ãᵏ / Ã+…+Ãⁿ → CSR shards + manifest.

A graph is named by a ``str`` (``$GRAPHMAX_HOME/graphs/<name>``) or given as a folder (``pathlib.Path``).
"""

from gm_graphs.corpus import bundled
from gm_graphs.build.graphs import ENGINES, CorpusCounts, add_ngrams, build_graph, count_corpus, load_counts, merge_graphs, write_graph
from gm_graphs.corpus.read import ReadStats, expand_corpus, iter_documents
from gm_graphs.count.bigrams import BigramCounts
from gm_graphs.format.datastore import check_datastore_target, open_datastore, write_datastore
from gm_graphs.errors import (
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
from gm_graphs.store.folders import claim_folder, graph_path, graphmax_home
from gm_graphs.graph import Graph, list_graphs, load_graph
from gm_graphs.count.ngrams import ORDERS as NGRAM_ORDERS
from gm_graphs.count.ngrams import RUN_ENTRIES as NGRAM_RUN_ENTRIES
from gm_graphs.count.ngrams import NgramCounts, count_ngrams, merge_ngrams
from gm_graphs.operators import OperatorSpec, PruneRule
from gm_graphs.corpus.split import CorpusSplit, split_corpus
from gm_graphs.tokenize.encoder import TokenizerIdentity, load_tokenizer, word_tokenizer

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
