"""Building, storing and loading graphs: exact operators, deterministic bytes, merges, bad input."""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from gm_graphs import PruneRule, build_graph, list_graphs, load_graph, load_tokenizer, merge_graphs
from gm_graphs.errors import CorpusError, GraphExistsError, GraphFormatError, TokenizerError
from pipelines.cli import main

from .helpers import make_docs


def _all_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def exact_graph(tmp_path, csv_corpus, bpe_tokenizer):
    path, _ = csv_corpus
    return build_graph(path, bpe_tokenizer, path=tmp_path / "g", orders=(1, 2, 3), mixture=3,
                       prune=PruneRule.exact(), progress=False)


def test_counts_equal_an_independent_count(exact_graph, csv_corpus, bpe_tokenizer):
    _, docs = csv_corpus
    expected = Counter()
    for d in docs:
        ids = bpe_tokenizer(d, add_special_tokens=False)["input_ids"]
        expected.update(zip(ids, ids[1:]))
    coo = exact_graph.counts.tocoo()
    assert dict(zip(zip(coo.row.tolist(), coo.col.tolist()), coo.data.tolist())) == dict(expected)
    assert exact_graph.manifest["corpus"]["documents"] == len(docs)


def test_rows_sum_to_d_over_d_plus_eps(exact_graph):
    d = np.asarray(exact_graph.counts.sum(axis=1), dtype=np.float64).ravel()
    rows = np.asarray(exact_graph.matrix.sum(axis=1), dtype=np.float64).ravel()
    expected = np.where(d > 0, d / (d + exact_graph.eps), 0.0)
    np.testing.assert_allclose(rows, expected, rtol=1e-6, atol=0)
    assert exact_graph.matrix.dtype == np.float32 and isinstance(exact_graph.matrix.data, np.memmap)


def test_unpruned_powers_and_mixture_equal_exact_products(exact_graph):
    a = exact_graph.base.astype(np.float64)
    a2, a3 = a @ a, a @ a @ a
    for order, expected in ((2, a2), (3, a3)):
        got = load_graph(exact_graph.path, order=order)
        assert not got.pruned
        np.testing.assert_allclose(got.matrix.toarray(), expected.toarray(), rtol=1e-6, atol=1e-9)
    mix = load_graph(exact_graph.path, mixture=3)
    np.testing.assert_allclose(mix.matrix.toarray(), (a + a2 + a3).toarray(), rtol=1e-6, atol=1e-9)


def test_pruned_order_keeps_top_k_and_records_the_kept_mass(tmp_path, csv_corpus, bpe_tokenizer):
    path, _ = csv_corpus
    g = build_graph(path, bpe_tokenizer, path=tmp_path / "p", orders=(2,), prune=PruneRule(top_k=3),
                    progress=False)
    g2 = load_graph(g.path, order=2)
    assert g2.pruned and np.diff(g2.matrix.indptr).max() <= 3
    exact = (g.base.astype(np.float64) @ g.base.astype(np.float64)).toarray()
    kept = g2.matrix.toarray().astype(np.float64)
    row_sum = exact.sum(axis=1)
    frac = np.divide(kept.sum(axis=1), row_sum, out=np.ones_like(row_sum), where=row_sum > 0)
    np.testing.assert_allclose(g2.row_mass_kept, frac, rtol=1e-5)
    for r in np.nonzero(row_sum)[0][:20]:  # the kept entries are the row's largest
        assert kept[r].min(initial=np.inf, where=kept[r] > 0) >= np.sort(exact[r])[-3] * (1 - 1e-6)
    assert g2.manifest["operators"]["order2"]["prune_rule"] == {"top_k": 3, "min_value": 0.0}


def test_rebuild_is_byte_identical(tmp_path, csv_corpus, bpe_tokenizer):
    path, _ = csv_corpus
    a = build_graph(path, bpe_tokenizer, path=tmp_path / "a", orders=(1, 2), progress=False)
    b = build_graph(path, bpe_tokenizer, path=tmp_path / "b", orders=(1, 2), progress=False)
    ba, bb = _all_bytes(a.path), _all_bytes(b.path)
    ba["manifest.json"] = ba["manifest.json"].replace(b'"name": "a"', b'"name": "b"')
    assert ba == bb


def test_merge_of_two_half_builds_equals_one_full_build(tmp_path, bpe_tokenizer):
    docs = make_docs(80, seed=5)
    (tmp_path / "h1.txt").write_text("\n".join(docs[:40]) + "\n")
    (tmp_path / "h2.txt").write_text("\n".join(docs[40:]) + "\n")
    full = build_graph(str(tmp_path / "h*.txt"), bpe_tokenizer, path=tmp_path / "full", orders=(1, 2),
                       progress=False)
    halves = [build_graph(tmp_path / f"h{i}.txt", bpe_tokenizer, path=tmp_path / f"half{i}", progress=False)
              for i in (1, 2)]
    merged = merge_graphs(halves, path=tmp_path / "merged", orders=(1, 2), progress=False)
    fb, mb = _all_bytes(full.path), _all_bytes(merged.path)
    fb.pop("manifest.json"), mb.pop("manifest.json")
    assert fb == mb
    assert merged.manifest["corpus"]["documents"] == 80
    assert merged.manifest["corpus"]["files"] == full.manifest["corpus"]["files"]


def test_existing_graph_is_refused_unless_overwrite(home, csv_corpus, bpe_tokenizer):
    path, _ = csv_corpus
    build_graph(path, bpe_tokenizer, name="g", progress=False)
    with pytest.raises(GraphExistsError, match="--overwrite"):
        build_graph(path, bpe_tokenizer, name="g", progress=False)
    build_graph(path, bpe_tokenizer, name="g", overwrite=True, progress=False)
    assert list_graphs() == ["g"]


