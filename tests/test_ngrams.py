"""n-gram counts: exact within-document counts, stored and verified like the operators, merged, read by the context
reference."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from gm_graphs import add_ngrams, build_graph, load_graph, merge_graphs
from gm_graphs.build.ngram_tables import count_ngrams
from gm_graphs.count.ngram_trie import COUNT_PARTS, PTR_PARTS, part_dtypes
from gm_graphs.errors import GraphFormatError, MergeError, TokenizerError
from gm_solver import ContextConfig, ContextReference


def _expected(docs, tok, n: int) -> Counter:
    counts = Counter()
    for d in docs:
        ids = tok(d, add_special_tokens=False)["input_ids"]
        counts.update(zip(*(ids[j:] for j in range(n))))  # never across documents
    return counts


def _as_counter(table) -> Counter:
    got = Counter()
    for key, k in zip(table.keys().tolist(), table.count_values().tolist()):
        gram = []
        for _ in range(table.order):
            key, t = divmod(key, table.vocab_size)
            gram.insert(0, t)
        got[tuple(gram)] += k
    return got


def test_counts_equal_a_direct_count_within_documents(csv_corpus, bpe_tokenizer):
    path, docs = csv_corpus
    # buffers of 50 n-grams: many runs in memory, each merged into the one before
    tables = count_ngrams(path, bpe_tokenizer, (3, 4), batch_docs=7, progress=False, run_entries=50)
    for n in (3, 4):
        expected = _expected(docs, bpe_tokenizer, n)
        assert _as_counter(tables[n]) == expected
        assert np.all(np.diff(tables[n].keys()) > 0)
        gram, c = expected.most_common(1)[0]
        nxt, cnt = tables[n].successors(gram[:-1])
        assert dict(zip(nxt.tolist(), cnt.tolist()))[gram[-1]] == c
    with pytest.raises(ValueError, match="3 context tokens"):
        tables[4].successors(gram[:2])


def test_counts_spilled_to_sorted_runs_equal_the_counts_in_memory(csv_corpus, bpe_tokenizer, tmp_path):
    path, _ = csv_corpus
    in_memory = count_ngrams(path, bpe_tokenizer, (3, 4), batch_docs=7, progress=False)
    # runs of ~60 entries, merged in ranges of ~60 entries: many runs, many ranges, contexts across batches
    spilled = count_ngrams(path, bpe_tokenizer, (3, 4), batch_docs=7, progress=False, work=tmp_path / "w",
                           run_entries=60)
    for n in (3, 4):
        assert isinstance(spilled[n].table.arrays["counts"], np.memmap)  # the merged table is on disk
        np.testing.assert_array_equal(spilled[n].keys(), in_memory[n].keys())
        np.testing.assert_array_equal(spilled[n].count_values(), in_memory[n].count_values())
        assert sorted(p.name for p in (tmp_path / "w" / str(n)).iterdir()) == sorted(
            f"{part}.npy" for part in part_dtypes(1, True))  # the runs are gone


def test_add_ngrams_leaves_no_runs_behind(csv_corpus, bpe_tokenizer, tmp_path):
    path, docs = csv_corpus
    graph = build_graph(path, bpe_tokenizer, path=tmp_path / "graphs" / "g", progress=False)
    before = sorted(p.name for p in graph.path.iterdir())
    add_ngrams(graph, path, bpe_tokenizer, (3,), progress=False, run_entries=60)
    assert sorted(p.name for p in (tmp_path / "graphs").iterdir()) == ["g"]
    added = sorted(set(p.name for p in graph.path.iterdir()) - set(before))
    assert len(added) == 1 and added[0].startswith("ngrams-")  # the tables' folder, and no work folder in it
    assert sorted(p.relative_to(graph.path / added[0]).as_posix() for p in (graph.path / added[0]).rglob("*")) == [
        "2", *sorted(f"2/{part}.npy" for part in PTR_PARTS), "3",
        *sorted(f"3/{part}.npy" for part in PTR_PARTS + COUNT_PARTS)]
    assert _as_counter(load_graph(tmp_path / "graphs" / "g").ngrams[3]) == _expected(docs, bpe_tokenizer, 3)


def test_orders_are_checked(csv_corpus, bpe_tokenizer, smollm2_tokenizer):
    path, _ = csv_corpus
    with pytest.raises(ValueError, match="3 or more"):
        count_ngrams(path, bpe_tokenizer, (2, 3), progress=False)
    with pytest.raises(ValueError, match="overflows int64"):
        count_ngrams(path, smollm2_tokenizer, (5,), progress=False)


def test_an_order_past_int64_keys_is_refused_in_one_line_before_any_work(tmp_path, bpe_tokenizer):
    from gm_graphs.errors import OptionError

    with pytest.raises(OptionError, match=r"and at most 63 \(a key of n tokens fits in int64\), got \[3, 1000"):
        build_graph(tmp_path / "missing.csv", bpe_tokenizer, path=tmp_path / "g", ngrams=(3, 10**20), progress=False)


def test_stored_beside_the_graph_verified_and_tokenizer_checked(csv_corpus, bpe_tokenizer, smollm2_tokenizer, tmp_path):
    path, docs = csv_corpus
    graph = build_graph(path, bpe_tokenizer, path=tmp_path / "g", progress=False)
    assert graph.ngrams == {}
    with pytest.raises(TokenizerError):
        add_ngrams(graph, path, smollm2_tokenizer, progress=False)
    assert "ngrams" not in load_graph(tmp_path / "g").manifest  # a refused call leaves the graph as it was
    stored = add_ngrams(graph, path, bpe_tokenizer, (3, 4), progress=False)
    tables = count_ngrams(path, bpe_tokenizer, (3, 4), progress=False)  # counted in memory
    reloaded = load_graph(tmp_path / "g").ngrams
    assert sorted(reloaded) == sorted(stored) == [3, 4]
    for n in (3, 4):
        assert np.array_equal(reloaded[n].keys(), tables[n].keys())
        assert np.array_equal(reloaded[n].count_values(), tables[n].count_values())
        assert np.array_equal(stored[n].count_values(), tables[n].count_values())
    add_ngrams(graph, path, bpe_tokenizer, (3,), progress=False)  # replacing keeps exactly the new tables
    folders = [p.name for p in (tmp_path / "g").iterdir() if "ngrams" in p.name]
    assert len(folders) == 1 and graph.manifest["ngrams"]["levels"]["3"]["files"]["counts"]["file"].startswith(
        folders[0] + "/")
    assert sorted(load_graph(tmp_path / "g").ngrams) == [3]
    with open(tmp_path / "g" / folders[0] / "3" / "counts.npy", "r+b") as fh:
        fh.seek(-1, 2)
        fh.write(b"\x7f")
    with pytest.raises(GraphFormatError, match="checksum"):
        load_graph(tmp_path / "g").ngrams


def test_merged_parts_equal_the_whole(csv_corpus, bpe_tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    _, docs = csv_corpus
    parts = []
    for i, half in enumerate((docs[:50], docs[50:])):
        pacsv.write_csv(pa.table({"text": half}), tmp_path / f"part{i}.csv")
        g = build_graph(tmp_path / f"part{i}.csv", bpe_tokenizer, path=tmp_path / f"g{i}", progress=False)
        add_ngrams(g, tmp_path / f"part{i}.csv", bpe_tokenizer, (3, 4) if i == 0 else (3,), progress=False)
        parts.append(g)
    with pytest.raises(MergeError, match=r"g1 stores n-gram tables of orders 3 but .*g0 stores 3,4; merging would "
                                         r"drop .* --ngrams 3,4"):
        merge_graphs(parts, path=tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    add_ngrams(parts[1], tmp_path / "part1.csv", bpe_tokenizer, (3, 4), progress=False)
    merge_graphs(parts, path=tmp_path / "merged")
    merged = load_graph(tmp_path / "merged")
    assert sorted(merged.ngrams) == [3, 4]
    for n in (3, 4):
        assert _as_counter(merged.ngrams[n]) == _expected(docs, bpe_tokenizer, n)


def test_cli_merge_refuses_parts_of_which_only_one_has_ngram_tables(home, csv_corpus, bpe_tokenizer, tmp_path,
                                                                    capsys):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from pipelines.cli import main

    _, docs = csv_corpus
    for name, half in (("a", docs[:50]), ("b", docs[50:])):
        pacsv.write_csv(pa.table({"text": half}), tmp_path / f"{name}.csv")
        graph = build_graph(tmp_path / f"{name}.csv", bpe_tokenizer, name=name, progress=False)
    add_ngrams(load_graph("a"), tmp_path / "a.csv", bpe_tokenizer, (3,), progress=False)
    assert main(["merge", "a", "b", "--name", "m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"graphmax merge: error: the graph {graph.path} stores n-gram "
                                                   f"tables of orders none but ")
    assert "--ngrams 3" in err and not (home / "graphs" / "m").exists()


def test_reference_conditions_on_exactly_the_last_n_minus_one_tokens(csv_corpus, bpe_tokenizer, tmp_path):
    path, docs = csv_corpus
    graph = build_graph(path, bpe_tokenizer, path=tmp_path / "g", progress=False)
    add_ngrams(graph, path, bpe_tokenizer, (3, 4), progress=False)
    graph = load_graph(tmp_path / "g")
    four, three, bigram = (ContextReference(graph, ContextConfig(ngram_order=n)) for n in (4, 3, 2))
    (t, u, v, _), _ = _expected(docs, bpe_tokenizer, 4).most_common(1)[0]
    seen = torch.tensor([[7, t, u, v]])
    q = four(seen)
    assert torch.allclose(q.sum(-1), torch.ones(1, dtype=torch.float64)) and (q > 0).all()
    assert not torch.allclose(q, three(seen))  # the token three back matters …
    assert torch.equal(q, four(torch.tensor([[3, t, u, v]])))  # … the one four back does not
    assert not torch.allclose(three(seen), bigram(seen))  # with order 3: the token two back matters …
    other = next(s for s in range(graph.vocab_size) if graph.ngrams[4].successors([s, u, v]) is None)
    assert torch.equal(three(seen), three(torch.tensor([[7, other, u, v]])))  # … and three back does not
    assert torch.equal(four(torch.tensor([[other, u, v]])), three(seen))  # an unseen context backs off
    assert torch.equal(four(torch.tensor([[v]])), bigram(torch.tensor([[v]])))  # one token of context
    # interpolated absolute discounting over the 4-gram counts, down to the trigram row
    nxt, cnt = graph.ngrams[4].successors([t, u, v])
    d, total = 0.75, cnt.sum()
    expected = d * len(nxt) / total * three(seen)[0].numpy()
    expected[nxt] += np.maximum(cnt - d, 0) / total
    np.testing.assert_allclose(q[0].numpy(), expected)
