"""Transition operators from counts: Ã = D⁻¹A, its powers Ãᵏ and mixtures Ã+…+Ãⁿ.

Materialised higher orders explode (Ã² of movie-reviews is 22 % dense), so they
are computed exactly in row blocks, in float64, and each row is then pruned by
a :class:`PruneRule`. The mass each row kept is returned beside the operator.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from queue import Queue

import numba
import numpy as np
import scipy.sparse as sp
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic
from tqdm.auto import tqdm

from gm_graphs.store.kernel_cache import ensure_cache_dir

ensure_cache_dir()  # before the cached kernels below are defined


@dataclass(frozen=True)
class PruneRule:
    """Keep, in each row, the ``top_k`` largest entries that are also ``>= min_value``.

    ``top_k=None`` keeps every entry passing ``min_value``; ``PruneRule.exact()``
    keeps everything. Ties are broken toward the smaller column index. A build prunes the higher orders
    (Ãᵏ, k ≥ 2) with it; solvers still apply the exact operator.

    Args:
        top_k (``int`` or ``None``, defaults to 64): the entries kept per row, ≥ 1; ``None``: all.
        min_value (``float``, defaults to 0.0): entries below it are dropped, ≥ 0.

    Example::

        >>> PruneRule(top_k=8).to_dict(), PruneRule.exact().is_exact
        ({'top_k': 8, 'min_value': 0.0}, True)
    """

    top_k: int | None = 64
    min_value: float = 0.0

    def __post_init__(self):
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None (keep all), got {self.top_k}")
        if not self.min_value >= 0:
            raise ValueError(f"min_value must be >= 0, got {self.min_value}")

    @classmethod
    def exact(cls) -> PruneRule:
        return cls(top_k=None, min_value=0.0)

    @property
    def is_exact(self) -> bool:
        return self.top_k is None and self.min_value == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def normalize(counts: sp.csr_matrix, eps: float = 1e-8, dtype=np.float32) -> sp.csr_matrix:
    """Ã = D⁻¹A with D_ii = Σ_j A_ij + ε, as ``dtype`` (float32 on disk); rows without successors stay zero."""
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    degree = np.asarray(counts.sum(axis=1), dtype=np.float64).ravel()
    with np.errstate(divide="ignore"):
        inv = np.where(degree > 0, 1.0 / (degree + eps), 0.0)
    row = np.repeat(inv, np.diff(counts.indptr))
    out = sp.csr_matrix((counts.data * row, counts.indices, counts.indptr), shape=counts.shape)
    out.data = out.data.astype(dtype)
    return out


@numba.njit(cache=True)
def _prune_rows(indptr, indices, data, top_k, min_value):
    n = indptr.size - 1
    new_ptr = np.zeros(n + 1, dtype=np.int64)
    out_idx = np.empty(indices.size, dtype=np.int32)
    out_val = np.empty(data.size, dtype=np.float64)
    kept = np.zeros(n, dtype=np.float64)
    total = np.zeros(n, dtype=np.float64)
    m = 0
    for r in range(n):
        a, b = indptr[r], indptr[r + 1]
        vals = data[a:b]
        total[r] = vals.sum()
        keep = np.nonzero(vals >= min_value)[0]
        if top_k > 0 and keep.size > top_k:
            # stable sort on -value keeps the smaller column first among ties
            order = np.argsort(-vals[keep], kind="mergesort")[:top_k]
            keep = np.sort(keep[order])
        for t in keep:
            out_idx[m] = indices[a + t]
            out_val[m] = vals[t]
            kept[r] += vals[t]
            m += 1
        new_ptr[r + 1] = m
    return new_ptr, out_idx[:m], out_val[:m], kept, total


@numba.njit(nogil=True, cache=True)
def _heap_down(hv, hc, size, i):
    """Restore the min-heap (value ascending, column descending) of the kept candidates below position i."""
    while True:
        left = 2 * i + 1
        if left >= size:
            return
        c = left
        right = left + 1
        if right < size and (hv[right] < hv[left] or (hv[right] == hv[left] and hc[right] > hc[left])):
            c = right
        if hv[c] < hv[i] or (hv[c] == hv[i] and hc[c] > hc[i]):
            hv[c], hv[i] = hv[i], hv[c]
            hc[c], hc[i] = hc[i], hc[c]
            i = c
        else:
            return


@intrinsic
def _prefetch(typingctx, array, index):
    """Start loading ``array[index]`` into the caches (a hint: no result depends on it, and it never faults)."""
    sig = types.void(array, index)

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]], wraparound=False)
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        hint = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]), "llvm.prefetch.p0i8")
        # a read, kept in every cache level, of data
        builder.call(hint, [builder.bitcast(pointer, byte_pointer), ir.Constant(i32, 0), ir.Constant(i32, 3),
                            ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


_U = np.uint64  # indexing with unsigned integers spares numba's negative-index checks in the inner loops
# a row k's record in the layout: meta[_FIELDS * k + field]
_START, _SPLIT, _END, _RUNS, _RUNS_END, _ROW_SUM, _BOUNDED, _DENSE = range(8)
_FIELDS = 8  # one cache line per row
# prefetching: the row record of the successor _AHEAD_RECORD places on, the data of the one _AHEAD places on (at
# most _LINES cache lines of each array), and the run _AHEAD_RUN places on among the selected runs
_AHEAD, _AHEAD_RECORD, _LINES, _AHEAD_RUN = 4, 8, 16, 32
# v ≤ bound·(1 + _SLACK) for every product value v of a group: both sums have ≤ n < 2³² terms, so they are within
# n·2⁻⁵³ < 5e-7 (relative) of their exact values, and the exact value is at most the exact bound
_SLACK = 1e-6
_BLOCK = 64  # bounded rows summed together (≤ 64: a bit each): a successor's row is read once for all it follows


@numba.njit(nogil=True, cache=True)
def _layout_rows(indptr, cols, data, prefix, group):
    """Each row k's record (where its columns < ``prefix`` end, its sum) and its other columns as runs, one per
    group of ``group`` consecutive columns, each with its start and its largest value; a sentinel run ends a row."""
    n = indptr.size - 1
    count = n
    for k in range(n):
        last = -1
        for q in range(indptr[k], indptr[k + 1]):
            j = np.int64(cols[_U(q)])
            if j >= prefix and j // group != last:
                last = j // group
                count += 1
    meta = np.zeros(n * _FIELDS, np.int64)
    sums = meta.view(np.float64)
    run_group = np.zeros(count, cols.dtype)
    run_max = np.zeros(count, np.float32)
    run_start = np.empty(count, np.int64)
    e = 0
    for k in range(n):
        rec = _FIELDS * k
        meta[rec + _START] = indptr[k]
        meta[rec + _END] = indptr[k + 1]
        meta[rec + _SPLIT] = indptr[k + 1]
        meta[rec + _RUNS] = e
        last = -1
        s = 0.0
        for q in range(indptr[k], indptr[k + 1]):
            j = np.int64(cols[_U(q)])
            v = data[_U(q)]
            s += np.float64(v)
            if j < prefix:
                continue
            if last == -1:
                meta[rec + _SPLIT] = q
            if j // group != last:
                last = j // group
                run_group[e] = last
                run_max[e] = v
                run_start[e] = q
                e += 1
            elif v > run_max[e - 1]:
                run_max[e - 1] = v
        meta[rec + _RUNS_END] = e
        run_start[e] = indptr[k + 1]
        e += 1
        sums[rec + _ROW_SUM] = s
    return meta, run_group, run_max, run_start


@numba.njit(nogil=True, cache=True)
def _finite_non_negative(data):
    """Whether every value is finite and ≥ 0 (what the bounds need), without temporaries the size of ``data``."""
    for v in data:
        if not (v >= 0 and v < np.inf):
            return False
    return True


@numba.njit(nogil=True, cache=True)
def _mark_bounded(meta, cols, prefix, n_groups):
    """Flag the rows of Ã² cheaper to bound than to sum whole: a bounded row reads its successors' short rows below
    ``prefix`` and their runs (twice), then scans ``prefix`` columns and the groups; a whole row reads everything."""
    n = meta.size // _FIELDS
    for i in range(n):
        rec = _FIELDS * i
        work = 0
        bounded = prefix + n_groups
        for p in range(meta[rec + _START], meta[rec + _END]):
            k = _FIELDS * np.int64(cols[_U(p)])
            work += meta[k + _END] - meta[k + _START]
            bounded += meta[k + _SPLIT] - meta[k + _START] + 2 * (meta[k + _RUNS_END] - meta[k + _RUNS])
        meta[rec + _BOUNDED] = 10 * bounded < 7 * work


@numba.njit(nogil=True, cache=True)
def _prefetch_lines(array, start, end, per_line):
    """Prefetch ``array[start:end]`` (at most ``_LINES`` lines), holding ``per_line`` items a cache line."""
    for x in range(start, min(end, start + per_line * _LINES), per_line):
        _prefetch(array, x)


@numba.njit(nogil=True, cache=True)
def _push(hv, hc, size, top_k, v, j):
    """Offer column j of value v to the ``top_k`` kept so far (a min-heap once full); returns the new size."""
    if size < top_k:
        hv[size] = v
        hc[size] = j
        size += 1
        if size == top_k:
            for h in range(top_k // 2 - 1, -1, -1):
                _heap_down(hv, hc, size, h)
    elif v > hv[0]:  # a later column replaces only a smaller value: ties go to the smaller column
        hv[0] = v
        hc[0] = j
        _heap_down(hv, hc, size, 0)
    return size


@numba.njit(nogil=True, cache=True)
def _read_columns(acc, lo, hi, min_value, top_k, hv, hc, size):
    """Read (and clear) the accumulated columns lo..hi in column order into the heap; returns (size, their sum)."""
    s = 0.0
    for j in range(lo, hi):
        v = acc[j]
        if v == 0.0:  # csr_matmat leaves out sums that are exactly 0
            continue
        acc[j] = 0.0
        s += v
        if v >= min_value:
            size = _push(hv, hc, size, top_k, v, j)
    return size, s


@numba.njit(nogil=True, cache=True)
def _scatter_whole(meta, cols, data, i, acc):
    """acc += Σ_k Ã_ik·Ã_k over row i's successors in stored order, each row k in stored order (scipy's order)."""
    p0, p1 = meta[_FIELDS * i + _START], meta[_FIELDS * i + _END]
    for p in range(p0, p1):
        if p + _AHEAD_RECORD < p1:
            _prefetch(meta, _FIELDS * np.int64(cols[_U(p + _AHEAD_RECORD)]))
        if p + _AHEAD < p1:
            ahead = _FIELDS * np.int64(cols[_U(p + _AHEAD)])
            _prefetch_lines(cols, meta[ahead + _START], meta[ahead + _END], 32)
            _prefetch_lines(data, meta[ahead + _START], meta[ahead + _END], 16)
        rec = _FIELDS * np.int64(cols[_U(p)])
        w = np.float64(data[_U(p)])
        for q in range(meta[rec + _START], meta[rec + _END]):
            acc[cols[_U(q)]] += w * np.float64(data[_U(q)])


@numba.njit(nogil=True, cache=True)
def _merge_successors(meta, cols, data, rows, counts, ks, places, ws):
    """The successors k of ``rows`` with the place of their row in ``rows`` and Ã_ik, ascending in k and, for equal
    k, in place (a counting sort; ``counts`` holds n + 1 zeros and is left so); returns (how many, ks, places, ws),
    the buffers grown when too small."""
    m = 0
    for u in range(rows.size):
        rec = _FIELDS * rows[u]
        m += meta[rec + _END] - meta[rec + _START]
        for p in range(meta[rec + _START], meta[rec + _END]):
            counts[np.int64(cols[_U(p)]) + 1] += 1
    if m > ks.size:
        ks, places, ws = np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m, np.float64)
    for k in range(1, counts.size):
        counts[k] += counts[k - 1]
    for u in range(rows.size):
        rec = _FIELDS * rows[u]
        for p in range(meta[rec + _START], meta[rec + _END]):
            k = np.int64(cols[_U(p)])
            t = counts[k]
            counts[k] = t + 1
            ks[t] = k
            places[t] = u
            ws[t] = data[_U(p)]
    counts[:] = 0
    return m, ks, places, ws


@numba.njit(nogil=True, cache=True)
def _prefetch_ahead(meta, ks, t, m):
    """The row record of the successor ``_AHEAD_RECORD`` places after t; and the one ``_AHEAD`` places after, unless
    its row is that of its predecessor (then already read), or -1."""
    if t + _AHEAD_RECORD < m:
        _prefetch(meta, _FIELDS * ks[t + _AHEAD_RECORD])
    if t + _AHEAD < m and ks[t + _AHEAD] != ks[t + _AHEAD - 1]:
        return _FIELDS * ks[t + _AHEAD]
    return -1


@numba.njit(nogil=True, cache=True)
def _sum_prefixes(meta, cols, data, dense, run_group, run_max, m, ks, places, ws, acc, bound, totals):
    """For the rows of a block (successors merged by :func:`_merge_successors`): into acc[place] their columns
    < prefix of Ã², summed as scipy sums them (k ascending, row k in stored order); into bound[place] for every later
    group of columns a bound Σ_k Ã_ik·max(Ã_k over the group) on its values; into totals[place] Σ_k Ã_ik·Σ_j Ã_kj.
    A successor's row is read once for all the block's rows it follows."""
    sums = meta.view(np.float64)
    for t in range(m):
        ahead = _prefetch_ahead(meta, ks, t, m)
        if ahead >= 0 and meta[ahead + _DENSE] < 0:  # what it reads: its columns < prefix, its runs' groups and maxima
            _prefetch_lines(cols, meta[ahead + _START], meta[ahead + _SPLIT], 32)
            _prefetch_lines(data, meta[ahead + _START], meta[ahead + _SPLIT], 16)
        if ahead >= 0:
            _prefetch_lines(run_group, meta[ahead + _RUNS], meta[ahead + _RUNS_END], 32)
            _prefetch_lines(run_max, meta[ahead + _RUNS], meta[ahead + _RUNS_END], 16)
        rec = _FIELDS * ks[t]
        u = places[t]
        w = ws[t]
        totals[u] += w * sums[rec + _ROW_SUM]
        row = acc[u]
        if meta[rec + _DENSE] >= 0:  # a row dense below the prefix: added whole (its zeros change no sum)
            values = dense[meta[rec + _DENSE]]
            for j in range(values.size):
                row[j] += w * np.float64(values[j])
        else:
            for q in range(meta[rec + _START], meta[rec + _SPLIT]):
                row[cols[_U(q)]] += w * np.float64(data[_U(q)])
        b = bound[u]
        for e in range(meta[rec + _RUNS], meta[rec + _RUNS_END]):
            b[run_group[_U(e)]] += w * np.float64(run_max[_U(e)])


@numba.njit(nogil=True, cache=True)
def _scatter_runs(cols, data, hits, weights, count, acc):
    """Add the listed runs (start, end, place; weight) into acc[place], in order, prefetching the runs ahead."""
    for t in range(count):
        if t + _AHEAD_RUN < count:
            x = hits[3 * (t + _AHEAD_RUN)]
            _prefetch(cols, x)
            _prefetch(data, x)
            _prefetch(data, x + 15)
        row = acc[hits[3 * t + 2]]
        w = weights[t]
        for q in range(hits[3 * t], hits[3 * t + 1]):
            row[cols[_U(q)]] += w * np.float64(data[_U(q)])


@numba.njit(nogil=True, cache=True)
def _sum_selected(meta, cols, data, run_group, run_start, m, ks, places, ws, selected, last, acc, hits, weights):
    """For the rows of a block: add into acc[place] the products in each row's selected groups (those up to
    last[place]), in scipy's order. A successor's runs are walked once for all the block's rows it follows; the
    selected runs are listed in ``hits`` (start, end, place) and ``weights``, and summed whenever the list is full
    (the list grows only for a successor whose runs alone overflow it; returned)."""
    chosen = np.zeros(selected.shape[1], np.uint64)  # per group: the places (bits) that selected it
    for u in range(last.size):
        for c in range(last[u] + 1):
            chosen[c] |= np.uint64(selected[u, c]) << np.uint64(u)
    row_weight = np.empty(last.size, np.float64)
    count = 0
    t = 0
    while t < m:  # successor by successor (k ascending)
        k = ks[t]
        users = np.uint64(0)
        end = -1
        t1 = t
        while t1 < m and ks[t1] == k:
            u = places[t1]
            users |= np.uint64(1) << np.uint64(u)
            row_weight[u] = ws[t1]
            end = max(end, last[u])
            t1 += 1
        rec = _FIELDS * k
        e0, e1 = meta[rec + _RUNS], meta[rec + _RUNS_END]
        most = (t1 - t) * (e1 - e0)
        if count + most > weights.size:  # sum what is listed (in order: a column's products stay k-ascending)
            _scatter_runs(cols, data, hits, weights, count, acc)
            count = 0
            if most > weights.size:
                hits, weights = np.empty(3 * most, np.int64), np.empty(most, np.float64)
        ahead = _prefetch_ahead(meta, ks, t1 - 1, m)
        if ahead >= 0:  # the runs' groups and starts
            _prefetch_lines(run_group, meta[ahead + _RUNS], meta[ahead + _RUNS_END], 32)
            _prefetch_lines(run_start, meta[ahead + _RUNS], meta[ahead + _RUNS_END] + 1, 8)
        for e in range(e0, e1):
            g = np.int64(run_group[_U(e)])
            if g > end:  # a row's runs ascend: none of the rest is selected
                break
            both = chosen[g] & users
            while both:  # the places that follow k and selected g, lowest first
                u = np.int64(trailing_zeros(both))
                both &= both - np.uint64(1)
                hits[3 * count] = run_start[_U(e)]
                hits[3 * count + 1] = run_start[_U(e + 1)]
                hits[3 * count + 2] = u
                weights[count] = row_weight[u]
                count += 1
        t = t1
    _scatter_runs(cols, data, hits, weights, count, acc)
    return hits, weights


@numba.njit(nogil=True, cache=True)
def _select_groups(bound, selected, first, threshold):
    """Select the groups whose bound reaches ``threshold`` (and is not 0), clearing the bounds; returns how many
    were selected, the last one, and how many had a bound (products) at all."""
    count = 0
    last = first - 1
    nonzero = 0
    for c in range(first, bound.size):
        b = bound[c]
        bound[c] = 0.0
        keep = b > 0.0 and b * (1.0 + _SLACK) >= threshold
        selected[c] = keep
        count += keep
        nonzero += b > 0.0
        if keep:
            last = c
    return count, last, nonzero


@numba.njit(nogil=True, cache=True)
def _bounded_block(meta, cols, data, dense, run_group, run_max, run_start, prefix, group, rows, top_k, min_value,
                   acc, bound, selected, counts, buffers, hv, hc, sizes, totals):
    """Rows ``rows`` of Ã² pruned to their ``top_k`` without summing every product: the heaps hv[place], hc[place]
    (sizes[place] entries) and totals[place]; ``buffers`` (scratch: ks, places, ws, hits, weights) are returned,
    grown when too small.

    Each row's columns < ``prefix`` are summed exactly; the ``top_k``-th largest of them is a value a column must
    reach to be kept; only the groups of later columns whose bound reaches it are summed (exactly, in scipy's
    order). Skipped columns are below the heap's smallest value when they would have come in column order, so the
    heap ends as the whole row's would. The total is the row's sum in column order when no group was skipped, else
    Σ_k Ã_ik·Σ_j Ã_kj (the same up to float64 rounding)."""
    n = acc.shape[1]
    ks, places, ws, hits, weights = buffers
    m, ks, places, ws = _merge_successors(meta, cols, data, rows, counts, ks, places, ws)
    estimates = np.zeros(rows.size)
    _sum_prefixes(meta, cols, data, dense, run_group, run_max, m, ks, places, ws, acc, bound, estimates)
    first = min(prefix, n) // group
    last = np.empty(rows.size, np.int64)
    skipped = np.zeros(rows.size, np.bool_)
    for u in range(rows.size):
        sizes[u], totals[u] = _read_columns(acc[u], 0, min(prefix, n), min_value, top_k, hv[u], hc[u], 0)
        threshold = hv[u, 0] if sizes[u] == top_k else min_value
        count, last[u], nonzero = _select_groups(bound[u], selected[u], first, threshold)
        skipped[u] = count < nonzero
    hits, weights = _sum_selected(meta, cols, data, run_group, run_start, m, ks, places, ws, selected, last, acc,
                                  hits, weights)
    for u in range(rows.size):
        for c in range(first, last[u] + 1):
            if selected[u, c]:
                sizes[u], part = _read_columns(acc[u], c * group, min(n, c * group + group), min_value, top_k, hv[u],
                                               hc[u], sizes[u])
                totals[u] += part
        if skipped[u]:  # the skipped groups hold part of the total
            totals[u] = estimates[u]
    return ks, places, ws, hits, weights


@numba.njit(nogil=True, cache=True)
def _whole_row(meta, cols, data, i, acc, flag, order):
    """Row i of Ã² summed whole, as scipy sums it; returns how many columns it touched, listed ascending in
    ``order`` (a row of many products is summed into the cleared accumulator and scanned; a row of few has its
    touched columns flagged and sorted)."""
    n = acc.size
    rec = _FIELDS * i
    work = 0
    for p in range(meta[rec + _START], meta[rec + _END]):
        k = _FIELDS * np.int64(cols[_U(p)])
        work += meta[k + _END] - meta[k + _START]
    if work * 8 > n:
        _scatter_whole(meta, cols, data, i, acc)
        touched = 0
        for j in range(n):  # without branches: the columns whose sum is not 0, ascending
            order[touched] = j
            touched += acc[j] != 0.0
        return touched
    touched = 0
    for p in range(meta[rec + _START], meta[rec + _END]):
        k = _FIELDS * np.int64(cols[_U(p)])
        w = np.float64(data[_U(p)])
        for q in range(meta[k + _START], meta[k + _END]):
            j = np.int64(cols[_U(q)])
            if flag[j] == 0:
                flag[j] = 1
                order[touched] = j
                touched += 1
            acc[j] += w * np.float64(data[_U(q)])
    order[:touched].sort()
    for t in range(touched):
        flag[order[t]] = 0
    return touched


@numba.njit(nogil=True, cache=True)
def _read_touched(acc, order, touched, min_value, top_k, hv, hc, out_idx, out_val, m):
    """Read (and clear) a whole row's touched columns in column order: its total, and either the heap of its
    ``top_k`` or (``top_k`` 0) every value ≥ ``min_value`` appended to the output; returns (heap size, total,
    mass appended, m)."""
    s = 0.0
    appended = 0.0
    size = 0
    for t in range(touched):
        j = order[t]
        v = acc[j]
        if v == 0.0:  # csr_matmat leaves out sums that are exactly 0
            continue
        acc[j] = 0.0
        s += v
        if v < min_value:
            continue
        if top_k == 0:
            out_idx[m] = j
            out_val[m] = v
            appended += v
            m += 1
        else:
            size = _push(hv, hc, size, top_k, v, j)
    return size, s, appended, m


@numba.njit(nogil=True, cache=True)
def _reserve(out_idx, out_val, m, extra):
    """The output buffers, grown (at least doubled) if the first m entries and ``extra`` more do not fit."""
    if m + extra <= out_idx.size:
        return out_idx, out_val
    grow = max(out_idx.size * 2, m + extra)
    return (np.concatenate((out_idx[:m], np.empty(grow - m, dtype=np.int32))),
            np.concatenate((out_val[:m], np.empty(grow - m, dtype=np.float64))))


@numba.njit(nogil=True, cache=True)
def _square_rows(meta, cols, data, dense, run_group, run_max, run_start, prefix, group, r0, r1, top_k, min_value,
                 acc, flag, order, block_acc, bound, selected, counts):
    """Rows r0..r1 of Ã², pruned as ``prune`` prunes the rows of ``a64[r0:r1] @ a64``, without building them.

    Every value read is summed in float64 in the order scipy's product sums it (successors k in stored order, then
    row k in stored order), so it is the same to the bit; values are read in column order, the total summed in that
    order, and the ``top_k`` largest values ≥ ``min_value`` kept, ties toward the smaller column. Rows flagged in
    the layout (with ``top_k``) are taken a block at a time and skip the groups of columns that cannot reach the
    kept (:func:`_bounded_block`). ``acc``, ``block_acc``, ``bound``, ``flag`` and ``counts`` are all 0 between
    calls (``selected`` is written before it is read)."""
    n_rows = r1 - r0
    block = block_acc.shape[0]
    new_ptr = np.zeros(n_rows + 1, dtype=np.int64)
    cap = max(16, n_rows * (top_k if top_k > 0 else 64))
    out_idx = np.empty(cap, dtype=np.int32)
    out_val = np.empty(cap, dtype=np.float64)
    kept = np.zeros(n_rows, dtype=np.float64)
    total = np.zeros(n_rows, dtype=np.float64)
    hv = np.empty((block + 1, max(top_k, 1)), dtype=np.float64)  # a heap per bounded row, the last for whole rows
    hc = np.empty((block + 1, max(top_k, 1)), dtype=np.int64)
    sizes = np.zeros(block, dtype=np.int64)
    totals = np.zeros(block, dtype=np.float64)
    buffers = (np.empty(1 << 14, np.int64), np.empty(1 << 14, np.int64), np.empty(1 << 14, np.float64),
               np.empty(3 << 16, np.int64), np.empty(1 << 16, np.float64))
    m = 0
    for b0 in range(r0, r1, block):
        b1 = min(r1, b0 + block)
        rows = np.array([i for i in range(b0, b1) if top_k > 0 and meta[_FIELDS * i + _BOUNDED]], dtype=np.int64)
        if rows.size > 0:
            buffers = _bounded_block(meta, cols, data, dense, run_group, run_max, run_start, prefix, group, rows,
                                     top_k, min_value, block_acc, bound, selected, counts, buffers, hv, hc, sizes,
                                     totals)
        place = 0
        for i in range(b0, b1):
            r = i - r0
            if place < rows.size and rows[place] == i:
                size, total[r] = sizes[place], totals[place]
                heap_v, heap_c = hv[place], hc[place]
                place += 1
            else:
                touched = _whole_row(meta, cols, data, i, acc, flag, order)
                if top_k == 0:
                    out_idx, out_val = _reserve(out_idx, out_val, m, touched)
                heap_v, heap_c = hv[block], hc[block]
                size, total[r], kept[r], m = _read_touched(acc, order, touched, min_value, top_k, heap_v, heap_c,
                                                           out_idx, out_val, m)
            out_idx, out_val = _reserve(out_idx, out_val, m, size)
            for h in np.argsort(heap_c[:size]):
                out_idx[m] = heap_c[h]
                out_val[m] = heap_v[h]
                kept[r] += heap_v[h]
                m += 1
            new_ptr[r + 1] = m
    return new_ptr, out_idx[:m], out_val[:m], kept, total


def _bounds_split(n: int) -> tuple[int, int]:
    """(prefix, group) for a vocabulary of n: the first n/12 columns summed exactly in every bounded row, the others
    bounded in groups of n/384 (4,096 and 128 at 49,152 tokens; frequent tokens have small ids in BPE vocabularies,
    so the prefix holds most of a row's largest values)."""
    group = max(1, min(128, n // 384))
    return group * max(1, n // (12 * group)), group


@dataclass(frozen=True)
class _SquareLayout:
    """Ã arranged for :func:`_square_rows`: unsigned column indices (uint16 up to 65,536 columns), a record per row,
    the runs of columns ≥ ``prefix`` by group with their largest value, and the rows dense below ``prefix`` as
    dense rows (``dense``, the record's ``_DENSE`` field their index)."""

    meta: np.ndarray
    cols: np.ndarray
    data: np.ndarray
    dense: np.ndarray
    run_group: np.ndarray
    run_max: np.ndarray
    run_start: np.ndarray
    prefix: int
    group: int

    @classmethod
    def of(cls, base: sp.csr_matrix, prefix: int, group: int) -> _SquareLayout:
        """The layout of ``base`` with ``prefix`` columns summed exactly (a multiple of ``group``); rows are bounded
        only where ``base`` is canonical (sorted, so the prefix and runs are contiguous; no duplicates, which a dense
        row would add up) and its values finite and ≥ 0 (the bounds hold); otherwise every row is summed whole, in
        stored order, as scipy sums it."""
        if prefix % group:
            raise ValueError(f"the prefix ({prefix}) must be a multiple of the group ({group})")
        n = base.shape[0]
        indptr = np.asarray(base.indptr, dtype=np.int64)
        cols = np.asarray(base.indices, dtype=np.uint16 if n <= 1 << 16 else np.uint32)
        data = np.asarray(base.data, dtype=np.float32)
        boundable = bool(base.has_canonical_format) and _finite_non_negative(data)
        if not boundable:  # no runs: every row's columns are its "prefix"
            prefix = group * -(-n // group)
        meta, run_group, run_max, run_start = _layout_rows(indptr, cols, data, prefix, group)
        meta[_DENSE::_FIELDS] = -1
        dense = np.zeros((0, prefix), np.float32)
        if boundable:
            _mark_bounded(meta, cols, prefix, -(-n // group) - prefix // group)
            # rows with a third or more of the prefix's columns: added whole, a dense add of it is the cheaper
            rows = np.flatnonzero(3 * (meta[_SPLIT::_FIELDS] - meta[_START::_FIELDS]) >= prefix)
            dense = sp.csr_matrix(base[rows])[:, :prefix].toarray().astype(np.float32)
            meta[_DENSE::_FIELDS][rows] = np.arange(rows.size)
        return cls(meta, cols, data, dense, run_group, run_max, run_start, prefix, group)

    def scratch(self) -> tuple:
        """A thread's buffers for :meth:`rows` (zeros, as the kernel leaves them): accumulator, flags, column order,
        the block's accumulators, group bounds and selections, and counts for merging successors."""
        n = self.meta.size // _FIELDS
        groups = -(-n // self.group)
        return (np.zeros(n, np.float64), np.zeros(n, np.uint8), np.empty(n + 1, np.int64),
                np.zeros((_BLOCK, n), np.float64), np.zeros((_BLOCK, groups), np.float64),
                np.zeros((_BLOCK, groups), np.uint8), np.zeros(n + 1, np.int64))

    def rows(self, r0: int, r1: int, rule: PruneRule, scratch: tuple) -> tuple:
        return _square_rows(self.meta, self.cols, self.data, self.dense, self.run_group, self.run_max, self.run_start,
                            self.prefix, self.group, r0, r1, rule.top_k or 0, rule.min_value, *scratch)


def square_blocks(base: sp.csr_matrix, rule: PruneRule, *, block_rows: int = 1024, workers: int = 1,
                  progress: bool = True) -> Iterator[tuple[int, sp.csr_matrix, np.ndarray]]:
    """Ã² pruned by ``rule``, as ``(row_start, block, mass kept)`` in row order: the same blocks
    ``build_operators(base, [OperatorSpec("power", 2)], rule)`` yields, by a fused kernel (no exact product is
    built, sorted and pruned) on ``workers`` threads. Kept indices and values are the same to the bit; the mass
    kept may differ at float64 rounding, in rows where columns that cannot be kept were not summed."""
    n = base.shape[0]
    if base.shape != (n, n):
        raise ValueError(f"Ã² needs a square Ã, got shape {base.shape}")
    yield from _square_blocks(_SquareLayout.of(base, *_bounds_split(n)), rule, block_rows=block_rows, workers=workers,
                              progress=progress)


def _square_blocks(layout: _SquareLayout, rule: PruneRule, *, block_rows: int, workers: int,
                   progress: bool) -> Iterator[tuple[int, sp.csr_matrix, np.ndarray]]:
    n = layout.meta.size // _FIELDS
    scratch = Queue()  # a thread's buffers
    for _ in range(max(1, workers)):
        scratch.put(layout.scratch())

    def block(r0: int):
        r1 = min(n, r0 + block_rows)
        buffers = scratch.get()
        try:
            ptr, idx, val, kept, total = layout.rows(r0, r1, rule, buffers)
        finally:
            scratch.put(buffers)
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = np.where(total > 0, kept / total, 1.0)
        return r0, sp.csr_matrix((val.astype(np.float32), idx, ptr), shape=(r1 - r0, n)), frac

    bar = tqdm(total=n, desc="operators order2", unit="row", disable=not progress, leave=False)
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="square") as pool:
        pending: deque = deque()
        for r0 in range(0, n, block_rows):
            pending.append(pool.submit(block, r0))
            if len(pending) > 2 * workers:
                out = pending.popleft().result()
                bar.update(out[1].shape[0])
                yield out
        while pending:
            out = pending.popleft().result()
            bar.update(out[1].shape[0])
            yield out
    bar.close()


def prune(block: sp.csr_matrix, rule: PruneRule) -> tuple[sp.csr_matrix, np.ndarray]:
    """Prune each row of ``block`` by ``rule``; return it (float32) and the fraction of mass each row kept."""
    block = block.tocsr()
    block.sum_duplicates()
    block.sort_indices()
    ptr, idx, val, kept, total = _prune_rows(block.indptr.astype(np.int64), block.indices.astype(np.int32),
                                             block.data.astype(np.float64), rule.top_k or 0, rule.min_value)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(total > 0, kept / total, 1.0)
    return sp.csr_matrix((val.astype(np.float32), idx, ptr), shape=block.shape), frac


@dataclass(frozen=True)
class OperatorSpec:
    """Which operator: ``power`` k (Ãᵏ) or ``mixture`` n (Ã+…+Ãⁿ).

    Args:
        kind (``str``): ``"power"`` or ``"mixture"``.
        k (``int``): the power k or the mixture's n, ≥ 1.

    Example::

        >>> OperatorSpec.parse(order=2).name, OperatorSpec.parse(mixture=3).name
        ('order2', 'mixture3')
    """

    kind: str
    k: int

    def __post_init__(self):
        if self.kind not in ("power", "mixture"):
            raise ValueError(f"operator kind must be 'power' or 'mixture', got {self.kind!r}")
        if self.k < 1:
            raise ValueError(f"the order must be >= 1, got {self.k}")

    @property
    def name(self) -> str:
        return f"order{self.k}" if self.kind == "power" else f"mixture{self.k}"

    @property
    def max_power(self) -> int:
        return self.k

    @classmethod
    def parse(cls, order: int = 1, mixture: int | None = None) -> OperatorSpec:
        return cls("mixture", int(mixture)) if mixture is not None else cls("power", int(order))


def build_operators(
    base: sp.csr_matrix,
    specs: list[OperatorSpec],
    rule: PruneRule,
    *,
    block_rows: int = 1024,
    progress: bool = True,
) -> Iterator[tuple[int, dict[str, tuple[sp.csr_matrix, np.ndarray]]]]:
    """Yield ``(row_start, {name: (pruned block, mass kept)})`` for each row block of every spec.

    Every power up to the largest asked for is computed once per block,
    exactly in float64, before pruning; blocks are yielded so that callers can
    write them out without holding the whole operator.
    """
    n = base.shape[0]
    a64 = base.astype(np.float64)
    top = max(s.max_power for s in specs)
    bar = tqdm(total=n, desc=f"operators {','.join(s.name for s in specs)}", unit="row",
               disable=not progress, leave=False)
    for r0 in range(0, n, block_rows):
        r1 = min(n, r0 + block_rows)
        powers = [a64[r0:r1]]
        for _ in range(1, top):
            powers.append(powers[-1] @ a64)
        out = {}
        for s in specs:
            block = powers[s.k - 1] if s.kind == "power" else sum(powers[: s.k], sp.csr_matrix((r1 - r0, n)))
            out[s.name] = prune(block, rule)
        yield r0, out
        bar.update(r1 - r0)
    bar.close()
