"""Structural checks of a graph folder: the manifest's schema and every array's invariants.

Everything a solver kernel indexes with is checked before it is handed out, so that a crafted or damaged folder
ends in a one-line :class:`GraphFormatError`, never in an out-of-bounds read: CSR ``indptr`` starts at 0, never
decreases and ends at nnz, every column index is in [0, N), shards cover [0, N) contiguously; n-gram contexts
ascend strictly below N^(n−1), successors are in [0, N), counts ≥ 1; the stats are N long and ≥ 0. The array
scans are numba loops (one pass, no temporaries) over windows of a file, whose pages are dropped as the scan moves
on (so checking a graph of any size holds a window of it), run once per file identity (``gm_graphs.store.verified``).
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import re
import shlex
from collections import Counter
from pathlib import Path

import numba
import numpy as np

from gm_graphs.count.ngram_trie import COUNT_ESCAPE, PTR_ESCAPE, bases_for, part_dtypes, ptr_at
from gm_graphs.errors import GraphFormatError
from gm_graphs.store.folders import GRAPH_FORMAT, NAME, graphs_root
from gm_graphs.store.kernel_cache import ensure_cache_dir

ensure_cache_dir()  # before the cached kernels below are defined

FORMAT_VERSION = 2  # 2: the n-gram tables as one trie (gm_graphs.count.ngram_trie); 1 stored them flat
REBUILD = "rebuild the graph (graphmax build … --overwrite)"
OPERATOR_NAME = re.compile(r"(order|mixture)[1-9][0-9]{0,2}")
NGRAM_ORDER = re.compile(r"[3-9]")
NGRAM_LEVEL = re.compile(r"[2-9]")
STATS = ("row_counts", "successors", "predecessors", "column_counts")
CSR_PARTS = ("indptr", "indices", "data")
V1_NGRAM_PARTS = ("contexts", "indptr", "next", "counts")  # format 1's flat tables, read by gm_graphs.upgrade
_SHA = re.compile(r"[0-9a-f]{64}")
MAX_INDEX = 2**31 - 1  # vocabularies and rows fit int32 node ids


def fail(root, what: str) -> GraphFormatError:
    """The one-line error of a damaged graph folder, naming it and the fix."""
    return GraphFormatError(f"graph {root}: {what}; {REBUILD}")


# ---- the manifest -------------------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _got(v) -> str:
    """What a field holds instead of what it should, its type named: '1' and 1 must not read alike."""
    if v is None:
        return "but it is missing (or null)"
    shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
    return f"got {shown} (a {type(v).__name__})"


def is_sha256(v) -> bool:
    """Whether ``v`` is a SHA-256 as graphmax records them: 64 lowercase hex digits."""
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


class _Schema:
    """Typed access to a manifest, failing with the field's path and what was expected."""

    def __init__(self, root):
        self.root = root
        self.files: dict[str, str] = {}  # file → the field whose entry names it

    @staticmethod
    def at(where: str, key) -> str:
        return f"{where}.{key}" if where else str(key)

    def need(self, ok: bool, where: str, expected: str, value) -> None:
        if not ok:
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise fail(self.root, f"manifest field {where} should be {expected}, got {shown}")

    def dict(self, d: dict, key: str, where: str, optional: bool = False):
        if optional and key not in d:
            return None
        v = d.get(key)
        self.need(isinstance(v, dict), self.at(where, key), "an object", v)
        return v

    def int(self, d: dict, key: str, where: str, lo: int = 0, hi: int | None = None) -> int:
        v = d.get(key)
        self.need(_is_int(v) and v >= lo and (hi is None or v <= hi), self.at(where, key),
                  f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""), v)
        return v

    def str(self, d: dict, key: str, where: str) -> str:
        v = d.get(key)
        self.need(isinstance(v, str), self.at(where, key), "a string", v)
        return v

    def number(self, d: dict, key: str, where: str, lo: float = 0.0) -> float:
        v = d.get(key)
        self.need(_is_number(v) and v >= lo, self.at(where, key), f"a finite number >= {lo:g}", v)
        return float(v)

    def file(self, d: dict, key: str, where: str) -> dict:
        e = self.dict(d, key, where)
        where = self.at(where, key)
        name = e.get("file")
        self.need(isinstance(name, str), f"{where}.file", "a relative path", name)
        check_relative(self.root, name, where)
        if name in self.files:  # two arrays read from one file: each entry is checked as if it were the only one
            raise fail(self.root, f"manifest fields {self.files[name]}.file and {where}.file name one file "
                                  f"{name!r}; each file has one entry")
        self.files[name] = where
        self.int(e, "bytes", where)
        sha = e.get("sha256")
        self.need(isinstance(sha, str) and bool(_SHA.fullmatch(sha)), f"{where}.sha256", "64 hex digits", sha)
        return e


