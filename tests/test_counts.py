"""Bigram counts: equal to an independent count, never bridging documents, merging associatively."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gm_graphs.counts import BigramCounts, CountAccumulator

docs_strategy = st.lists(st.lists(st.integers(0, 11), min_size=0, max_size=12), min_size=1, max_size=12)


def _encode(docs):
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return np.array([t for d in docs for t in d], dtype=np.int32), offsets


def _as_dict(c: BigramCounts) -> dict:
    src, dst = c.src_dst()
    return {(int(s), int(d)): int(n) for s, d, n in zip(src, dst, c.counts)}


@given(docs=docs_strategy, buffer=st.integers(1, 50))
def test_counts_equal_an_independent_count_and_never_bridge_documents(docs, buffer):
    acc = CountAccumulator(12, buffer_pairs=buffer)
    acc.add(*_encode(docs))
    expected = Counter((d[i], d[i + 1]) for d in docs for i in range(len(d) - 1))
    result = acc.result()
    assert _as_dict(result) == dict(expected)
    assert result.tokens == sum(map(len, docs)) and result.documents == len(docs)
    assert np.all(np.diff(result.keys.astype(np.int64)) > 0)


@given(docs=docs_strategy, cuts=st.lists(st.integers(0, 12), max_size=3), order=st.randoms())
def test_partial_counts_merge_to_the_full_count_in_any_order(docs, cuts, order):
    full = CountAccumulator(12)
    full.add(*_encode(docs))
    full = full.result()
    bounds = sorted({0, len(docs), *[min(c, len(docs)) for c in cuts]})
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        acc = CountAccumulator(12)
        acc.add(*_encode(docs[a:b]))
        parts.append(acc.result())
    order.shuffle(parts)
    merged = parts[0]
    for p in parts[1:]:
        merged = merged.merge(p)
    assert merged.keys.tobytes() == full.keys.tobytes() and merged.counts.tobytes() == full.counts.tobytes()
    assert (merged.documents, merged.tokens) == (full.documents, full.tokens)


def test_csr_round_trip_and_wide_vocabulary_keys():
    big = 70_000  # N² > 2³²: keys need uint64
    acc = CountAccumulator(big)
    acc.add(np.array([69_999, 5, 69_999, 5], dtype=np.int32), np.array([0, 4]))
    c = acc.result()
    assert c.keys.dtype == np.uint64
    assert _as_dict(c) == {(69_999, 5): 2, (5, 69_999): 1}
    back = BigramCounts.from_csr(c.to_csr(), c.documents, c.tokens)
    assert _as_dict(back) == _as_dict(c)
