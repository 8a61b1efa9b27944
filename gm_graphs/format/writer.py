"""Writing a graph's arrays as they stream in, so that no array of the graph is ever held whole in memory.

Counts arrive as sorted (key, count) ranges (``gm_graphs.count.runs``, or the Ray engine's merged partitions): the
bigram counts a range of whole rows at a time, the n-gram tables a range of whole contexts at a time. Each array is one
``.npy`` file written in pieces; its header (whose shape is only known at the end) is written first with the same
length and filled in at close, then the file is read back and hashed (by a thread pool, beside the next work).
What is written does not depend on where the ranges were cut: shards split at row boundaries by ``shard_nnz``
alone and Parquet row groups hold ``ROW_GROUP`` rows, so every engine writes the same bytes.

The n-gram tables are the levels of one trie (``gm_graphs.count.ngram_trie``), encoded as their ranges come. A range
can also arrive laid out in files (``write_range``, run by a Ray worker where the graph's folder is on storage every
node sees): the tables' writer checks what the worker reports, then reads the files a range at a time.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gm_graphs.count.ngram_trie import HigherOrder, Level, LevelStream, LowestOrder, part_dtypes, split_keys
from gm_graphs.format.graph_files import sha256_file
from gm_graphs.format.validate import ngram_range_problem
from gm_graphs.store import npy
from gm_graphs.store.faults import fault_point
from gm_graphs.store.kernel_cache import ensure_cache_dir
from gm_graphs.store.pagecache import DropBehind

ensure_cache_dir()  # before the cached kernels below are defined

ROW_GROUP = 1 << 20  # rows per Parquet row group
RANGE_PARTS = ("contexts", "indptr", "next", "counts")  # the files of a range laid out by ``write_range``


class Hasher:
    """SHA-256 of finished files, computed by worker threads while the build goes on (hashlib releases the GIL)."""

    def __init__(self, workers: int = 1):
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="hash")

    def entry(self, root: Path, path: Path) -> Future:
        def run() -> dict:
            return {"file": path.relative_to(root).as_posix(), "bytes": path.stat().st_size,
                    "sha256": sha256_file(path, drop=True)}
        return self._pool.submit(run)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def resolve(value):
    """``value`` with every Future in it (nested dicts and lists) replaced by its result."""
    if isinstance(value, Future):
        return value.result()
    if isinstance(value, dict):
        return {k: resolve(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v) for v in value]
    return value


class NpyWriter:
    """A 1-D ``.npy`` file written in appended pieces; ``close`` fills in its length and hashes it (with a hasher:
    a work file needs no hash)."""

    def __init__(self, root: Path, rel: str, dtype, hasher: Hasher | None):
        self.root, self.path, self.dtype, self.hasher = root, root / rel, np.dtype(dtype), hasher
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.length = 0
        self._fh = open(self.path, "wb")
        self._out = DropBehind(self._fh)
        self._out.write(npy.write_header(self.dtype, npy.WIDEST))
        fault_point("write.array")

    def append(self, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self._out.write(values)
        self.length += values.size

    def close(self) -> Future | None:
        """The manifest entry (a Future: the file is hashed by the hasher's threads)."""
        header = npy.write_header(self.dtype, self.length)
        if len(header) != len(npy.write_header(self.dtype, npy.WIDEST)):
            raise AssertionError(f"{self.path}: the .npy header changed length")  # numpy pads headers to 64 bytes
        self._fh.seek(0)
        self._fh.write(header)
        self._out.finish()
        self._fh.close()
        return None if self.hasher is None else self.hasher.entry(self.root, self.path)


class ParquetWriter:
    """A Parquet table of (src, dst, value) rows appended in pieces, in row groups of ``ROW_GROUP`` rows."""

    def __init__(self, root: Path, rel: str, value_name: str, value_type: pa.DataType, hasher: Hasher):
        self.root, self.path, self.hasher = root, root / rel, hasher
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.schema = pa.schema([("src", pa.int32()), ("dst", pa.int32()), (value_name, value_type)])
        # opened by its bytes: pyarrow encodes a str path as UTF-8, which a folder's name need not be
        self._sink = pa.OSFile(os.fsencode(self.path), "wb")
        self._writer = pq.ParquetWriter(self._sink, self.schema, compression="zstd")
        self._pending: list[tuple[np.ndarray, ...]] = []
        self._rows = 0

    def append(self, src: np.ndarray, dst: np.ndarray, values: np.ndarray) -> None:
        self._pending.append((src, dst, values))
        self._rows += src.size
        if self._rows >= ROW_GROUP:
            self._write(final=False)

    def _write(self, final: bool) -> None:
        cols = [np.concatenate([p[i] for p in self._pending]) if self._pending else np.zeros(0) for i in range(3)]
        whole = cols[0].size if final else cols[0].size // ROW_GROUP * ROW_GROUP
        if whole:
            table = pa.Table.from_arrays([pa.array(c[:whole], type=f.type) for c, f in zip(cols, self.schema)],
                                         schema=self.schema)
            self._writer.write_table(table, row_group_size=ROW_GROUP)
        self._pending = [tuple(c[whole:] for c in cols)] if whole < cols[0].size else []
        self._rows = cols[0].size - whole

    def close(self) -> Future:
        self._write(final=True)
        self._writer.close()
        self._sink.close()
        return self.hasher.entry(self.root, self.path)


class ShardWriter:
    """Rows of an N×N CSR operator appended in order, split into shards of at most ``shard_nnz`` non-zeros at row
    boundaries (a row longer than that is a shard of its own); each shard's indptr starts at 0."""

    def __init__(self, root: Path, name: str, n: int, dtype, shard_nnz: int, hasher: Hasher):
        self.root, self.name, self.n, self.dtype, self.shard_nnz, self.hasher = root, name, n, dtype, shard_nnz, hasher
        # shards never exceed max(shard_nnz, N) entries: int32 indices unless shard_nnz itself is that large
        self.index = np.int32 if shard_nnz < 2**31 else np.int64
        self.shards: list[dict] = []
        self.row = 0
        self.nnz = 0
        self._open: dict | None = None

    def _start(self) -> None:
        folder = f"{self.name}/shard-{len(self.shards):05d}"
        self._open = {"start": self.row, "nnz": 0,
                      "files": {part: NpyWriter(self.root, f"{folder}/{part}.npy", dt, self.hasher)
                                for part, dt in (("indptr", self.index), ("indices", self.index),
                                                 ("data", self.dtype))}}
        self._open["files"]["indptr"].append(np.zeros(1, dtype=self.index))

    def _finish(self) -> None:
        o = self._open
        self.shards.append({"rows": [o["start"], self.row], "nnz": o["nnz"],
                            "files": {part: w.close() for part, w in o["files"].items()}})
        self._open = None

    def add_rows(self, lengths: np.ndarray, indices: np.ndarray, data: np.ndarray) -> None:
        """Append rows ``self.row …`` with ``lengths[i]`` entries each (their column indices and values in order)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(lengths)
        r = 0
        while r < lengths.size:
            if self._open is None:
                self._start()
            o = self._open
            base = ends[r - 1] if r else 0
            # the rows from r that still fit this shard (at least one row when the shard is empty)
            fit = int(np.searchsorted(ends, base + self.shard_nnz - o["nnz"], side="right"))
            if fit <= r:
                if o["nnz"] > 0:
                    self._finish()
                    continue
                fit = r + 1
            a, b = int(base), int(ends[fit - 1])
            o["files"]["indptr"].append(o["nnz"] + (ends[r:fit] - base))
            o["files"]["indices"].append(indices[a:b])
            o["files"]["data"].append(data[a:b])
            o["nnz"] += b - a
            self.nnz += b - a
            self.row += fit - r
            r = fit
            if o["nnz"] >= self.shard_nnz:
                self._finish()

    def close(self) -> list[dict]:
        if self.row != self.n:
            raise AssertionError(f"{self.name}: wrote {self.row} rows of {self.n}")
        if self._open is not None:
            self._finish()
        return self.shards


@numba.njit(nogil=True, cache=True)
def _column_sums(cols, counts, predecessors, column_counts):
    for i in range(cols.size):
        predecessors[cols[i]] += 1
        column_counts[cols[i]] += counts[i]


class BigramWriter:
    """The bigram counts streamed in ascending ranges of whole rows → ``counts.parquet``, the count matrix A,
    ``stats/`` and Ã = D⁻¹A (``order1``, with its edge list), written as they come."""

    def __init__(self, root: Path, vocab_size: int, eps: float, shard_nnz: int, hasher: Hasher):
        n = self.n = vocab_size
        self.root, self.eps, self.hasher = root, eps, hasher
        self.parquet = ParquetWriter(root, "counts.parquet", "count", pa.int64(), hasher)
        self.counts = ShardWriter(root, "counts", n, np.int64, shard_nnz, hasher)
        self.base = ShardWriter(root, "order1", n, np.float32, shard_nnz, hasher)
        self.edges = ParquetWriter(root, "order1/edges.parquet", "weight", pa.float32(), hasher)
        self.stats = {name: np.zeros(n, dtype=np.int64) for name in ("row_counts", "successors", "predecessors",
                                                                     "column_counts")}
        self.distinct = 0
        self.total = 0

    def add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Sorted unique keys s·N + d (int64) of rows ``self.counts.row`` … and their counts; whole rows only."""
        if not keys.size:
            return
        n = self.n
        src = (keys // n).astype(np.int32)
        dst = (keys % n).astype(np.int32)
        first, last = self.counts.row, int(src[-1]) + 1
        if src[0] < first:
            raise AssertionError(f"bigram ranges out of order: row {src[0]} after row {first}")
        lengths = np.bincount(src - first, minlength=last - first).astype(np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        self.parquet.append(src, dst, counts)
        self.counts.add_rows(lengths, dst, counts)
        cum = np.concatenate(([0], np.cumsum(counts)))
        ends = np.concatenate(([0], np.cumsum(lengths)))
        row_sums = cum[ends[1:]] - cum[ends[:-1]]
        self.stats["row_counts"][first:last] = row_sums
        self.stats["successors"][first:last] = lengths
        _column_sums(dst, counts, self.stats["predecessors"], self.stats["column_counts"])
        # Ã = D⁻¹A, D_ii = Σ_j A_ij + ε, as gm_graphs.powers.normalize computes it (float64, then float32)
        degree = row_sums.astype(np.float64)
        with np.errstate(divide="ignore"):
            inv = np.where(degree > 0, 1.0 / (degree + self.eps), 0.0)
        weights = (counts * np.repeat(inv, lengths)).astype(np.float32)
        self.base.add_rows(lengths, dst, weights)
        self.edges.append(src, dst, weights)
        self.distinct += keys.size
        self.total += int(counts.sum())

    def close(self) -> dict:
        """Pad the rows no bigram starts from; the manifest entries of the counts, stats and Ã (with Futures)."""
        for w in (self.counts, self.base):
            if w.row < self.n:
                w.add_rows(np.zeros(self.n - w.row, dtype=np.int64), np.zeros(0, np.int32), np.zeros(0, w.dtype))
        stats = {}
        for name, a in self.stats.items():
            w = NpyWriter(self.root, f"stats/{name}.npy", np.int64, self.hasher)
            w.append(a)
            stats[name] = w.close()
        counts = {"parquet": self.parquet.close(), "shards": self.counts.close()}
        base_shards = self.base.close()
        base = {"shards": base_shards, "nnz": self.base.nnz, "edges": self.edges.close(), "pruned": False,
                "prune_rule": None}
        return {"counts": counts, "stats": stats, "order1": base}


def write_operator(root: Path, name: str, n: int, blocks: Iterable[tuple], shard_nnz: int, hasher: Hasher,
                   prune_rule: dict, exact: bool) -> dict:
    """A materialised operator from its row blocks ``(row_start, csr_block, mass kept)``, in order."""
    shards = ShardWriter(root, name, n, np.float32, shard_nnz, hasher)
    edges = ParquetWriter(root, f"{name}/edges.parquet", "weight", pa.float32(), hasher)
    kept = np.empty(n, dtype=np.float32)
    for r0, block, frac in blocks:
        lengths = np.diff(block.indptr).astype(np.int64)
        shards.add_rows(lengths, block.indices, block.data)
        edges.append(np.repeat(np.arange(r0, r0 + block.shape[0], dtype=np.int32), lengths),
                     block.indices.astype(np.int32), block.data.astype(np.float32))
        kept[r0:r0 + block.shape[0]] = frac
    mass = NpyWriter(root, f"{name}/row_mass.npy", np.float32, hasher)
    mass.append(kept)
    return {"shards": shards.close(), "nnz": shards.nnz, "edges": edges.close(), "row_mass": mass.close(),
            "pruned": bool((kept < 1.0 - 1e-6).any()) if not exact else False, "prune_rule": prune_rule,
            "row_mass_kept": {"min": float(kept.min()), "mean": float(kept.mean()),
                              "p10": float(np.quantile(kept, 0.1))}}


def _split_checked(order: int, n: int, keys: np.ndarray, counts: np.ndarray, after: int, buffers):
    """A range's sorted keys split (``ngram_trie.split_keys``) into its contexts, where each starts and the next
    tokens, in ``buffers`` (at least as long as the keys), and what :func:`ngram_range_problem` finds wrong with them
    (contexts above ``after``), or None: the checks the writer's ranges get while in memory, so that a build trusts
    its tables without reading them back (GraphFiles.trust_written)."""
    contexts, indptr, nxt = buffers
    m = split_keys(np.ascontiguousarray(keys, dtype=np.int64), np.int64(n), contexts, indptr, nxt)
    contexts, indptr, nxt = contexts[:m], indptr[:m], nxt[:keys.size]
    return contexts, indptr, nxt, ngram_range_problem(order, contexts, nxt, counts, n, after)


class NgramWriter:
    """The n-gram tables of one folder streamed in: a level of the trie per length d (``<folder>/<d>/*.npy``,
    ``gm_graphs.count.ngram_trie``), order after order (ascending, consecutive), each order from ascending ranges of
    whole contexts."""

    def __init__(self, root: Path, folder: str, vocab_size: int, hasher: Hasher | None):
        self.root, self.folder, self.n, self.hasher = root, folder, vocab_size, hasher
        self.levels: dict[str, dict] = {}
        self.orders: dict[str, dict] = {}
        self._below: list[Level] = []  # the levels written so far, memory-mapped

    def _stream(self, depth: int, counted: bool) -> tuple[LevelStream, dict[str, NpyWriter]]:
        dtypes = part_dtypes(self.n, counted)
        files = {part: NpyWriter(self.root, f"{self.folder}/{depth}/{part}.npy", dt, self.hasher)
                 for part, dt in dtypes.items()}
        return LevelStream(depth, self.n, counted, lambda part, values: files[part].append(values)), files

    def write_order(self, order: int, total: int, ranges: Iterable) -> None:
        """Write the order-``order`` table of ``total`` n-grams from its ranges (``(keys, counts)`` or
        :class:`LaidOutRange`, whose ``read_back`` is set)."""
        first = not self._below
        if not first and order != self._below[-1].depth + 1:
            raise AssertionError(f"the {order}-gram table does not follow the {self._below[-1].depth}-gram table")
        depths = range(2, order + 1) if first else (order,)
        made = {d: self._stream(d, counted=d == order) for d in depths}
        streams = {d: m[0] for d, m in made.items()}
        encoder = (LowestOrder(order, self.n, streams) if first
                   else HigherOrder(order, self.n, streams[order], self._below))
        table = OrderRanges(order, self.n, total, encoder.add)
        for r in ranges:
            if isinstance(r, LaidOutRange):
                r.read_back = table.add_written(r)
            else:
                table.add(*r)
        encoder.finish()
        for d, (stream, files) in made.items():
            self.levels[str(d)] = {"parents": stream.parents, "nodes": stream.nodes,
                                   "files": {part: w.close() for part, w in files.items()}}
            self._below.append(Level(d, stream.parents, {part: np.load(w.path, mmap_mode="r")
                                                         for part, w in files.items()}))
        self.orders[str(order)] = {"contexts": table.contexts, "entries": table.entries}

    def close(self) -> dict:
        """The manifest entry of the tables: their ``levels`` (with Futures) and ``orders``."""
        self._below = []
        return {"levels": self.levels, "orders": self.orders}


class OrderRanges:
    """One order's ranges, checked (contexts ascending across ranges, no more n-grams than ``total``) and split into
    (contexts, entries per context, next tokens, counts) for the trie's encoder."""

    def __init__(self, order: int, vocab_size: int, total: int, add):
        self.order, self.n, self.total, self._add = order, vocab_size, total, add
        self.counted = 0
        self.entries = 0
        self.contexts = 0
        self._last = -1  # the last context written
        self._buffers = self._allocate(0)  # reused per range

    @staticmethod
    def _allocate(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.empty(size, np.int64), np.empty(size, np.int64), np.empty(size, np.int32)

    def add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        if not keys.size:
            return
        if self._buffers[0].size < keys.size:
            self._buffers = self._allocate(keys.size)
        contexts, indptr, nxt, problem = _split_checked(self.order, self.n, keys, counts, self._last,
                                                        self._buffers)
        self._admit(problem, int(counts.sum()), "")
        self._put(contexts, np.diff(np.append(indptr, keys.size)), nxt, counts)

    def _put(self, contexts, lengths, nxt, counts) -> None:
        self._add(contexts, lengths, nxt, counts)
        self._last = int(contexts[-1])
        self.entries += nxt.size
        self.contexts += contexts.size

    def _admit(self, problem: str | None, count_sum: int, where: str) -> None:
        """Count a range's n-grams in, or raise for its ``problem`` or for more n-grams than ``total``."""
        self.counted += count_sum
        if not problem and self.counted > self.total:
            problem = f"more n-grams than the {self.total:,} counted"
        if problem:
            raise AssertionError(f"the {self.order}-gram table being written{where}: {problem}")

    def add_written(self, laid: LaidOutRange) -> int:
        """A range a worker laid out (:func:`write_range`), after checking what it reports against the ranges before
        it; the bytes of its files this process read."""
        m = laid.meta
        if not m["entries"]:
            return 0
        problem = None
        if m["order"] != self.order:
            problem = f"a range of the {m['order']}-gram table came in its place"
        elif m["first"] <= self._last:
            problem = "its first context is not above the last context of the range before it"
        self._admit(problem, m["sum"], f", range {m['range']}")
        sizes = {part: m["contexts"] if part in ("contexts", "indptr") else m["entries"] for part in RANGE_PARTS}
        arrays = {}
        for part, size in sizes.items():
            path, dtype = laid.path(part), np.dtype(m["dtypes"][part])
            found = path.stat().st_size
            if found != size * dtype.itemsize:
                raise AssertionError(f"{path} has {found:,} bytes, its writer reported {size:,} values of {dtype}")
            arrays[part] = np.fromfile(path, dtype=dtype)
        lengths = np.diff(np.append(arrays["indptr"].astype(np.int64), m["entries"]))
        self._put(arrays["contexts"], lengths, arrays["next"], arrays["counts"].astype(np.int64))
        return sum(a.nbytes for a in arrays.values())


@dataclass
class LaidOutRange:
    """One n-gram range as :func:`write_range` left it: its files in ``folder`` and what the worker reported."""

    folder: Path
    meta: dict
    read_back: int = 0  # set by the table's writer: the bytes of the range's files it read

    def path(self, part: str) -> Path:
        return self.folder / str(self.meta["order"]) / f"{self.meta['range']}.{part}"


def write_range(folder: Path, order: int, rng: int, vocab_size: int, keys: np.ndarray, counts: np.ndarray) -> dict:
    """Lay out one merged range of an order's n-gram table split as :class:`OrderRanges` splits it (contexts, indptr
    from 0, next tokens, counts), checked as it checks a range, in raw files ``folder/<order>/<rng>.<part>``, each
    written under another name and renamed (a task run twice leaves one whole file). Returns what the table's
    writer needs to check and read them (:class:`LaidOutRange`'s ``meta``)."""
    counts = np.ascontiguousarray(counts)
    index = np.int32 if keys.size < 2**31 else np.int64  # indptr from 0: the range's own entries
    buffers = np.empty(keys.size, np.int64), np.empty(keys.size, index), np.empty(keys.size, np.int32)
    contexts, indptr, nxt, problem = _split_checked(order, vocab_size, keys, counts, -1, buffers)
    if problem:
        raise AssertionError(f"range {rng} of the {order}-gram table: {problem}")
    small = not counts.size or counts.max() < 2**31
    arrays = {"contexts": contexts, "indptr": indptr, "next": nxt,
              "counts": counts.astype(np.int32) if small else counts}
    # little-endian, as the files and the dtypes reported (which the table's writer reads them as) both say
    arrays = {part: a.astype(a.dtype.newbyteorder("<"), copy=False) for part, a in arrays.items()}
    out = folder / str(order)
    out.mkdir(parents=True, exist_ok=True)
    for part, values in arrays.items():
        partial = out / f".{rng}.{part}.{uuid.uuid4().hex[:8]}"
        values.tofile(partial)
        os.replace(partial, out / f"{rng}.{part}")
    return {"order": order, "range": rng, "entries": int(keys.size), "contexts": int(contexts.size),
            "first": int(contexts[0]) if contexts.size else -1, "last": int(contexts[-1]) if contexts.size else -1,
            "sum": int(counts.sum()), "dtypes": {part: values.dtype.str for part, values in arrays.items()}}


def write_ngrams(root: Path, folder: str, vocab_size: int, tables: Iterable[tuple[int, int, Iterable]],
                 hasher: Hasher | None) -> dict:
    """Write the n-gram tables ``(order, total n-grams, ranges)`` (orders ascending and consecutive; ranges of
    ``(keys, counts)`` or :class:`LaidOutRange`) into ``root/folder``; their manifest entry (with Futures when
    hashed)."""
    w = NgramWriter(root, folder, vocab_size, hasher)
    for order, total, ranges in tables:
        w.write_order(order, total, ranges)
    return w.close()