def check_relative(root, name: str, where: str) -> None:
    """A manifest file entry: a relative POSIX path inside the folder (no '..', not absolute, no odd characters)."""
    parts = name.split("/")
    bad = (not name or len(name) > 1024 or name.startswith("/") or "\\" in name or "\0" in name
           or any(p in ("", ".", "..") for p in parts) or not name.isprintable())
    if bad:
        raise fail(root, f"manifest {where} names {name[:80]!r}, which is not a path inside the graph folder")


def check_manifest(root, m, v1_ngrams: bool = False) -> None:
    """The manifest's schema: every field graphmax reads, with its type and range, and its file entries' paths;
    with ``v1_ngrams``, a format-1 graph's n-gram tables are read (by ``gm_graphs.upgrade_graph`` only)."""
    s = _Schema(root)
    s.need(isinstance(m, dict), "(top level)", "an object", type(m).__name__)
    version = m.get("format_version")
    if not _is_int(version):  # '1', 1.0 or true would read as a mismatch of equal versions
        raise fail(root, f"manifest field format_version should be an integer, {_got(version)}; this graphmax "
                         f"reads version {FORMAT_VERSION}")
    if version == 1 and "ngrams" in m and not v1_ngrams:
        raise GraphFormatError(f"graph {root} stores its n-gram tables in format 1; convert it in place with "
                               f"`{upgrade_command(root)}` (or gm_graphs.upgrade_graph)")
    if version not in (1, FORMAT_VERSION):  # a format-1 graph without n-gram tables is laid out as format 2
        raise GraphFormatError(f"graph {root} has format version {version!r}; this graphmax reads version "
                               f"{FORMAT_VERSION}; rebuild the graph with this version")
    s.need(m.get("format") == GRAPH_FORMAT, "format", repr(GRAPH_FORMAT), m.get("format"))
    s.str(m, "name", "")
    tok = s.dict(m, "tokenizer", "")
    n = s.int(tok, "vocab_size", "tokenizer", lo=1, hi=MAX_INDEX)
    s.str(tok, "name", "tokenizer")
    s.str(tok, "vocab_sha256", "tokenizer")
    if "split_sha256" in tok:  # recorded since graphs record how their tokenizer splits text; older ones lack it
        s.need(is_sha256(tok["split_sha256"]), "tokenizer.split_sha256", "64 lowercase hex digits",
               tok["split_sha256"])
    s.number(m, "eps", "")
    corpus = s.dict(m, "corpus", "")
    for key in ("documents", "tokens", "bigrams", "distinct_bigrams", "empty_skipped", "undecodable_documents",
                "replaced_sequences"):
        s.int(corpus, key, "corpus")
    files = corpus.get("files")
    s.need(isinstance(files, list), "corpus.files", "a list", files)
    for i, f in enumerate(files):
        s.need(isinstance(f, dict), f"corpus.files[{i}]", "an object", f)
        s.str(f, "path", f"corpus.files[{i}]")
        s.str(f, "sha256", f"corpus.files[{i}]")
        s.int(f, "bytes", f"corpus.files[{i}]")
    per_file = s.dict(corpus, "per_file", "corpus")
    s.need(all(_is_int(v) and v >= 0 for v in per_file.values()), "corpus.per_file", "counts per file", per_file)
    s.dict(corpus, "options", "corpus")
    counts = s.dict(m, "counts", "")
    s.file(counts, "parquet", "counts")
    check_shards(s, counts.get("shards"), "counts.shards", n)
    ops = s.dict(m, "operators", "")
    s.need("order1" in ops, "operators", "an object with order1", sorted(ops))
    for name, op in ops.items():
        where = f"operators.{name}"
        s.need(bool(OPERATOR_NAME.fullmatch(name)), "operators", "keys like order2 or mixture3", name)
        s.need(isinstance(op, dict), where, "an object", op)
        nnz = s.int(op, "nnz", where)
        shards = check_shards(s, op.get("shards"), f"{where}.shards", n)
        s.need(sum(sh["nnz"] for sh in shards) == nnz, f"{where}.nnz", "the sum of its shards' nnz", nnz)
        s.file(op, "edges", where)
        s.need(isinstance(op.get("pruned"), bool), f"{where}.pruned", "true or false", op.get("pruned"))
        if "row_mass" in op:
            s.file(op, "row_mass", where)
    ngrams = s.dict(m, "ngrams", "", optional=True)
    if ngrams is not None and version == 1:
        _check_v1_ngrams(s, ngrams, n)
    elif ngrams is not None:
        check_ngram_levels(s, ngrams, n)
    stats = s.dict(m, "stats", "")
    s.need(sorted(stats) == sorted(STATS), "stats", f"the files {STATS}", sorted(stats))
    for name in STATS:
        s.file(stats, name, "stats")
    if m.get("decoder") is not None:
        check_decoder(root, m["decoder"])


