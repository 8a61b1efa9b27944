"""The n-gram tables' layout on disk and in memory (graph format 2): one trie over the n-grams, a level per length.

Level d (d ≥ 2) hangs each node of length d − 1 (at d = 2: each token) over its children, the nodes of length d, as
a CSR: ``indptr`` (a base every ``BLOCK`` values, int64, plus each value's uint16 offset from its block's base) and
``next``, each child's last token (uint16 when the vocabulary has at most 65,536 tokens). A level whose length is
one of the counted orders also holds each node's count (uint8). An offset or a count too large for its narrow type
is stored as the type's largest value, and its real value in a side table (``*_wide_at``: the positions, ascending;
``*_wide``: the values, int64). Below the lowest order the levels hold that order's contexts only; from it up, level
d's nodes are every d-gram of the corpus, so the (d+1)-gram table hangs under the d-grams and stores no contexts.
At 4M documents (orders 3 and 4) the tables take 3.9 bytes per corpus token, against 12.6 in format 1.

A context is looked up by walking it down the levels (a binary search among a node's children per token:
:func:`find_context`); docs/format.md describes the files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from gm_graphs.store.kernel_cache import ensure_cache_dir

ensure_cache_dir()  # before the cached kernels below are defined

SHIFT = 6
BLOCK = 1 << SHIFT  # indptr values per stored base
PTR_ESCAPE = 0xFFFF  # an offset from the block's base at or above this is in the side table
COUNT_ESCAPE = 0xFF  # a count at or above this is in the side table
PTR_PARTS = ("indptr_base", "indptr", "indptr_wide_at", "indptr_wide", "next")
COUNT_PARTS = ("counts", "counts_wide_at", "counts_wide")
_I8 = np.dtype("<i8")


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype of a level's ``next``: uint16 when every token id fits, else int32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def part_dtypes(vocab_size: int, counted: bool) -> dict[str, np.dtype]:
    """The dtype of each file of a level (with its counts when ``counted``)."""
    dtypes = {"indptr_base": _I8, "indptr": np.dtype("<u2"), "indptr_wide_at": _I8, "indptr_wide": _I8,
              "next": token_dtype(vocab_size)}
    if counted:
        dtypes.update(counts=np.dtype("u1"), counts_wide_at=_I8, counts_wide=_I8)
    return dtypes


def bases_for(parents: int) -> int:
    """The number of stored bases of an indptr over ``parents`` nodes (parents + 1 values)."""
    return parents // BLOCK + 1


@dataclass(frozen=True)
class Level:
    """One level of the trie: the nodes of length ``depth`` under the ``parents`` nodes of length ``depth`` − 1.

    Args:
        depth (``int``): the length of its nodes, at least 2.
        parents (``int``): the nodes of length ``depth`` − 1 (the vocabulary's size at depth 2).
        arrays (``dict[str, numpy.ndarray]``): the files ``PTR_PARTS`` (and ``COUNT_PARTS`` when counted), as
            ``part_dtypes`` types them.
    """

    depth: int
    parents: int
    arrays: dict

    @property
    def nodes(self) -> int:
        return int(self.arrays["next"].shape[0])

    @property
    def counted(self) -> bool:
        return "counts" in self.arrays

    def kernel_view(self) -> tuple:
        """The arrays a kernel reads (:func:`ptr_at`, :func:`count_at`), as one tuple of read-only arrays (one numba
        type whether mapped from a file or in memory); empty counts when uncounted."""
        a = self.arrays
        counts = ((a["counts"], a["counts_wide_at"], a["counts_wide"]) if self.counted
                  else (np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)))
        return tuple(_readonly(x) for x in (a["indptr_base"], a["indptr"], a["indptr_wide_at"], a["indptr_wide"],
                                            a["next"], *counts))

    def ptrs(self, start: int, stop: int) -> np.ndarray:
        """indptr[start:stop] as int64."""
        a = self.arrays
        idx = np.arange(start, stop, dtype=np.int64)
        off = np.asarray(a["indptr"][start:stop])
        values = np.asarray(a["indptr_base"])[idx >> SHIFT] + off.astype(np.int64)
        wide = np.flatnonzero(off == PTR_ESCAPE)
        if wide.size:
            j = np.searchsorted(np.asarray(a["indptr_wide_at"]), idx[wide])
            values[wide] = np.asarray(a["indptr_base"])[idx[wide] >> SHIFT] + np.asarray(a["indptr_wide"])[j]
        return values

    def counts(self, start: int, stop: int) -> np.ndarray:
        """The counts of nodes start … stop − 1 as int64."""
        a = self.arrays
        narrow = np.asarray(a["counts"][start:stop])
        values = narrow.astype(np.int64)
        wide = np.flatnonzero(narrow == COUNT_ESCAPE)
        if wide.size:
            values[wide] = np.asarray(a["counts_wide"])[np.searchsorted(np.asarray(a["counts_wide_at"]),
                                                                         wide + start)]
        return values

    def parent_of(self, node: int) -> int:
        """The parent (a node of length depth − 1) of ``node``: the last p with indptr[p] ≤ node."""
        return int(_parent_of(self.kernel_view(), self.parents, np.int64(node)))


def empty_view(vocab_size: int) -> tuple:
    """The kernel view of a level with no parents and no nodes (pads a tuple of levels to one compiled type)."""
    return tuple(_readonly(x) for x in (
        np.zeros(1, np.int64), np.zeros(1, np.uint16), np.zeros(0, np.int64), np.zeros(0, np.int64),
        np.zeros(0, token_dtype(vocab_size)), np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)))


def _readonly(a) -> np.ndarray:
    view = np.ascontiguousarray(a).view(np.ndarray)
    view.flags.writeable = False
    return view


# ---- lookups (numba; the arrays were checked by gm_graphs.format.validate.check_level) ----------------------------

@numba.njit(nogil=True, cache=True, inline="always")
def _wide(narrow, escape, at, values, i):
    v = narrow[i]
    if v != escape:
        return np.int64(v)
    return values[np.searchsorted(at, i)]


@numba.njit(nogil=True, cache=True, inline="always")
def ptr_at(level, i):
    """indptr[i] of a level's kernel view."""
    return level[0][i >> SHIFT] + _wide(level[1], PTR_ESCAPE, level[2], level[3], i)


@numba.njit(nogil=True, cache=True, inline="always")
def count_at(level, p):
    """The count of node ``p`` of a counted level's kernel view."""
    return _wide(level[5], COUNT_ESCAPE, level[6], level[7], p)


@numba.njit(nogil=True, cache=True, inline="always")
def child(level, node, token):
    """The child of ``node`` whose last token is ``token`` (its index in the level), or −1."""
    nxt = level[4]
    lo = ptr_at(level, node)
    end = ptr_at(level, node + 1)
    hi = end
    while lo < hi:
        mid = (lo + hi) >> 1
        if np.int64(nxt[mid]) < token:
            lo = mid + 1
        else:
            hi = mid
    if lo < end and np.int64(nxt[lo]) == token:
        return lo
    return -1


@numba.njit(nogil=True, cache=True)
def find_context(levels, tokens, start, width, n):
    """The node of ``tokens[start:start + width]`` (``levels[k]`` is the level of length k + 2), or −1 when the
    corpus never has it or a token lies outside [0, n)."""
    t = np.int64(tokens[start])
    if t < 0 or t >= n:
        return -1
    node = t
    for d in range(1, width):
        t = np.int64(tokens[start + d])
        if t < 0 or t >= n:
            return -1
        node = child(levels[d - 1], node, t)
        if node < 0:
            return -1
    return node


@numba.njit(nogil=True, cache=True)
def _parent_of(level, parents, node):
    lo, hi = np.int64(0), np.int64(parents)  # the answer is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if ptr_at(level, mid) <= node:
            lo = mid
        else:
            hi = mid
    return lo


@numba.njit(nogil=True, cache=True, inline="always")
def _child_from(level, node, token, lo):
    """``child(level, node, token)`` found by stepping through the children from index ``lo`` on (ascending
    lookups step over each child once in all)."""
    nxt = level[4]
    end = ptr_at(level, node + 1)
    while lo < end and np.int64(nxt[lo]) < token:
        lo += 1
    if lo < end and np.int64(nxt[lo]) == token:
        return lo
    return -1


@numba.njit(nogil=True, cache=True)
def _locate(levels, keys, width, n, digits, path, out):
    """The node of each context key (its ``width`` tokens in base n; ascending, and above the keys of earlier
    calls, whose last key's tokens and nodes ``digits`` and ``path`` hold, −1 before the first call), into ``out``;
    the first key not found, or −1. A key walks down only from the first token where it leaves the key before it,
    and at that depth steps on from that key's node: one pass over the levels, not a search from the root per
    key (which took 80 % of writing the 4M corpus' tables)."""
    new = np.empty(width, np.int64)
    for i in range(keys.size):
        k = keys[i]
        for j in range(width - 1, -1, -1):
            new[j] = k % n
            k //= n
        d = 0
        while d < width and new[d] == digits[d] and path[d] >= 0:
            d += 1
        if d == width:  # the key repeats the one before it
            out[i] = path[width - 1]
            continue
        for e in range(d, width):
            t = new[e]
            if t < 0 or t >= n:
                node = np.int64(-1)
            elif e == 0:
                node = t
            elif e == d and path[e] >= 0:  # the parent of the key before, a later token: its later siblings
                node = _child_from(levels[e - 1], path[e - 1], t, path[e] + 1)
            else:
                node = _child_from(levels[e - 1], path[e - 1], t, ptr_at(levels[e - 1], path[e - 1]))
            digits[e] = t
            path[e] = node
            if node < 0:
                for f in range(e, width):
                    path[f] = -1
                out[i] = -1
                return i
        out[i] = path[width - 1]
    return -1


def node_keys(levels: list[Level], depth: int, start: int, stop: int, n: int) -> np.ndarray:
    """The keys (tokens in base n, oldest first) of the nodes start … stop − 1 of length ``depth``, ascending."""
    if depth == 1 or stop <= start:
        return np.arange(start, max(start, stop), dtype=np.int64)
    level = levels[depth - 2]
    first, last = level.parent_of(start), level.parent_of(stop - 1)
    spans = np.diff(np.clip(level.ptrs(first, last + 2), start, stop))
    parents = node_keys(levels, depth - 1, first, last + 1, n)
    return np.repeat(parents, spans) * n + np.asarray(level.arrays["next"][start:stop], dtype=np.int64)


# ---- writing: the trie streamed from ascending ranges of whole contexts --------------------------------------------

class LevelStream:
    """One level's arrays as they are produced, encoded and handed to ``put(part, values)`` (a file or a list)."""

    def __init__(self, depth: int, vocab_size: int, counted: bool, put):
        self.depth, self.counted, self._put = depth, counted, put
        self.parents = -1  # known at ``finish``
        self.dtypes = part_dtypes(vocab_size, counted)
        self.ptrs = 0  # indptr values written
        self.nodes = 0
        self._base = 0  # the base of the block the next indptr value falls in

    def add_ptrs(self, values: np.ndarray) -> None:
        """The next indptr values (ascending, int64)."""
        if not values.size:
            return
        idx = self.ptrs + np.arange(values.size, dtype=np.int64)
        starts = (idx & (BLOCK - 1)) == 0
        bases = values[starts]
        off = values - np.concatenate(([self._base], bases))[np.cumsum(starts)]
        if bases.size:
            self._base = int(bases[-1])
        wide = np.flatnonzero(off >= PTR_ESCAPE)
        self._put("indptr_base", bases.astype(_I8))
        self._put("indptr", np.minimum(off, PTR_ESCAPE).astype(self.dtypes["indptr"]))
        self._put("indptr_wide_at", idx[wide])
        self._put("indptr_wide", off[wide])
        self.ptrs += values.size

    def add_nodes(self, tokens: np.ndarray, counts: np.ndarray | None = None) -> None:
        """The next nodes' last tokens (and, on a counted level, their counts)."""
        self._put("next", tokens.astype(self.dtypes["next"]))
        if self.counted:
            counts = np.asarray(counts, dtype=np.int64)
            wide = np.flatnonzero(counts >= COUNT_ESCAPE)
            self._put("counts", np.minimum(counts, COUNT_ESCAPE).astype(self.dtypes["counts"]))
            self._put("counts_wide_at", self.nodes + wide.astype(np.int64))
            self._put("counts_wide", counts[wide])
        self.nodes += tokens.size

    def finish(self, parents: int) -> None:
        """End the indptr over ``parents`` nodes: the parents still to come have no children."""
        if self.ptrs > parents + 1:
            raise AssertionError(f"level {self.depth}: {self.ptrs} indptr values for {parents} parents")
        self.parents = parents
        self.add_ptrs(np.full(parents + 1 - self.ptrs, self.nodes, dtype=np.int64))


class LowestOrder:
    """The levels 2 … n of the lowest counted order n: its contexts' prefixes, then its n-grams."""

    def __init__(self, order: int, vocab_size: int, streams: dict[int, LevelStream]):
        self.order, self.n, self.streams = order, vocab_size, streams
        self._last = {d: -1 for d in range(1, order)}  # the last prefix of each length seen

    def add(self, contexts: np.ndarray, lengths: np.ndarray, nxt: np.ndarray, counts: np.ndarray) -> None:
        """A range of whole contexts (keys ascending, above the last range's), each's number of entries, and the
        entries' next tokens and counts."""
        if not contexts.size:
            return
        n, order = self.n, self.order
        new = {}
        for d in range(1, order):
            prefix = contexts // n ** (order - 1 - d)
            fresh = np.empty(prefix.size, dtype=bool)
            fresh[0] = prefix[0] != self._last[d]
            fresh[1:] = prefix[1:] != prefix[:-1]
            new[d] = (prefix, fresh)
        for d in range(2, order + 1):
            s = self.streams[d]
            prefix, fresh = new[d] if d < order else (contexts, np.ones(contexts.size, dtype=bool))
            # each new parent (a prefix one shorter, or a new first token) starts at the nodes created before it
            widths = lengths if d == order else fresh.astype(np.int64)
            before = s.nodes + np.cumsum(widths) - widths
            parent, pfresh = new[d - 1]
            if d == 2:  # the parents are every token: those skipped point where the next one starts
                at = np.flatnonzero(pfresh)
                gaps = parent[at] - np.concatenate(([self._last[1]], parent[at[:-1]]))
                s.add_ptrs(np.repeat(before[at], gaps))
            else:
                s.add_ptrs(before[pfresh])
            if d < order:
                s.add_nodes(prefix[fresh] % n)
        for d in range(1, order):
            self._last[d] = int(new[d][0][-1])
        self.streams[order].add_nodes(nxt, counts)

    def finish(self) -> None:
        for d in range(2, self.order + 1):
            self.streams[d].finish(self.n if d == 2 else self.streams[d - 1].nodes)


class HigherOrder:
    """The level n of an order above the lowest: each n-gram hung under its context, an (n−1)-gram of the level
    below (``below``: the levels 2 … n − 1, already written)."""

    def __init__(self, order: int, vocab_size: int, stream: LevelStream, below: list[Level]):
        self.order, self.n, self.stream = order, vocab_size, stream
        self._parents = below[-1].nodes
        self._views = tuple(level.kernel_view() for level in below)
        self._cursor = 0  # the next parent whose indptr value is still to come
        self._digits = np.full(order - 1, -1, np.int64)  # the last context located: its tokens and their nodes
        self._path = np.full(order - 1, -1, np.int64)

    def add(self, contexts: np.ndarray, lengths: np.ndarray, nxt: np.ndarray, counts: np.ndarray) -> None:
        if not contexts.size:
            return
        parents = np.empty(contexts.size, dtype=np.int64)
        missing = _locate(self._views, contexts, self.order - 1, self.n, self._digits, self._path, parents)
        if missing >= 0 or parents[0] < self._cursor:
            raise AssertionError(f"an {self.order}-gram context ({int(contexts[max(missing, 0)])}) is not an "
                                 f"{self.order - 1}-gram of the table below it; count every order in one pass")
        s = self.stream
        widths = np.zeros(int(parents[-1]) + 1 - self._cursor, dtype=np.int64)
        widths[parents - self._cursor] = lengths
        s.add_ptrs(s.nodes + np.cumsum(widths) - widths)
        s.add_nodes(nxt, counts)
        self._cursor = int(parents[-1]) + 1

    def finish(self) -> None:
        self.stream.finish(self._parents)


@numba.njit(nogil=True, cache=True)
def split_keys(keys, n, contexts, indptr, nxt):
    """Sorted keys context·n + w → the distinct contexts, where each starts and the w's, in one pass (into the
    buffers, each at least as long as the keys); the number of contexts. (NumPy's //, %, a diff and a gather take
    ~20× longer over the same keys.)"""
    m = 0
    prev = np.int64(-1)
    for i in range(keys.size):
        c = keys[i] // n
        nxt[i] = keys[i] - c * n
        if c != prev:
            contexts[m] = c
            indptr[m] = i
            m += 1
            prev = c
    return m


def split_contexts(keys: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted unique keys context·N + w → (the distinct contexts, each's number of entries, the w's)."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    contexts, starts, nxt = np.empty(keys.size, np.int64), np.empty(keys.size, np.int64), np.empty(keys.size, np.int64)
    m = split_keys(keys, np.int64(vocab_size), contexts, starts, nxt)
    return contexts[:m], np.diff(np.append(starts[:m], keys.size)), nxt
