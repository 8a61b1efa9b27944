"""gm_graphs: word-transition graphs over a language model's vocabulary, built from a domain corpus.

corpus → tokenize → bigram counts A → Ã = D⁻¹A → Ãᵏ / Ã+…+Ãⁿ → CSR shards + manifest.
"""

from .build import CorpusCounts, build_graph, count_corpus, load_counts, merge_graphs, write_graph
from .counts import BigramCounts
from . import bundled
from .errors import CorpusError, GraphExistsError, GraphFormatError, GraphmaxError, TokenizerError
from .graph import Graph, graphmax_home, list_graphs, load_graph
from .operators import OperatorSpec, PruneRule
from .split import CorpusSplit, split_corpus
from .tokenize import TokenizerIdentity, load_tokenizer
from .trigrams import TrigramCounts, add_trigrams, count_trigrams

__all__ = [
    "BigramCounts", "CorpusCounts", "CorpusError", "CorpusSplit", "Graph", "GraphExistsError", "GraphFormatError",
    "GraphmaxError", "OperatorSpec", "PruneRule", "TokenizerError", "TokenizerIdentity", "TrigramCounts",
    "add_trigrams", "build_graph", "count_corpus", "count_trigrams", "graphmax_home", "list_graphs", "load_counts",
    "load_graph", "load_tokenizer", "merge_graphs", "split_corpus", "write_graph",
]