def upgrade_command(root) -> str:
    """The command that upgrades the graph folder ``root``, as the user named it: by name where it is a stored
    graph's folder, else by path; quoted for the shell, so that no name or path can be taken for a command."""
    folder = Path(root)
    try:
        stored = folder.parent == graphs_root() and bool(NAME.fullmatch(folder.name))
    except (RuntimeError, KeyError):  # no home to be found (Path.home()): the path names the graph all the same
        stored = False
    return (f"graphmax graphs upgrade {shlex.quote(folder.name)}" if stored
            else f"graphmax graphs upgrade --path {shlex.quote(str(folder))}")


def counted_orders(s: _Schema, orders: dict, n: int) -> list[int]:
    """The orders of ``ngrams.orders``, format 1's or 2's alike: at least one, each 3 … 9, consecutive (each table
    hangs under the one below it), with keys that fit int64 for N = ``n``. One check for both formats, so that
    ``upgrade_graph`` refuses up front what it could not write as format 2."""
    s.need(bool(orders) and all(isinstance(o, str) and NGRAM_ORDER.fullmatch(o) for o in orders), "ngrams.orders",
           "orders like 3, 4", sorted(orders))
    counted = sorted(int(o) for o in orders)
    s.need(counted == list(range(counted[0], counted[-1] + 1)), "ngrams.orders", "consecutive orders, like 3, 4",
           sorted(orders))
    s.need(float(n) ** counted[-1] < 2.0 ** 63, "ngrams.orders", f"orders whose keys fit int64 for N = {n}",
           sorted(orders))
    return counted


def _check_v1_ngrams(s: _Schema, ngrams: dict, n: int) -> None:
    orders = s.dict(ngrams, "orders", "ngrams")
    counted_orders(s, orders, n)
    for order, e in orders.items():
        where = f"ngrams.orders.{order}"
        s.need(isinstance(e, dict), where, "an object", e)
        s.int(e, "contexts", where)
        s.int(e, "entries", where)
        parts = s.dict(e, "files", where)
        s.need(sorted(parts) == sorted(V1_NGRAM_PARTS), f"{where}.files", f"the files {V1_NGRAM_PARTS}",
               sorted(parts))
        for part in V1_NGRAM_PARTS:
            s.file(parts, part, f"{where}.files")


