"""Sorted runs (gm_graphs.count.runs): merged to an independent count in ranges of whole contexts, ranges of
about max_entries, nested orders, a count above the shorter orders' cap, and the feeders."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gm_graphs.count.runs import SortedRuns

from .helpers import docs_strategy, encode_docs


def _windows(docs, order, inset=0):
    out = Counter()
    for d in docs:
        d = d[inset:len(d) - inset] if inset else d
        out.update(tuple(d[i:i + order]) for i in range(len(d) - order + 1))
    return out


@given(docs=docs_strategy, order=st.integers(2, 4), run_entries=st.integers(1, 40), on_disk=st.booleans(),
       max_entries=st.integers(1, 30), inset=st.integers(0, 1))
def test_sorted_runs_merge_to_an_independent_count_in_ranges_of_whole_contexts(tmp_path_factory, docs, order,
                                                                              run_entries, on_disk, max_entries,
                                                                              inset):

    folder = tmp_path_factory.mktemp("runs") if on_disk else None
    runs = SortedRuns(order, 12, run_entries, folder, inset=inset)
    ids, offsets = encode_docs(docs)
    half = len(docs) // 2  # two batches: documents never span batches, windows never span documents
    runs.add(ids[:offsets[half]], offsets[:half + 1])
    runs.add(ids[offsets[half]:], offsets[half:] - offsets[half])
    ranges = list(runs.ranges(max_entries, workers=2))
    got = Counter()
    last_context = -1
    for keys, counts in ranges:
        contexts = keys // 12
        assert np.all(np.diff(keys) > 0) and contexts[0] > last_context  # ascending, a context in one range only
        last_context = contexts[-1]
        for key, c in zip(keys.tolist(), counts.tolist()):
            window = []
            for _ in range(order):
                key, t = divmod(key, 12)
                window.insert(0, t)
            got[tuple(window)] += c
    assert got == _windows(docs, order, inset)
    assert runs.windows == sum(_windows(docs, order, inset).values())
    runs.remove()
    if folder is not None:
        assert list(folder.iterdir()) == []


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(1000, 20000), run_entries=st.integers(200, 2000),
       max_entries=st.integers(50, 5000), sample=st.integers(4, 32))
def test_ranges_hold_about_max_entries_whatever_the_number_of_runs(tmp_path_factory, seed, tokens, run_entries,
                                                                  max_entries, sample):
    """Ranges are cut every max_entries entries of all runs together, not of each run: with r runs, cutting per run
    made r times more ranges than asked for, each read from every run in r small pieces."""
    from gm_graphs.count import runs as runs_module

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, tokens).astype(np.int32)
    offsets = np.array([0, tokens], dtype=np.int64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runs_module, "SAMPLE", sample)
        runs = runs_module.SortedRuns(4, 1000, run_entries, tmp_path_factory.mktemp("runs"))
        runs.add(ids, offsets)
        runs.release()
        total = sum(r.length for r in runs.runs)
        samples = total // sample + len(runs.runs)  # each run keeps ceil(length / SAMPLE) samples
        got = list(runs.ranges(max_entries))
        assert sum(k.size for k, _ in got) <= total
        assert len(got) <= samples // max(1, max_entries // sample) + 1
        runs.remove()


@given(docs=docs_strategy, low=st.integers(2, 3), high=st.integers(3, 5), run_entries=st.integers(1, 40),
       on_disk=st.booleans(), inset=st.integers(0, 1), cuts=st.lists(st.integers(0, 12), max_size=3))
def test_nested_runs_count_every_order_as_its_own_sorted_runs_do(tmp_path_factory, docs, low, high, run_entries,
                                                                 on_disk, inset, cuts):
    """Orders low..high from one sort of the longest windows: the same counts and windows as a SortedRuns per
    order, whatever the batches, the buffer (batches larger than it included) and the documents' lengths."""
    from gm_graphs.count.runs import NestedRuns, feeders

    high = max(low + 1, high)

    def counters(tag):
        return {o: SortedRuns(o, 12, run_entries, tmp_path_factory.mktemp(tag) if on_disk else None, inset=inset)
                for o in range(low, high + 1)}

    alone, nested = counters("alone"), counters("nested")
    feed = feeders(nested.values())
    assert len(feed) == 1 and isinstance(feed[0], NestedRuns)
    ids, offsets = encode_docs(docs)
    edges = sorted({0, len(docs), *(min(c, len(docs)) for c in cuts)})
    for lo, hi in zip(edges, edges[1:]):
        batch = ids[offsets[lo]:offsets[hi]], offsets[lo:hi + 1] - offsets[lo]
        for runs in alone.values():
            runs.add(*batch)
        feed[0].add(*batch)
    feed[0].release()
    for order in alone:
        want, got = alone[order].merged(), nested[order].merged()
        assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])
        assert nested[order].windows == alone[order].windows == sum(_windows(docs, order, inset).values())