def test_failed_build_leaves_the_previous_graph_intact(home, tmp_path, csv_corpus, bpe_tokenizer):
    path, _ = csv_corpus
    before = _all_bytes(build_graph(path, bpe_tokenizer, name="g", progress=False).path)
    bad = tmp_path / "z.csv"
    bad.write_text("body\nsome text\n")
    with pytest.raises(CorpusError, match="no column 'text'"):
        build_graph([path, bad], bpe_tokenizer, name="g", overwrite=True, progress=False)
    assert _all_bytes(home / "graphs" / "g") == before
    assert sorted(p.name for p in (home / "graphs").iterdir()) == ["g"]  # no temp folder left behind


def test_truncated_or_corrupted_shard_is_detected(tmp_path, csv_corpus, bpe_tokenizer):
    path, _ = csv_corpus
    g = build_graph(path, bpe_tokenizer, path=tmp_path / "g", progress=False)
    data = g.path / "order1" / "shard-00000" / "data.npy"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(GraphFormatError, match="checksum"):
        load_graph(g.path).matrix
    data.write_bytes(bytes(raw[:-8]))
    with pytest.raises(GraphFormatError, match="truncated"):
        load_graph(g.path, verify=False).matrix


def test_tokenizer_that_cannot_be_loaded(tmp_path):
    with pytest.raises(TokenizerError, match="cannot load the tokenizer"):
        load_tokenizer(tmp_path / "nope.gguf")
    with pytest.raises(TokenizerError, match="cannot load the tokenizer"):
        load_tokenizer("no-such-org/no-such-model")


def test_bos_eos_edges(tmp_path, bpe_tokenizer):
    (tmp_path / "c.txt").write_text("the movie\n")
    g = build_graph(tmp_path / "c.txt", bpe_tokenizer, path=tmp_path / "g", bos_eos=True, progress=False)
    ids = bpe_tokenizer("the movie", add_special_tokens=False)["input_ids"]
    seq = [bpe_tokenizer.bos_token_id, *ids, bpe_tokenizer.eos_token_id]
    coo = g.counts.tocoo()
    assert set(zip(coo.row.tolist(), coo.col.tolist())) == set(zip(seq, seq[1:]))


def test_cli_build_list_info(home, csv_corpus, bpe_tokenizer_file, capsys):
    path, _ = csv_corpus
    assert main(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "cli",
                 "--orders", "1,2", "--prune-top-k", "5"]) == 0
    out = capsys.readouterr().out
    assert "120 documents" in out and "order2" in out
    assert main(["graphs", "list"]) == 0 and "cli" in capsys.readouterr().out
    assert main(["graphs", "info", "cli"]) == 0 and "distinct bigrams" in capsys.readouterr().out
    assert main(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "cli"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_cli_build_reads_a_corpus_file_named_like_a_glob_as_that_file(home, tmp_path, bpe_tokenizer_file, capsys):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    docs = make_docs(30, seed=5)
    for name, part in (("reviews [2019].csv", docs[:10]), ("*.csv", docs[10:20]), ("other.csv", docs[20:])):
        pacsv.write_csv(pa.table({"text": part}), tmp_path / name)
    for name in ("reviews [2019].csv", "*.csv"):
        with pytest.warns() if name == "*.csv" else contextlib.nullcontext():
            assert main(["build", str(tmp_path / name), "--tokenizer", str(bpe_tokenizer_file), "--path",
                         str(tmp_path / f"g{len(name)}")]) == 0, capsys.readouterr().err
        files = load_graph(tmp_path / f"g{len(name)}").manifest["corpus"]["files"]
        assert [Path(f["path"]).name for f in files] == [name]
        assert "10 documents" in capsys.readouterr().out


def test_cli_build_with_ngrams_in_sorted_runs(home, csv_corpus, bpe_tokenizer_file, bpe_tokenizer, capsys):
    from gm_graphs.build import ngram_tables

    path, _ = csv_corpus
    assert main(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "ng", "--ngrams", "3",
                 "--ngram-run-entries", "60"]) == 0
    in_memory = ngram_tables.count_ngrams(path, bpe_tokenizer, (3,), progress=False)[3]
    stored = load_graph("ng").ngrams[3]
    assert np.array_equal(stored.count_values(), in_memory.count_values())
    assert np.array_equal(stored.keys(), in_memory.keys())
    with pytest.raises(SystemExit):
        main(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "ng2", "--ngrams", "3",
              "--ngram-run-entries", "0"])
    assert "must be an integer >= 1" in capsys.readouterr().err


def test_real_drug_reviews_with_the_real_smollm2_tokenizer(drug_graph, smollm2_tokenizer):
    from gm_graphs import bundled
    from gm_graphs.corpus.read import expand_corpus, iter_documents

    expected = Counter()
    for batch in iter_documents(expand_corpus(bundled.drug_reviews_zip()), "review", clean=True):
        for d in batch:
            ids = smollm2_tokenizer(d, add_special_tokens=False)["input_ids"]
            expected.update(zip(ids, ids[1:]))
    coo = drug_graph.counts.tocoo()
    assert dict(zip(zip(coo.row.tolist(), coo.col.tolist()), coo.data.tolist())) == dict(expected)
    m = drug_graph.manifest
    assert m["corpus"]["documents"] == 979 and m["tokenizer"]["vocab_size"] == 49152
    assert sp.isspmatrix_csr(drug_graph.matrix) and drug_graph.matrix.shape == (49152, 49152)
    kept = load_graph(drug_graph.path, order=2).row_mass_kept
    assert 0 < float(np.min(kept)) <= 1.0