def check_ngram_levels(s: _Schema, ngrams: dict, n: int) -> None:
    """The n-gram trie's entry: levels 2 … m (consecutive), the orders n₀ … m each a counted level, the levels
    below n₀ uncounted, each level's parents the nodes of the one below (N at level 2)."""
    levels = s.dict(ngrams, "levels", "ngrams")
    orders = s.dict(ngrams, "orders", "ngrams")
    s.need(all(isinstance(d, str) and NGRAM_LEVEL.fullmatch(d) for d in levels) and len(levels) >= 2,
           "ngrams.levels", "levels like 2, 3, 4", sorted(levels))
    depths = sorted(int(d) for d in levels)
    s.need(depths == list(range(2, depths[-1] + 1)) and float(n) ** depths[-1] < 2.0 ** 63, "ngrams.levels",
           f"consecutive levels from 2 whose keys fit int64 for N = {n}", sorted(levels))
    counted = counted_orders(s, orders, n)
    s.need(counted[-1] == depths[-1], "ngrams.orders", f"the consecutive orders up to the top level {depths[-1]}",
           sorted(orders))
    for d in depths:
        where = f"ngrams.levels.{d}"
        e = levels[str(d)]
        s.need(isinstance(e, dict), where, "an object", e)
        s.int(e, "parents", where)
        s.int(e, "nodes", where)
        parts = s.dict(e, "files", where)
        want = sorted(part_dtypes(n, d in counted))
        s.need(sorted(parts) == want, f"{where}.files", f"the files {want}", sorted(parts))
        for part in want:
            s.file(parts, part, f"{where}.files")
    for o in counted:
        where = f"ngrams.orders.{o}"
        e = orders[str(o)]
        s.need(isinstance(e, dict), where, "an object", e)
        s.int(e, "contexts", where)
        s.int(e, "entries", where)
    s.need(levels["2"]["parents"] == n, "ngrams.levels.2.parents", f"{n} (N: level 2's parents are the tokens)",
           levels["2"]["parents"])
    for d in depths:  # a level's nodes are recorded up to three times: the field that disagrees is the one named
        said = {f"ngrams.levels.{d}.nodes": levels[str(d)]["nodes"]}
        if d + 1 in depths:
            said[f"ngrams.levels.{d + 1}.parents"] = levels[str(d + 1)]["parents"]
        if d in counted:
            said[f"ngrams.orders.{d}.entries"] = orders[str(d)]["entries"]
        _check_agree(s, said, f"the nodes of level {d}")


def _check_agree(s: _Schema, said: dict[str, int], what: str) -> None:
    """Fields that each record ``what``: equal, else the one that differs from the others, or both of two."""
    values = Counter(said.values())
    if len(values) == 1:
        return
    value, times = values.most_common(1)[0]
    if times * 2 > len(said):
        field = next(f for f, v in said.items() if v != value)
        others = " and ".join(f for f, v in said.items() if v == value)
        s.need(False, field, f"{value} ({what}, as {others} say)", said[field])
    shown = " and ".join(f"{f} ({v})" for f, v in said.items())
    raise fail(s.root, f"manifest fields {shown} disagree, and each is {what}")


def check_shards(s: _Schema, shards, where: str, n: int) -> list[dict]:
    """Shard entries whose row ranges cover [0, N) contiguously, each with its three CSR files."""
    s.need(isinstance(shards, list) and len(shards) > 0, where, "a non-empty list", shards)
    start = 0
    for i, sh in enumerate(shards):
        w = f"{where}[{i}]"
        s.need(isinstance(sh, dict), w, "an object", sh)
        rows = sh.get("rows")
        s.need(isinstance(rows, list) and len(rows) == 2 and all(_is_int(r) for r in rows)
               and rows[0] == start and start <= rows[1] <= n, f"{w}.rows",
               f"[{start}, end] with {start} <= end <= {n} (shards cover the rows in order)", rows)
        start = rows[1]
        s.int(sh, "nnz", w)
        parts = s.dict(sh, "files", w)
        s.need(sorted(parts) == sorted(CSR_PARTS), f"{w}.files", f"the files {CSR_PARTS}", sorted(parts))
        for part in CSR_PARTS:
            s.file(parts, part, f"{w}.files")
    s.need(start == n, f"{where}", f"shards covering all {n} rows", start)
    return shards


MAX_DECODER_BYTES = 64 << 10  # a stored decoder choice is a few settings: far below this


def check_decoder(root, d) -> None:
    """The decoder choice stored with the graph: a JSON object of at most ``MAX_DECODER_BYTES``. Its fields are
    gm_solver's to read and check (``gm_solver.DecoderChoice``); the graph folder only carries it."""
    s = _Schema(root)
    s.need(isinstance(d, dict), "decoder", "an object", d)
    size = len(json.dumps(d, ensure_ascii=False).encode("utf-8"))
    s.need(size <= MAX_DECODER_BYTES, "decoder", f"at most {MAX_DECODER_BYTES:,} bytes of JSON", f"{size:,} bytes")


# ---- the arrays ---------------------------------------------------------------------------------------------------