def test_nested_runs_split_a_count_above_the_shorter_orders_cap():
    """Over SmolLM2's 49,152 tokens a 4-gram entry holds a count of 1 and a 3-gram entry up to 2¹⁷ − 1: a trigram
    seen 140,000 times in one run is two entries, and sums back."""
    from gm_graphs.count.runs import feeders

    docs = [[5, 6, 7, 8]] * 70_000 + [[5, 6, 7]] * 70_000 + [[9, 5, 6, 7, 8, 1]] * 3
    ids, offsets = encode_docs(docs)
    alone = {o: SortedRuns(o, 49_152, 1 << 22) for o in (2, 3, 4)}
    nested = {o: SortedRuns(o, 49_152, 1 << 22) for o in (2, 3, 4)}
    for runs in alone.values():
        runs.add(ids, offsets)
    (feed,) = feeders(nested.values())
    feed.add(ids, offsets)
    feed.release()
    assert nested[3].runs[0].length == 5  # (5, 6, 7) split in two
    for order in (2, 3, 4):
        want, got = alone[order].merged(), nested[order].merged()
        assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])
    assert alone[3].merged()[1].max() == 140_003


def test_feeders_nest_consecutive_orders_with_one_inset():
    from gm_graphs.count.runs import NestedRuns, feeders

    def kinds(specs):
        return sorted((type(f).__name__, tuple(r.order for r in f.runs) if isinstance(f, NestedRuns) else f.order)
                      for f in feeders([SortedRuns(o, 50, 8, inset=i) for o, i in specs]))

    assert kinds([(2, 0), (3, 0), (4, 0)]) == [("NestedRuns", (2, 3, 4))]
    assert kinds([(2, 0), (3, 1), (4, 1)]) == [("NestedRuns", (3, 4)), ("SortedRuns", 2)]  # --bos-eos
    assert kinds([(2, 0), (4, 0)]) == [("SortedRuns", 2), ("SortedRuns", 4)]
    assert kinds([(3, 0)]) == [("SortedRuns", 3)]
    with pytest.raises(ValueError, match="consecutive orders"):
        NestedRuns([SortedRuns(2, 50, 8), SortedRuns(4, 50, 8)])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 700), sample=st.sampled_from([1, 4, 64]),
       spread=st.sampled_from([3, 1 << 20, 1 << 62]), reads=st.integers(1, 5))
def test_a_run_on_disk_reads_back_its_entries_over_any_blocks(tmp_path_factory, seed, length, sample, spread, reads):
    """A run written compressed (differences by byte plane, LZ4) gives back the same entries over any range of
    whole blocks, whatever the entries' spacing (repeats included) and the top bit."""
    from gm_graphs.count import runs as runs_module

    rng = np.random.default_rng(seed)
    packed = np.sort(rng.integers(0, spread, length, dtype=np.uint64) + np.uint64(rng.integers(0, 2) << 63))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runs_module, "SAMPLE", sample)
        runs = SortedRuns(2, 12, length, tmp_path_factory.mktemp("runs"))
        runs.add_run(packed, length)
        run = runs.runs[0]
        assert run.path.stat().st_size == runs.bytes_written == run.offsets[-1]
        edges = sorted({0, length, *(min(length, int(b) * sample) for b in rng.integers(0, length // sample + 1,
                                                                                         reads))})
        for a, b in zip(edges[:-1], edges[1:]):
            out = np.empty(b - a, dtype=np.uint64)
            run.read(a, b, out)
            np.testing.assert_array_equal(out, packed[a:b])
        if length > sample > 1:
            with pytest.raises(AssertionError, match="do not fall on its blocks"):
                run.read(1, length, np.empty(length - 1, dtype=np.uint64))


def test_a_damaged_run_file_is_an_error_not_a_crash(tmp_path):
    runs = SortedRuns(2, 12, 10_000, tmp_path)
    runs.add_run(np.arange(0, 30_000, 3, dtype=np.uint64), 10_000)
    run = runs.runs[0]
    # a whole, valid frame in the wrong place (LZ4 decodes it without complaint): the entries are not the block's
    good = run.offsets.copy()
    run.offsets[0], run.offsets[1] = good[1], good[2]
    with pytest.raises(OSError, match="block 0 does not decode to its sorted entries"):
        run.read(0, 4096, np.empty(4096, dtype=np.uint64))
    run.offsets = good
    data = bytearray(run.path.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)
    run.path.write_bytes(bytes(data))
    with pytest.raises(OSError):
        run.read(0, run.length, np.empty(run.length, dtype=np.uint64))
    run.path.write_bytes(bytes(data[:100]))
    with pytest.raises(OSError, match="ends before entry"):
        run.read(0, run.length, np.empty(run.length, dtype=np.uint64))


def test_drained_runs_are_deleted_and_cannot_be_merged_again(tmp_path):
    """``drain`` deletes the run files once merged (what is written from them takes their place on disk); merging
    again would give an empty table, so it is refused."""
    runs = SortedRuns(2, 12, 4, tmp_path)
    runs.add(np.arange(10, dtype=np.int32) % 12, np.array([0, 10], dtype=np.int64))
    merged = list(runs.drain())
    assert sum(k.size for k, _ in merged) == 9 and not list(tmp_path.iterdir())
    with pytest.raises(AssertionError, match="merged and removed already"):
        list(runs.ranges())
