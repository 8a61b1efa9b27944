"""Ã² pruned by the fused kernel (``square_blocks``): the indices and values of scipy's product pruned, to the bit,
whether a row is summed whole or bounded (groups of columns that cannot be kept left unsummed)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from gm_graphs import PruneRule, load_graph
from gm_graphs.powers import (
    _BOUNDED,
    _FIELDS,
    OperatorSpec,
    _bounds_split,
    _merge_successors,
    _square_blocks,
    _SquareLayout,
    _sum_selected,
    build_operators,
    normalize,
    prune,
    square_blocks,
)

from .helpers import FRAC_RTOL, assert_same_blocks


def _layout(base: sp.csr_matrix, prefix: int, group: int, rows: str) -> _SquareLayout:
    """``base``'s layout with every row bounded (``rows="bounded"``), none, or as the cost model chose."""
    layout = _SquareLayout.of(base, prefix, group)
    assert layout.prefix == prefix  # base is boundable: sorted, values finite and ≥ 0
    if rows != "model":
        layout.meta[_BOUNDED::_FIELDS] = rows == "bounded"
    return layout


def _random_base(seed: int, n: int, density: float, zeros: bool) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    counts = sp.random(n, n, density=density, random_state=rng, format="csr",
                       data_rvs=lambda k: rng.integers(1, 5, k).astype(np.float64))
    counts.data[rng.random(counts.nnz) < 0.2] = 3  # ties
    empty = np.ones(n)
    empty[rng.choice(n, max(1, n // 7), replace=False)] = 0  # rows without successors
    counts = sp.csr_matrix(sp.diags(empty) @ counts)
    counts.eliminate_zeros()
    counts.sort_indices()  # as Ã is written (the product above leaves each row's columns unsorted)
    if zeros and counts.nnz:  # explicit zeros: products that are 0
        counts.data[rng.random(counts.nnz) < 0.1] = 0
    return normalize(counts, 1e-8)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 90), density=st.floats(0.01, 0.6),
       top_k=st.sampled_from([None, 1, 3, 8, 64]), min_value=st.sampled_from([0.0, 0.02, 0.2]),
       split=st.sampled_from([(1, 1), (2, 2), (4, 2), (6, 3), (8, 8), (16, 4), (96, 8)]),
       rows=st.sampled_from(["bounded", "whole", "model"]), zeros=st.booleans(), block_rows=st.integers(1, 100),
       workers=st.integers(1, 2))
def test_bounded_and_whole_rows_keep_the_product_bits(seed, n, density, top_k, min_value, split, rows, zeros,
                                                       block_rows, workers):
    base = _random_base(seed, n, density, zeros)
    rule = PruneRule(top_k=top_k, min_value=min_value)
    fast = list(_square_blocks(_layout(base, *split, rows), rule, block_rows=block_rows, workers=workers,
                               progress=False))
    slow = list(build_operators(base, [OperatorSpec("power", 2)], rule, block_rows=block_rows, progress=False))
    # whole rows (and top_k=None, which never bounds) sum every column in order: their total is scipy's
    assert_same_blocks(fast, slow, exact_frac=rows == "whole" or top_k is None)


def _zipf_base(seed: int, n: int, successors: int) -> sp.csr_matrix:
    """Bigram counts of a Zipfian stream (frequent tokens have small ids), normalised: a small Ã of a corpus."""
    rng = np.random.default_rng(seed)
    tokens = np.minimum(rng.zipf(1.25, successors), n) - 1
    pairs = np.stack([tokens[:-1], tokens[1:]])
    counts = sp.csr_matrix((np.ones(pairs.shape[1]), (pairs[0], pairs[1])), shape=(n, n))
    counts.sum_duplicates()
    return normalize(counts, 1e-8)


def _groups_below_threshold(base: sp.csr_matrix, layout: _SquareLayout, rows: np.ndarray, top_k: int) -> int:
    """How many (row, group) pairs of products a bounded row leaves unsummed, found from the exact product."""
    exact = (base[rows].astype(np.float64) @ base.astype(np.float64)).toarray()
    prefix, group = layout.prefix, layout.group
    n_groups = -(-base.shape[0] // group)
    skipped = 0
    for i, row in zip(rows, exact):
        threshold = np.sort(row[:prefix])[-top_k]
        bound = np.zeros(n_groups)
        for p in range(base.indptr[i], base.indptr[i + 1]):
            rec = _FIELDS * base.indices[p]
            runs = slice(layout.meta[rec + 3], layout.meta[rec + 4])  # _RUNS, _RUNS_END
            np.add.at(bound, layout.run_group[runs].astype(np.int64), base.data[p] * layout.run_max[runs])
        skipped += int(np.sum((bound > 0) & (bound * (1 + 1e-6) < threshold)))
    return skipped


@pytest.mark.parametrize("top_k", [64, 8])
def test_a_zipfian_graph_skips_groups_and_keeps_the_product_bits(top_k):
    base = _zipf_base(0, 4096, 400_000)
    layout = _SquareLayout.of(base, *_bounds_split(4096))
    bounded = np.flatnonzero(layout.meta[_BOUNDED::_FIELDS])
    assert bounded.size > 100  # the cost model bounds the heavy rows
    assert _groups_below_threshold(base, layout, bounded[:50], top_k) > 0  # and they skip groups
    rule = PruneRule(top_k=top_k)
    fast = list(square_blocks(base, rule, block_rows=512, workers=2, progress=False))
    slow = list(build_operators(base, [OperatorSpec("power", 2)], rule, block_rows=512, progress=False))
    assert_same_blocks(fast, slow)


@pytest.mark.parametrize("capacity", [1, 7, 64])
def test_selected_runs_summed_in_chunks_are_summed_as_at_once(capacity):
    """The list of selected runs is summed whenever it fills: in order, so each column's sum is the same."""
    base = _random_base(11, 80, 0.3, False)
    layout = _SquareLayout.of(base, 8, 4)
    rows = np.arange(0, 80, 3, dtype=np.int64)
    n_groups = 20
    m, ks, places, ws = _merge_successors(layout.meta, layout.cols, layout.data, rows, np.zeros(81, np.int64),
                                          np.empty(1, np.int64), np.empty(1, np.int64), np.empty(1))
    rng = np.random.default_rng(0)
    selected = (rng.random((rows.size, n_groups)) < 0.5).astype(np.uint8)
    selected[:, :2] = 0  # groups below the prefix are never selected
    last = np.array([np.flatnonzero(s).max(initial=1) for s in selected], dtype=np.int64)
    sums = []
    for size in (capacity, 1 << 16):
        acc = np.zeros((rows.size, 80))
        _sum_selected(layout.meta, layout.cols, layout.data, layout.run_group, layout.run_start, m, ks, places, ws,
                      selected, last, acc, np.empty(3 * size, np.int64), np.empty(size))
        sums.append(acc)
    assert sums[0].tobytes() == sums[1].tobytes() and sums[1].any()


def test_unsorted_duplicated_or_negative_rows_are_summed_whole_in_stored_order():
    base = _random_base(3, 40, 0.3, False)
    rows = np.repeat(np.arange(base.shape[0]), np.diff(base.indptr))
    descending = np.lexsort((-base.indices, rows))  # each row's entries in descending columns
    unsorted = sp.csr_matrix((base.data[descending], base.indices[descending], base.indptr), shape=base.shape)
    assert not unsorted.has_sorted_indices
    twice = np.repeat(np.arange(base.nnz), 2)  # every entry stored twice, each half its value, columns sorted
    duplicated = sp.csr_matrix((base.data[twice] / 2, base.indices[twice], 2 * base.indptr), shape=base.shape)
    assert duplicated.has_sorted_indices and not duplicated.has_canonical_format
    negative = base.copy()
    negative.data[::5] *= -1
    for matrix in (unsorted, duplicated, negative):
        assert not _SquareLayout.of(matrix, 2, 1).meta[_BOUNDED::_FIELDS].any()
    for matrix in (unsorted, negative):  # (scipy adds up duplicates before multiplying: not the stored order)
        fast = list(square_blocks(matrix, PruneRule(top_k=3), block_rows=7, progress=False))
        slow = list(build_operators(matrix, [OperatorSpec("power", 2)], PruneRule(top_k=3), block_rows=7,
                                    progress=False))
        assert_same_blocks(fast, slow, exact_frac=True)


def test_the_prefix_is_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="multiple"):
        _SquareLayout.of(sp.identity(8, format="csr", dtype=np.float32), 6, 4)


@pytest.mark.skipif(not os.environ.get("GRAPHMAX_SQUARE_GRAPH"),
                    reason="set GRAPHMAX_SQUARE_GRAPH to a built graph's folder (e.g. the 4M synthetic one)")
def test_rows_of_a_real_graph_keep_the_product_bits():
    """Blocks of rows of a real Ã (the heaviest and others spread over it) against scipy's product pruned."""
    base = load_graph(Path(os.environ["GRAPHMAX_SQUARE_GRAPH"])).base
    n = base.shape[0]
    a64 = base.astype(np.float64)
    work = sp.csr_matrix((np.ones(base.nnz), base.indices, base.indptr), shape=base.shape) @ np.diff(base.indptr)
    starts = sorted({int(np.argmax(work)) // 16 * 16, *np.linspace(0, n - 16, 12).astype(int).tolist()})
    layout = _SquareLayout.of(base, *_bounds_split(n))
    scratch = layout.scratch()
    rule = PruneRule()
    for r0 in starts:
        ptr, idx, val, kept, total = layout.rows(r0, r0 + 16, rule, scratch)
        expected, expected_kept = prune(a64[r0:r0 + 16] @ a64, rule)
        assert np.array_equal(ptr, expected.indptr) and np.array_equal(idx, expected.indices)
        assert val.astype(np.float32).tobytes() == expected.data.tobytes()
        with np.errstate(invalid="ignore", divide="ignore"):
            np.testing.assert_allclose(np.where(total > 0, kept / total, 1.0), expected_kept, rtol=FRAC_RTOL)