_WINDOW = 1 << 23  # values a check reads at a time: a memory-mapped window's pages are dropped after it
_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4


def _libc_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()  # None where libc lacks it: the pages then stay until the array is dropped


def _drop_pages(values: np.ndarray, start: int, stop: int) -> None:
    """Drop the pages of ``values[start:stop]`` from this process when the array maps a file (they stay in the page
    cache), so that checking a file of any size holds at most a window of it in memory."""
    if _madvise is None or not isinstance(values, np.memmap) or stop <= start:
        return
    lo = values.ctypes.data + start * values.itemsize
    hi = values.ctypes.data + stop * values.itemsize
    lo -= lo % _PAGE
    _madvise(lo, hi - lo, _MADV_DONTNEED)


def _scan(kernel, values: np.ndarray, *args, overlap: int = 0) -> int:
    """``kernel(window, *args)`` (the first bad position in the window, or −1) over ``values`` a window at a time;
    windows overlap by ``overlap`` values, so that a check against the predecessor sees it."""
    for start in range(0, values.shape[0], _WINDOW):
        a = max(0, start - overlap)
        b = min(values.shape[0], start + _WINDOW)
        pos = kernel(values[a:b], *args)
        _drop_pages(values, a, b)
        if pos >= 0:
            return a + pos
    return -1


@numba.njit(cache=True)
def _first_decrease(values):
    """Position of the first value below its predecessor, else -1."""
    for p in range(1, values.size):
        if values[p] < values[p - 1]:
            return p
    return -1


@numba.njit(cache=True)
def _first_outside(values, n_cols):
    """Position of the first value outside [0, n_cols), else -1."""
    for p in range(values.size):
        if values[p] < 0 or values[p] >= n_cols:
            return p
    return -1


def _csr_problem(indptr, indices, n_cols) -> tuple[int, int]:
    """(code, position): 0 fine; 1 indptr[0] ≠ 0; 2 indptr decreases; 3 indptr[-1] ≠ nnz; 4 index out of range."""
    if indptr[0] != 0:
        return 1, 0
    pos = _scan(_first_decrease, indptr, overlap=1)
    if pos >= 0:
        return 2, pos
    if indptr[indptr.size - 1] != indices.size:
        return 3, indptr.size - 1
    pos = _scan(_first_outside, indices, n_cols)
    if pos >= 0:
        return 4, pos
    return 0, 0


@numba.njit(cache=True)
def _first_below(values, low):
    """Position of the first value < low (or not a number), else -1."""
    for p in range(values.size):
        if not values[p] >= low:
            return p
    return -1


@numba.njit(cache=True)
def _first_not_finite_or_negative(values):
    for p in range(values.size):
        v = values[p]
        if not (v >= 0 and v < np.inf):
            return p
    return -1


@numba.njit(cache=True)
def _first_not_ascending(values, bound):
    """Position of the first value ≤ its predecessor, < 0 or ≥ bound, else -1."""
    for p in range(values.size):
        v = values[p]
        if v < 0 or v >= bound or (p > 0 and v <= values[p - 1]):
            return p
    return -1


_CSR_PROBLEMS = {1: "indptr does not start at 0", 2: "indptr decreases", 3: "indptr does not end at nnz",
                 4: "a column index is outside [0, N)"}


def check_csr(root, what: str, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, rows: int, n: int,
              nnz: int, counts: bool) -> None:
    """One CSR shard of ``rows`` rows over ``n`` columns with ``nnz`` entries: counts ≥ 1, or weights finite ≥ 0."""
    if indptr.dtype != indices.dtype:
        raise fail(root, f"{what}: indptr is {indptr.dtype} but indices is {indices.dtype} (they must agree)")
    if indptr.shape != (rows + 1,):
        raise fail(root, f"{what}: indptr has {indptr.shape[0]} entries for {rows} rows (expected {rows + 1})")
    if indices.shape != (nnz,) or data.shape != (nnz,):
        raise fail(root, f"{what}: indices/data have {indices.shape[0]}/{data.shape[0]} entries, the manifest says "
                          f"nnz = {nnz}")
    code, pos = _csr_problem(indptr, indices, n)
    if code:
        raise fail(root, f"{what}: {_CSR_PROBLEMS[code]} (at position {pos})")
    pos = _scan(_first_below, data, 1) if counts else _scan(_first_not_finite_or_negative, data)
    if pos >= 0:
        raise fail(root, f"{what}: entry {pos} is {data[pos].item()!r}, "
                          f"{'counts must be >= 1' if counts else 'weights must be finite and >= 0'}")


