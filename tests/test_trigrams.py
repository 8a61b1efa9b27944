"""Trigram counts: exact within-document counts, stored and verified like the operators, read by the context reference."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from gm_graphs import GraphFormatError, TokenizerError, add_trigrams, build_graph, count_trigrams, load_graph
from gm_solver import ContextConfig, ContextReference


def _expected(docs, tok) -> Counter:
    counts = Counter()
    for d in docs:
        ids = tok(d, add_special_tokens=False)["input_ids"]
        counts.update(zip(ids, ids[1:], ids[2:]))  # never across documents
    return counts


def test_counts_equal_a_direct_count_within_documents(csv_corpus, bpe_tokenizer):
    path, docs = csv_corpus
    table = count_trigrams(path, bpe_tokenizer, batch_docs=7, progress=False)
    got = Counter()
    for i, ctx in enumerate(table.contexts):
        u, v = divmod(int(ctx), table.vocab_size)
        for w, c in zip(table.next[table.indptr[i]:table.indptr[i + 1]], table.counts[table.indptr[i]:table.indptr[i + 1]]):
            got[u, v, int(w)] += int(c)
    assert got == _expected(docs, bpe_tokenizer)
    assert np.all(np.diff(table.contexts) > 0)
    (u, v, w), c = _expected(docs, bpe_tokenizer).most_common(1)[0]
    nxt, cnt = table.successors(u, v)
    assert dict(zip(nxt.tolist(), cnt.tolist()))[w] == c


def test_stored_beside_the_graph_verified_and_tokenizer_checked(csv_corpus, bpe_tokenizer, smollm2_tokenizer, tmp_path):
    path, docs = csv_corpus
    graph = build_graph(path, bpe_tokenizer, out=tmp_path / "g", progress=False)
    assert graph.trigrams is None
    with pytest.raises(TokenizerError):
        add_trigrams(graph, path, smollm2_tokenizer, progress=False)
    assert "trigrams" not in load_graph(tmp_path / "g").manifest  # a refused call leaves the graph as it was
    table = add_trigrams(graph, path, bpe_tokenizer, progress=False)
    reloaded = load_graph(tmp_path / "g").trigrams
    assert np.array_equal(reloaded.contexts, table.contexts) and np.array_equal(reloaded.counts, table.counts)
    add_trigrams(graph, path, bpe_tokenizer, progress=False)  # replacing keeps exactly one table
    assert [p.name for p in (tmp_path / "g").iterdir() if "trigrams" in p.name] == ["trigrams"]
    with open(tmp_path / "g" / "trigrams" / "counts.npy", "r+b") as fh:
        fh.seek(-1, 2)
        fh.write(b"\x7f")
    with pytest.raises(GraphFormatError, match="checksum"):
        load_graph(tmp_path / "g").trigrams


def test_reference_conditions_on_exactly_the_last_two_tokens(csv_corpus, bpe_tokenizer, tmp_path):
    path, docs = csv_corpus
    graph = build_graph(path, bpe_tokenizer, out=tmp_path / "g", progress=False)
    add_trigrams(graph, path, bpe_tokenizer, progress=False)
    graph = load_graph(tmp_path / "g")
    with_tri = ContextReference(graph, ContextConfig())
    without = ContextReference(graph, ContextConfig(trigrams=False))
    (u, v, _), _ = _expected(docs, bpe_tokenizer).most_common(1)[0]
    other = next(t for t in range(graph.vocab_size) if with_tri.trigrams.successors(t, v) is None)
    seen, unseen = torch.tensor([[7, u, v]]), torch.tensor([[7, other, v]])
    q = with_tri(seen)
    assert torch.allclose(q.sum(-1), torch.ones(1, dtype=torch.float64)) and (q > 0).all()
    assert not torch.allclose(q, without(seen))  # the token two back matters …
    assert torch.equal(q, with_tri(torch.tensor([[3, u, v]])))  # … the one three back does not
    assert torch.equal(with_tri(unseen), without(unseen))  # an unseen pair backs off to the bigram row
    assert torch.equal(with_tri(torch.tensor([[v]])), without(torch.tensor([[v]])))  # one token of context
    # interpolated absolute discounting over the counts, down to the bigram row
    nxt, cnt = with_tri.trigrams.successors(u, v)
    d, total = 0.75, cnt.sum()
    expected = d * len(nxt) / total * without(seen)[0].numpy()
    expected[nxt] += np.maximum(cnt - d, 0) / total
    np.testing.assert_allclose(q[0].numpy(), expected)
