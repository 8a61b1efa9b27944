"""Bigram counts: equal to an independent count, never bridging documents, merging associatively."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gm_graphs.count.bigrams import BigramCounts, key_dtype
from gm_graphs.count.runs import SortedRuns

from .helpers import docs_strategy, encode_docs


def _count(vocab_size: int, docs, buffer_pairs: int = 1 << 24) -> BigramCounts:
    """The bigram counts of ``docs`` as a build counts them: sorted runs of ``buffer_pairs`` merged."""
    ids, offsets = encode_docs(docs)
    runs = SortedRuns(2, vocab_size, buffer_pairs)
    runs.add(ids, offsets)
    keys, counts = runs.merged()
    return BigramCounts(vocab_size, keys.astype(key_dtype(vocab_size)), counts, len(docs), int(ids.size))


def _as_dict(c: BigramCounts) -> dict:
    src, dst = c.src_dst()
    return {(int(s), int(d)): int(n) for s, d, n in zip(src, dst, c.counts)}


@given(docs=docs_strategy, buffer=st.integers(1, 50))
def test_counts_equal_an_independent_count_and_never_bridge_documents(docs, buffer):
    expected = Counter((d[i], d[i + 1]) for d in docs for i in range(len(d) - 1))
    result = _count(12, docs, buffer)
    assert _as_dict(result) == dict(expected)
    assert result.tokens == sum(map(len, docs)) and result.documents == len(docs)
    assert np.all(np.diff(result.keys.astype(np.int64)) > 0)


@given(docs=docs_strategy, cuts=st.lists(st.integers(0, 12), max_size=3), order=st.randoms())
def test_partial_counts_merge_to_the_full_count_in_any_order(docs, cuts, order):
    full = _count(12, docs)
    bounds = sorted({0, len(docs), *[min(c, len(docs)) for c in cuts]})
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        parts.append(_count(12, docs[a:b]))
    order.shuffle(parts)
    merged = parts[0]
    for p in parts[1:]:
        merged = merged.merge(p)
    assert merged.keys.tobytes() == full.keys.tobytes() and merged.counts.tobytes() == full.counts.tobytes()
    assert (merged.documents, merged.tokens) == (full.documents, full.tokens)


def test_csr_round_trip_and_wide_vocabulary_keys():
    big = 70_000  # N² > 2³²: keys need uint64
    c = _count(big, [[69_999, 5, 69_999, 5]])
    assert c.keys.dtype == np.uint64
    assert _as_dict(c) == {(69_999, 5): 2, (5, 69_999): 1}
    back = BigramCounts.from_csr(c.to_csr(), c.documents, c.tokens)
    assert _as_dict(back) == _as_dict(c)


# ---- packed entries and sorted runs -------------------------------------------------------------------------------

@given(keys=st.lists(st.integers(0, 40), max_size=80), bits=st.integers(1, 6))
def test_packed_entries_split_large_counts_and_sum_back(keys, bits):
    from gm_graphs.count.bigrams import pack_keys, unpack

    packed = pack_keys(np.array(keys, dtype=np.uint64), bits)
    assert np.all(np.diff(packed.astype(np.float64)) >= 0)
    assert np.all(packed & np.uint64((1 << bits) - 1) >= 1)  # every entry carries a count of 1 … 2^bits − 1
    k, c = unpack(packed, bits)
    assert dict(zip(k.tolist(), c.tolist())) == dict(Counter(keys))