@numba.njit(cache=True)
def _escape_problem(narrow, at, values, a, b, j, escape):
    """In narrow[a:b]: every ``escape`` value has its position next in the side table (``at[j]``) with a value
    ≥ ``escape``, and the side table names no other position. (first bad position or −1, the next j)."""
    for i in range(a, b):
        if narrow[i] == escape:
            if j >= at.size or at[j] != i or values[j] < escape:
                return i, j
            j += 1
        elif j < at.size and at[j] <= i:
            return i, j
    return -1, j


@numba.njit(cache=True)
def _ptr_next_problem(level, a, b, prev, n):
    """indptr[a:b] of a level (its side table checked) from 0, never decreasing, within the nodes, and each parent's
    next tokens in [0, n) and strictly ascending: (code, position, the last indptr value)."""
    nxt = level[4]
    for i in range(a, b):
        v = ptr_at(level, i)
        if i == 0 and v != 0:
            return 1, i, prev
        if v < prev:
            return 2, i, prev
        if v > nxt.size:
            return 3, i, prev
        for e in range(prev, v):
            if np.int64(nxt[e]) < 0 or np.int64(nxt[e]) >= n:
                return 4, e, prev
            if e > prev and nxt[e] <= nxt[e - 1]:
                return 5, e, prev
        prev = v
    return 0, 0, prev


_LEVEL_PROBLEMS = {1: "indptr does not start at 0", 2: "indptr decreases", 3: "indptr goes past the nodes",
                   4: "a next token is outside [0, N)", 5: "a parent's next tokens do not ascend"}


def check_level(root, depth: int, a: dict[str, np.ndarray], parents: int, nodes: int, n: int, counted: bool) -> None:
    """One level of the n-gram trie (``ngram_trie``): sizes, side tables, indptr from 0 to the nodes, next tokens
    in [0, N) ascending under each parent, counts ≥ 1; windows at a time."""
    what = f"level {depth} of the n-gram tables"
    sizes = {"indptr_base": bases_for(parents), "indptr": parents + 1, "next": nodes}
    if counted:
        sizes["counts"] = nodes
    for part, size in sizes.items():
        if a[part].shape != (size,):
            raise fail(root, f"{what}: {part} has {a[part].shape[0]:,} values, expected {size:,}")
    sides = [("indptr", PTR_ESCAPE)] + ([("counts", COUNT_ESCAPE)] if counted else [])
    for part, escape in sides:
        at, values = a[f"{part}_wide_at"], a[f"{part}_wide"]
        if at.shape != values.shape:
            raise fail(root, f"{what}: {part}_wide_at and {part}_wide differ in length")
        j = 0
        for lo in range(0, a[part].shape[0], _WINDOW):
            hi = min(a[part].shape[0], lo + _WINDOW)
            pos, j = _escape_problem(a[part], at, values, lo, hi, j, escape)
            _drop_pages(a[part], lo, hi)
            if pos >= 0:
                raise fail(root, f"{what}: {part} {pos} disagrees with its side table of wide values")
        if j != at.shape[0]:
            raise fail(root, f"{what}: {part}_wide_at names positions that are not escaped")
    view = (a["indptr_base"], a["indptr"], a["indptr_wide_at"], a["indptr_wide"], a["next"])
    prev = 0
    for lo in range(0, parents + 1, _WINDOW):
        hi = min(parents + 1, lo + _WINDOW)
        code, pos, last = _ptr_next_problem(view, lo, hi, prev, n)
        _drop_pages(a["indptr"], lo, hi)
        _drop_pages(a["next"], prev, last)
        if code:
            raise fail(root, f"{what}: {_LEVEL_PROBLEMS[code]} (at position {pos})")
        prev = last
    if prev != nodes:
        raise fail(root, f"{what}: indptr ends at {prev:,}, not at its {nodes:,} nodes")
    if counted:
        pos = _scan(_first_below, a["counts"], 1)
        if pos >= 0:
            raise fail(root, f"{what}: count {pos} is 0; counts must be >= 1")


