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
from tqdm.auto import tqdm

from .numba_cache import ensure_cache_dir

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


@numba.njit(nogil=True, cache=True)
def _square_rows(indptr, indices, data, r0, r1, top_k, min_value, acc, flag, cols):
    """Rows r0..r1 of Ã², pruned as ``prune`` prunes the rows of ``a64[r0:r1] @ a64``, without building them.

    A row is summed in a dense accumulator in the order scipy's product sums it (successors k in stored order, then
    row k in stored order) in float64, so its values are the same to the bit; it is then read in column order
    (a row of many products is summed into the cleared accumulator and scanned; a row of few has its touched
    columns flagged and sorted), its total summed in that order, and the ``top_k`` largest values ≥ ``min_value``
    kept, ties toward the smaller column (a min-heap: a later column replaces only a larger value).
    """
    n = acc.size
    n_rows = r1 - r0
    new_ptr = np.zeros(n_rows + 1, dtype=np.int64)
    cap = max(16, n_rows * (top_k if top_k > 0 else 64))
    out_idx = np.empty(cap, dtype=np.int32)
    out_val = np.empty(cap, dtype=np.float64)
    kept = np.zeros(n_rows, dtype=np.float64)
    total = np.zeros(n_rows, dtype=np.float64)
    hv = np.empty(max(top_k, 1), dtype=np.float64)
    hc = np.empty(max(top_k, 1), dtype=np.int64)
    m = 0
    for r in range(n_rows):
        i = r0 + r
        work = 0  # the row's products: a row with many of them is summed densely (no per-product bookkeeping)
        for p in range(indptr[i], indptr[i + 1]):
            work += indptr[indices[p] + 1] - indptr[indices[p]]
        if work * 8 > n:
            acc[:] = 0.0
            for p in range(indptr[i], indptr[i + 1]):
                k = indices[p]
                w = np.float64(data[p])
                for q in range(indptr[k], indptr[k + 1]):
                    acc[indices[q]] += w * np.float64(data[q])
            order = cols
            touched = 0
            for j in range(n):  # without branches: the columns whose sum is not 0, ascending
                order[touched] = j
                touched += acc[j] != 0.0
        else:
            touched = 0
            for p in range(indptr[i], indptr[i + 1]):
                k = indices[p]
                w = np.float64(data[p])
                for q in range(indptr[k], indptr[k + 1]):
                    j = indices[q]
                    if flag[j] == 0:
                        flag[j] = 1
                        acc[j] = 0.0
                        cols[touched] = j
                        touched += 1
                    acc[j] += w * np.float64(data[q])
            order = np.sort(cols[:touched])
            for t in range(touched):
                flag[order[t]] = 0
        if m + (touched if top_k == 0 else top_k) > out_idx.size:
            grow = max(out_idx.size * 2, m + touched)
            out_idx = np.concatenate((out_idx[:m], np.empty(grow - m, dtype=np.int32)))
            out_val = np.concatenate((out_val[:m], np.empty(grow - m, dtype=np.float64)))
        s = 0.0
        size = 0
        for t in range(touched):
            j = order[t]
            v = acc[j]
            if v == 0.0:  # csr_matmat leaves out sums that are exactly 0
                continue
            s += v
            if v < min_value:
                continue
            if top_k == 0:
                out_idx[m] = j
                out_val[m] = v
                kept[r] += v
                m += 1
            elif size < top_k:
                hv[size] = v
                hc[size] = j
                size += 1
                if size == top_k:
                    for h in range(top_k // 2 - 1, -1, -1):
                        _heap_down(hv, hc, size, h)
            elif v > hv[0]:
                hv[0] = v
                hc[0] = j
                _heap_down(hv, hc, size, 0)
        total[r] = s
        if top_k > 0:
            pick = np.argsort(hc[:size])
            for h in pick:
                out_idx[m] = hc[h]
                out_val[m] = hv[h]
                kept[r] += hv[h]
                m += 1
        new_ptr[r + 1] = m
    return new_ptr, out_idx[:m], out_val[:m], kept, total


def square_blocks(base: sp.csr_matrix, rule: PruneRule, *, block_rows: int = 1024, workers: int = 1,
                  progress: bool = True) -> Iterator[tuple[int, sp.csr_matrix, np.ndarray]]:
    """Ã² pruned by ``rule``, as ``(row_start, block, mass kept)`` in row order: the same blocks
    ``build_operators(base, [OperatorSpec("power", 2)], rule)`` yields, by a fused kernel (no exact product is
    built, sorted and pruned) on ``workers`` threads."""
    n = base.shape[0]
    if base.shape != (n, n):
        raise ValueError(f"Ã² needs a square Ã, got shape {base.shape}")
    indptr = np.asarray(base.indptr, dtype=np.int64)
    indices = np.asarray(base.indices, dtype=np.int32)
    data = np.asarray(base.data, dtype=np.float32)
    scratch = Queue()  # a dense accumulator per thread; its flags are all 0 between rows
    for _ in range(max(1, workers)):
        scratch.put((np.zeros(n, np.float64), np.zeros(n, np.uint8), np.empty(n + 1, np.int32)))

    def block(r0: int):
        r1 = min(n, r0 + block_rows)
        acc, flag, cols = scratch.get()
        try:
            ptr, idx, val, kept, total = _square_rows(indptr, indices, data, r0, r1, rule.top_k or 0,
                                                      rule.min_value, acc, flag, cols)
        finally:
            scratch.put((acc, flag, cols))
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
