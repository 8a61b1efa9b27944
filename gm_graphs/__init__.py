"""gm_graphs: word-transition graphs over a language model's vocabulary, built from a domain corpus.

corpus → tokenize → bigram counts A → Ã = D⁻¹A → Ãᵏ / Ã+…+Ãⁿ → CSR shards + manifest (``docs/format.md``).

A graph is named by a ``str`` (``$GRAPHMAX_HOME/graphs/<name>``) or given as a folder (``pathlib.Path``). The package
is in layers, each importing only those below it: ``build`` (the engines) → ``graph`` → ``format`` (the graph and
datastore folders) → ``powers`` (Ã, its powers and mixtures) → ``count`` → ``tokenize`` → ``corpus`` → ``store``
(safe files and folders) → ``errors`` (every error a :class:`GraphmaxError`).
"""

from gm_graphs.build.counts import count_corpus, merge_graphs, write_graph
from gm_graphs.build.graphs import build_graph
from gm_graphs.build.ngram_tables import add_ngrams, upgrade_graph
from gm_graphs.corpus import bundled
from gm_graphs.corpus.read import expand_corpus, iter_documents
from gm_graphs.corpus.split import split_corpus
from gm_graphs.errors import GraphmaxError
from gm_graphs.graph import Graph, list_graphs, load_graph
from gm_graphs.powers import PruneRule
from gm_graphs.store.folders import graph_path, graphmax_home
from gm_graphs.tokenize.encoder import load_tokenizer, word_tokenizer

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