def check_v1_ngram_table(root, order: int, contexts, indptr, nxt, counts, n: int, n_contexts: int,
                         entries: int) -> None:
    """A format-1 table (contexts, indptr, next, counts), before ``gm_graphs.upgrade`` converts it."""
    what = f"the {order}-gram table"
    if indptr.dtype != counts.dtype:
        raise fail(root, f"{what}: indptr is {indptr.dtype} but counts is {counts.dtype} (they must agree)")
    if contexts.shape != (n_contexts,) or indptr.shape != (n_contexts + 1,):
        raise fail(root, f"{what}: {contexts.shape[0]} contexts and {indptr.shape[0]} indptr entries, the manifest "
                          f"says {n_contexts} contexts")
    if nxt.shape != (entries,) or counts.shape != (entries,):
        raise fail(root, f"{what}: next/counts have {nxt.shape[0]}/{counts.shape[0]} entries, the manifest says "
                          f"{entries}")
    pos = _scan(_first_not_ascending, contexts, n ** (order - 1), overlap=1)
    if pos >= 0:
        raise fail(root, f"{what}: context {pos} is not above the previous one or not below N^{order - 1}")
    code, pos = _csr_problem(indptr, nxt, n)
    if code:
        problem = _CSR_PROBLEMS[code].replace("a column index", "a next token")
        raise fail(root, f"{what}: {problem} (at position {pos})")
    pos = _scan(_first_below, counts, 1)
    if pos >= 0:
        raise fail(root, f"{what}: count {pos} is {counts[pos]}; counts must be >= 1")


def ngram_range_problem(order: int, contexts, nxt, counts, n: int, after: int) -> str | None:
    """What :func:`check_v1_ngram_table` would find wrong in one range of a table as its writer produces it, or None:
    contexts ascending from above ``after`` and below N^(order−1), next tokens in [0, N), counts ≥ 1. (The writer
    makes indptr itself, ascending from 0 to the entries, and counts the contexts and entries of the manifest.)"""
    pos = _first_not_ascending(contexts, n ** (order - 1))
    if pos >= 0 or (contexts.size and contexts[0] <= after):
        return f"context {max(pos, 0)} of the range is not above the one before it or not below N^{order - 1}"
    pos = _first_outside(nxt, n)
    if pos >= 0:
        return f"next token {pos} of the range is outside [0, N)"
    pos = _first_below(counts, 1)
    if pos >= 0:
        return f"count {pos} of the range is {counts[pos]}; counts must be >= 1"
    return None


def check_stats(root, stats: dict[str, np.ndarray], n: int, nnz: int, total: int) -> None:
    """The per-node arrays: N long, ≥ 0, and consistent with the counts' nnz and total."""
    for name, a in stats.items():
        if a.shape != (n,):
            raise fail(root, f"stats/{name} has shape {a.shape}, expected ({n},)")
        pos = _first_below(a, 0)
        if pos >= 0:
            raise fail(root, f"stats/{name}[{pos}] is {a[pos]}; the stats are >= 0")
    succ, pred = stats["successors"], stats["predecessors"]
    rows, cols = stats["row_counts"], stats["column_counts"]
    if int(succ.sum()) != nnz or int(pred.sum()) != nnz:
        raise fail(root, f"stats: successors and predecessors sum to {int(succ.sum())} and {int(pred.sum())}, "
                          f"the counts have {nnz} non-zeros")
    if int(rows.sum()) != total or int(cols.sum()) != total:
        raise fail(root, f"stats: row and column counts sum to {int(rows.sum())} and {int(cols.sum())}, the corpus "
                          f"has {total} bigrams")
    if int(succ.max(initial=0)) > n or int(pred.max(initial=0)) > n or bool(np.any(rows < succ)) \
            or bool(np.any((succ == 0) != (rows == 0))):
        raise fail(root, "stats: a node's successors exceed N or its row count, or a row count has no successors")


def check_row_mass(root, what: str, kept: np.ndarray, n: int) -> None:
    if kept.shape != (n,):
        raise fail(root, f"{what} has shape {kept.shape}, expected ({n},)")
    pos = _first_not_finite_or_negative(kept)
    if pos >= 0 or (kept.size and float(kept.max()) > 1.0 + 1e-5):
        raise fail(root, f"{what} holds values outside [0, 1]")
