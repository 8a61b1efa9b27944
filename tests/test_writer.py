"""Streamed graph writing: the same bytes whatever the range cuts, shards and the fused Ã² kernel."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import assume, given
from hypothesis import strategies as st

from gm_graphs import PruneRule, load_graph
from gm_graphs.build.graph_source import GraphSource, write_graph_into
from gm_graphs.build.ngram_tables import read_tables
from gm_graphs.build.options import BuildOptions
from gm_graphs.count import ngram_trie
from gm_graphs.count.bigrams import BigramCounts
from gm_graphs.count.ngram_counts import NgramCounts
from gm_graphs.errors import GraphFormatError
from gm_graphs.format import validate
from gm_graphs.format.writer import LaidOutRange, OrderRanges, write_ngrams, write_range
from gm_graphs.powers import OperatorSpec, build_operators, normalize, square_blocks
from gm_graphs.tokenize.encoder import TokenizerIdentity

from .helpers import assert_same_blocks, make_docs


def _source(counts: BigramCounts, cut: int) -> GraphSource:
    corpus = {"files": [], "documents": 1, "empty_skipped": 0, "undecodable_documents": 0, "replaced_sequences": 0,
              "per_file": {}, "options": {"text_column": "text"}, "tokens": 2}
    return GraphSource(TokenizerIdentity("t", counts.vocab_size, "0" * 64), corpus, lambda: counts.ranges(cut))


def _counts(seed: int, n: int = 40, nnz: int = 300) -> BigramCounts:
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, n * n, nnz)).astype(np.uint32)
    return BigramCounts(n, keys, rng.integers(1, 9, keys.size).astype(np.int64))


@pytest.mark.parametrize("shard_nnz", [7, 1 << 20])
def test_written_bytes_do_not_depend_on_where_ranges_are_cut(tmp_path, shard_nnz):
    counts = _counts(0)
    outputs = []
    for cut in (1, 13, 10_000):
        folder = tmp_path / f"cut{cut}"
        folder.mkdir()
        options = BuildOptions(orders=(1, 2), eps=1e-8, prune=PruneRule(top_k=3), shard_nnz=shard_nnz)
        write_graph_into(folder, _source(counts, cut), name="g", options=options, progress=False)
        outputs.append({p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
                        if p.is_file()})
    assert outputs[0] == outputs[1] == outputs[2]
    g = load_graph(tmp_path / "cut13")
    assert (len(g.manifest["counts"]["shards"]) > 1) == (shard_nnz == 7)
    coo = g.counts.tocoo()
    src, dst = counts.src_dst()
    assert Counter(dict(zip(zip(coo.row.tolist(), coo.col.tolist()), coo.data.tolist()))) == \
        Counter(dict(zip(zip(src.tolist(), dst.tolist()), counts.counts.tolist())))
    expected = normalize(counts.to_csr(), 1e-8)
    assert g.matrix.data.tobytes() == expected.data.tobytes()
    # a shard holds at most shard_nnz entries, or one row that alone has more
    assert all(sh["nnz"] <= shard_nnz or sh["rows"][1] - sh["rows"][0] == 1 for sh in g.manifest["counts"]["shards"])


@given(seed=st.integers(0, 10_000), n=st.integers(2, 60), density=st.floats(0.01, 0.5),
       top_k=st.sampled_from([None, 1, 3, 8]), min_value=st.sampled_from([0.0, 0.02]),
       block_rows=st.integers(1, 17), workers=st.integers(1, 2))
def test_fused_square_kernel_equals_the_product_pruned_to_the_bit(seed, n, density, top_k, min_value, block_rows,
                                                                 workers):
    rng = np.random.default_rng(seed)
    counts = sp.random(n, n, density=density, random_state=rng, format="csr",
                       data_rvs=lambda k: rng.integers(1, 5, k).astype(np.float64)).astype(np.int64)
    counts.data[rng.random(counts.nnz) < 0.1] = 3  # ties
    base = normalize(counts, 1e-8)
    rule = PruneRule(top_k=top_k, min_value=min_value)
    fast = list(square_blocks(base, rule, block_rows=block_rows, workers=workers, progress=False))
    slow = list(build_operators(base, [OperatorSpec("power", 2)], rule, block_rows=block_rows, progress=False))
    assert_same_blocks(fast, slow)  # the mass kept to float64 rounding: see tests/test_square.py


def test_square_needs_a_square_matrix():
    with pytest.raises(ValueError, match="square"):
        list(square_blocks(sp.csr_matrix((2, 3), dtype=np.float32), PruneRule(), progress=False))


def test_a_mixture_and_powers_are_written_beside_order1(tmp_path: Path):
    folder = tmp_path / "g"
    folder.mkdir()
    options = BuildOptions(orders=(1, 2), mixture=2, eps=0.0, shard_nnz=1 << 20)
    write_graph_into(folder, _source(_counts(1), 50), name="g", options=options, progress=False)
    g = load_graph(folder, order=2)
    assert sorted(g.manifest["operators"]) == ["mixture2", "order1", "order2"]
    assert g.manifest["build"] == {}  # what write_graph_into was given


@given(seed=st.integers(0, 2**32 - 1), n=st.sampled_from([2, 7, 60, 70_000]), entries=st.integers(1, 400),
       cuts=st.integers(1, 6), largest=st.sampled_from([2, 300, 2**31 - 1, 1 << 40]), laid=st.integers(0, 127),
       orders=st.sampled_from([(3,), (3, 4), (4,)]))
def test_ngram_tables_equal_a_direct_count_whatever_the_ranges(tmp_path_factory, seed, n, entries, cuts, largest,
                                                               laid, orders):
    """Ranges handed over as arrays, or laid out in files first (``write_range``, as Ray's merge tasks do; bit i of
    ``laid`` for range i), make the same trie, which gives back every key and count (wide ones from the side
    tables) and equals the one encoded in memory."""
    assume(n ** orders[-1] < 2**63)
    rng = np.random.default_rng(seed)
    top = np.unique(rng.integers(0, n ** orders[-1], entries)).astype(np.int64)
    tables = {}
    for order in orders:  # every order's n-grams are the prefixes of the top order's (one corpus)
        keys = np.unique(top // n ** (orders[-1] - order))
        tables[order] = keys, rng.integers(1, largest, keys.size, endpoint=True)
    root = tmp_path_factory.mktemp("ngrams")

    def ranges(order):
        keys, counts = tables[order]
        changes = np.flatnonzero(np.diff(keys // n)) + 1  # cut at context changes, as SortedRuns.ranges does
        edges = [0, *sorted(rng.choice(changes, min(cuts, changes.size), replace=False).tolist()), keys.size]
        for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
            if laid >> i & 1:
                yield LaidOutRange(root / "laid", write_range(root / "laid", order, i, n, keys[a:b], counts[a:b]))
            else:
                yield keys[a:b], counts[a:b]

    entry = write_ngrams(root, "ng", n, ((o, int(tables[o][1].sum()), ranges(o)) for o in orders), None)
    stored = read_tables(root / "ng", n, entry)
    for order in orders:
        keys, counts = tables[order]
        np.testing.assert_array_equal(stored[order].keys(), keys)
        np.testing.assert_array_equal(stored[order].count_values(), counts)
        assert entry["orders"][str(order)] == {"contexts": np.unique(keys // n).size, "entries": keys.size}
        memory = NgramCounts.from_keys(order, keys, counts, n)
        np.testing.assert_array_equal(memory.keys(), keys)
        for part in ("next", "counts"):
            np.testing.assert_array_equal(memory.table.arrays[part], stored[order].table.arrays[part])
        assert stored[order].table.arrays["next"].dtype == (np.uint16 if n <= 65536 else np.int32)
        assert stored[order].table.arrays["counts"].dtype == np.uint8
        ctx = keys[rng.integers(keys.size)] // n
        nxt, cnt = stored[order].successors([ctx // n ** j % n for j in range(order - 2, -1, -1)])
        np.testing.assert_array_equal(nxt, keys[keys // n == ctx] % n)
        np.testing.assert_array_equal(cnt, counts[keys // n == ctx])


@given(seed=st.integers(0, 2**32 - 1), n=st.sampled_from([3, 9, 300]), width=st.integers(1, 3),
       entries=st.integers(1, 300), calls=st.integers(1, 4), foreign=st.booleans())
def test_contexts_located_in_one_pass_are_the_nodes_a_walk_from_the_root_finds(seed, n, width, entries, calls,
                                                                              foreign):
    """``HigherOrder`` locates its ascending contexts incrementally (``ngram_trie._locate``, its state carried
    from call to call): each node equals ``find_context``'s, and a context the trie lacks stops it there."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, n ** (width + 1), entries)).astype(np.int64)
    # the levels of lengths 2 … width (at width 1, a level the walk never reads, for the tuple's type)
    levels = NgramCounts.from_keys(width + 1, keys, np.ones(keys.size, np.int64), n).kernel_views()[:max(1, width - 1)]
    contexts = np.unique(keys // n)
    if foreign:  # a context of 2 tokens or more outside the trie (at width 1 every token is a node)
        assume(width > 1)
        candidates = rng.integers(0, n ** width, 64)
        missing = candidates[~np.isin(candidates, contexts)]
        assume(missing.size)
        contexts = np.unique(np.append(contexts, missing[0]))
    digits, path = np.full(width, -1, np.int64), np.full(width, -1, np.int64)
    found, stop = np.full(contexts.size, -2, np.int64), -1
    cuts = [0, *sorted(rng.integers(0, contexts.size + 1, calls - 1).tolist()), contexts.size]
    for a, b in zip(cuts[:-1], cuts[1:]):
        got = ngram_trie._locate(levels, contexts[a:b], width, np.int64(n),
                                 digits, path, found[a:b])
        if got >= 0:
            stop = a + got
            break
    for i, c in enumerate(contexts[:stop if stop >= 0 else None]):
        tokens = np.array([c // n ** j % n for j in range(width - 1, -1, -1)], np.int64)
        assert found[i] == ngram_trie.find_context(levels, tokens, 0, width, n)
    assert (stop >= 0) == foreign
    if foreign:
        assert contexts[stop] not in np.unique(keys // n)


def test_indptr_offsets_past_uint16_come_from_the_side_table(tmp_path):
    """Contexts with tens of thousands of successors push a block's offsets past 65,535: the trie stores them in
    the side table, and the loaded, checked table reads every context's successors back."""
    n = 70_000
    keys = np.concatenate([(c * n * n) + np.arange(0, 2 * 40_000, 2) for c in (1, 2, 3)]).astype(np.int64)
    counts = np.ones(keys.size, dtype=np.int64)
    entry = write_ngrams(tmp_path, "ng", n, [(3, keys.size, [(keys, counts)])], None)
    level = read_tables(tmp_path / "ng", n, entry)[3].table
    assert level.arrays["indptr_wide_at"].size > 0
    validate.check_level("g", 3, level.arrays, entry["levels"]["3"]["parents"], keys.size, n, True)
    np.testing.assert_array_equal(read_tables(tmp_path / "ng", n, entry)[3].keys(), keys)


def test_a_table_with_more_ngrams_than_its_total_stops_its_writer():
    got = []
    w = OrderRanges(3, 10, 4, lambda *a: got.append(a))
    w.add(np.array([505, 507], dtype=np.int64), np.array([1, 2]))
    with pytest.raises(AssertionError, match="more n-grams than the 4 counted"):
        w.add(np.array([600], dtype=np.int64), np.array([2]))
    assert len(got) == 1 and w.counted == 5


@given(seed=st.integers(0, 2**16), cuts=st.integers(0, 6),
       fault=st.sampled_from([None, "context repeated", "context too large", "count 0", "next outside"]))
def test_the_writers_range_checks_find_what_the_loaded_tables_check_finds(seed, cuts, fault):
    """``ngram_range_problem`` over a table's ranges (what NgramWriter runs, so that a build need not read its tables
    back) flags a table exactly when ``check_ngram_table`` over the whole of it (what a load runs) refuses it."""
    n, order = 50, 3
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, n ** order, 400)).astype(np.int64)
    contexts, nxt, counts = keys // n, (keys % n).astype(np.int32), rng.integers(1, 9, keys.size)
    first = np.concatenate(([True], contexts[1:] != contexts[:-1]))
    table_contexts, indptr = contexts[first], np.append(np.flatnonzero(first), keys.size)
    at = int(rng.integers(1, table_contexts.size))
    if fault == "context repeated":
        table_contexts[at] = table_contexts[at - 1]
    elif fault == "context too large":
        table_contexts[-1] = n ** (order - 1)
    elif fault == "count 0":
        counts[rng.integers(keys.size)] = 0
    elif fault == "next outside":
        nxt[rng.integers(keys.size)] = n
    edges = [0, *sorted(rng.choice(np.arange(1, table_contexts.size), min(cuts, table_contexts.size - 1),
                                   replace=False).tolist()), table_contexts.size]
    problems, last = [], -1
    for a, b in zip(edges[:-1], edges[1:]):
        problems.append(validate.ngram_range_problem(order, table_contexts[a:b], nxt[indptr[a]:indptr[b]],
                                                     counts[indptr[a]:indptr[b]], n, last))
        last = int(table_contexts[b - 1])
    try:
        validate.check_v1_ngram_table("g", order, table_contexts, indptr, nxt, counts, n, table_contexts.size,
                                   keys.size)
        refused = False
    except GraphFormatError:
        refused = True
    assert refused == (fault is not None) == any(problems), (fault, problems)


@pytest.mark.parametrize("bad", ["out of order", "file cut short", "another order"])
def test_a_laid_out_range_that_does_not_fit_stops_the_writer_before_it_is_appended(tmp_path, bad):
    got = []
    w = OrderRanges(3, 10, 100, lambda *a: got.append(a))
    w.add(np.array([505, 507], dtype=np.int64), np.array([1, 2]))
    keys = np.array([501] if bad == "out of order" else [600, 601], dtype=np.int64)
    meta = write_range(tmp_path / "laid", 4 if bad == "another order" else 3, 1, 10, keys, np.ones(keys.size, int))
    laid = LaidOutRange(tmp_path / "laid", meta)
    if bad == "file cut short":
        with open(laid.path("next"), "r+b") as fh:
            fh.truncate(4)
    message = {"out of order": "first context is not above", "another order": "4-gram table came in its place",
               "file cut short": "next has 4 bytes, its writer reported 2 values"}[bad]
    with pytest.raises(AssertionError, match=message):
        w.add_written(laid)
    assert (w.entries, w.contexts, len(got)) == (2, 1, 1)  # refused before anything was appended


def test_write_range_refuses_a_range_it_would_lay_out_wrong(tmp_path):
    with pytest.raises(AssertionError, match="range 3 of the 3-gram table: count 1 of the range is 0"):
        write_range(tmp_path, 3, 3, 10, np.array([505, 507], np.int64), np.array([1, 0]))
    assert not (tmp_path / "3").exists()


@pytest.mark.parametrize("bad", ["out of order", "count 0"])
def test_a_range_the_writer_was_handed_wrong_stops_it_before_anything_is_written(tmp_path, bad):
    got = []
    w = OrderRanges(3, 10, 100, lambda *a: got.append(a))
    w.add(np.array([505, 507], dtype=np.int64), np.array([1, 2]))
    keys, counts = (np.array([501]), np.array([1])) if bad == "out of order" else (np.array([600]), np.array([0]))
    with pytest.raises(AssertionError, match="the 3-gram table being written"):
        w.add(keys, counts)
    assert w.entries == 2 and w.contexts == 1 and len(got) == 1  # the bad range was not appended


def test_a_build_trusts_the_ngram_tables_it_checked_as_it_wrote_them_and_a_load_elsewhere_checks_them(
        tmp_path, bpe_tokenizer, monkeypatch):
    from gm_graphs import build_graph

    calls = []
    original = validate.check_level
    monkeypatch.setattr(validate, "check_level", lambda *a: (calls.append(a[1]), original(*a))[1])
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(make_docs(80, seed=3)) + "\n")
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "home"))
    build_graph(str(corpus), bpe_tokenizer, path=tmp_path / "g", ngrams=(3, 4), progress=False)
    assert calls == []  # not read back
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "other-home"))  # no record of what was verified
    assert sorted(load_graph(tmp_path / "g").ngrams) == [3, 4]
    assert sorted(calls) == [2, 3, 4]  # the trie's levels
