"""A graph as loaded (gm_graphs.graph): load_graph refuses a missing graph or operator, and a tokenizer of another
vocabulary."""

from __future__ import annotations

import pytest

from gm_graphs import build_graph, load_graph
from gm_graphs.errors import GraphFormatError, TokenizerError


def test_graph_and_tokenizer_vocabulary_mismatch(tmp_path, csv_corpus, bpe_tokenizer, smollm2_tokenizer):
    path, _ = csv_corpus
    g = build_graph(path, bpe_tokenizer, path=tmp_path / "g", progress=False)
    load_graph(g.path, tokenizer=bpe_tokenizer)
    with pytest.raises(TokenizerError, match="rebuild the graph with this tokenizer"):
        load_graph(g.path, tokenizer=smollm2_tokenizer)


def test_missing_graph_and_missing_operator(home, tmp_path, csv_corpus, bpe_tokenizer):
    with pytest.raises(GraphFormatError, match="graphmax build"):
        load_graph("nothing")
    path, _ = csv_corpus
    g = build_graph(path, bpe_tokenizer, path=tmp_path / "g", progress=False)
    g2 = load_graph(g.path, order=2)  # not materialised: the matrix-free form remains
    assert g2.base.shape == g.matrix.shape
    with pytest.raises(GraphFormatError, match="no materialised order2"):
        g2.matrix
