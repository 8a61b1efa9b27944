"""gm_graphs: word-transition graphs over a language model's vocabulary, built from a domain corpus.

corpus → tokenize → bigram counts A → Ã = D⁻¹A → Ãᵏ / Ã+…+Ãⁿ → CSR shards + manifest.
"""

from .build import CorpusCounts, build_graph, count_corpus, load_counts, merge_graphs, write_graph
from .counts import BigramCounts
from . import bundled
from .errors import CorpusError, GraphExistsError, GraphFormatError, GraphmaxError, TokenizerError
from .graph import Graph, graphmax_home, list_graphs, load_graph
from .ngrams import NgramCounts, add_ngrams, count_ngrams, merge_ngrams
from .operators import OperatorSpec, PruneRule
from .split import CorpusSplit, split_corpus
from .tokenize import TokenizerIdentity, load_tokenizer

__all__ = [
    "BigramCounts", "CorpusCounts", "CorpusError", "CorpusSplit", "Graph", "GraphExistsError", "GraphFormatError",
    "GraphmaxError", "NgramCounts", "OperatorSpec", "PruneRule", "TokenizerError", "TokenizerIdentity",
    "add_ngrams", "build_graph", "count_corpus", "count_ngrams", "graphmax_home", "list_graphs", "load_counts",
    "load_graph", "load_tokenizer", "merge_graphs", "merge_ngrams", "split_corpus", "write_graph",
]
