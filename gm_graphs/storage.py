"""The on-disk format of a graph folder, owned here.

::

    <graph>/manifest.json                 format version, tokenizer, corpus, operators, checksums
    <graph>/counts.parquet                raw bigram counts: src, dst, count (int32, int32, int64)
    <graph>/counts/shard-00000/{indptr,indices,data}.npy     counts as CSR (int64 data)
    <graph>/<operator>/shard-NNNNN/{indptr,indices,data}.npy operator as CSR (float32 data)
    <graph>/<operator>/edges.parquet      src, dst, weight, for other tools
    <graph>/<operator>/row_mass.npy       fraction of each exact row's mass kept by pruning

Shards split the rows into blocks of at most ``shard_nnz`` non-zeros; each
shard's ``indptr`` starts at 0. Every array is a raw ``.npy`` that loads with
``np.load(mmap_mode="r")``; a single-shard operator becomes a zero-copy
memory-mapped ``scipy.sparse.csr_matrix``. Every file's size and SHA-256 is in
the manifest and checked at load time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import scipy.sparse as sp

from .errors import GraphExistsError, GraphFormatError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_NNZ = 1 << 26  # 64M non-zeros: 768 MB of float32 data + int64 indices at most


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_entry(root: Path, path: Path) -> dict:
    return {"file": path.relative_to(root).as_posix(), "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def check_file(root: Path, entry: dict, verify: bool) -> Path:
    path = root / entry["file"]
    if not path.is_file():
        raise GraphFormatError(f"graph {root}: {entry['file']} is missing; rebuild the graph "
                               f"(graphmax build … --overwrite)")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise GraphFormatError(f"graph {root}: {entry['file']} has {size} bytes, the manifest says {entry['bytes']} "
                               f"(truncated or replaced); rebuild the graph (graphmax build … --overwrite)")
    if verify and sha256_file(path) != entry["sha256"]:
        raise GraphFormatError(f"graph {root}: {entry['file']} fails its SHA-256 checksum (corrupted); "
                               f"rebuild the graph (graphmax build … --overwrite)")
    return path


class CSRWriter:
    """Appends row blocks of one N×N operator and splits them into shards of at most ``shard_nnz``."""

    def __init__(self, root: Path, name: str, n: int, dtype, shard_nnz: int = DEFAULT_SHARD_NNZ):
        self.root, self.name, self.n, self.dtype, self.shard_nnz = root, name, n, np.dtype(dtype), shard_nnz
        (root / name).mkdir(parents=True, exist_ok=True)
        self.shards: list[dict] = []
        self._pending: list[sp.csr_matrix] = []
        self._pending_nnz = 0
        self._row = 0
        self._start = 0
        self.nnz = 0

    def add(self, block: sp.csr_matrix) -> None:
        if self._pending and self._pending_nnz + block.nnz > self.shard_nnz:
            self._flush()
        self._pending.append(block)
        self._pending_nnz += block.nnz
        self._row += block.shape[0]

    def _flush(self) -> None:
        if not self._pending and self.shards:
            return
        rows = sp.vstack(self._pending, format="csr") if self._pending else sp.csr_matrix((0, self.n))
        folder = self.root / self.name / f"shard-{len(self.shards):05d}"
        folder.mkdir()
        files = {}
        # scipy's kernels want indptr and indices of one dtype: int32 unless a shard needs more.
        index = np.int32 if rows.nnz < 2**31 and self.n < 2**31 else np.int64
        for part, arr in (("indptr", rows.indptr.astype(index)),
                          ("indices", rows.indices.astype(index)),
                          ("data", rows.data.astype(self.dtype))):
            path = folder / f"{part}.npy"
            np.save(path, np.ascontiguousarray(arr))
            files[part] = file_entry(self.root, path)
        self.shards.append({"rows": [self._start, self._start + rows.shape[0]], "nnz": int(rows.nnz), "files": files})
        self.nnz += int(rows.nnz)
        self._start += rows.shape[0]
        self._pending, self._pending_nnz = [], 0

    def close(self) -> list[dict]:
        self._flush()
        if self._row != self.n:
            raise AssertionError(f"{self.name}: wrote {self._row} rows of {self.n}")
        return self.shards


def write_csr(root: Path, name: str, matrix: sp.csr_matrix, dtype, shard_nnz: int = DEFAULT_SHARD_NNZ) -> list[dict]:
    w = CSRWriter(root, name, matrix.shape[0], dtype, shard_nnz)
    step = max(1, matrix.shape[0] // max(1, -(-matrix.nnz // shard_nnz)))
    for r0 in range(0, matrix.shape[0], step):
        w.add(matrix[r0:r0 + step])
    return w.close()


def read_csr(root: Path, shards: list[dict], n: int, verify: bool = True) -> sp.csr_matrix:
    """The operator as one CSR matrix: memory-mapped, zero-copy when it has a single shard."""
    blocks = []
    for shard in shards:
        arrays = {part: np.load(check_file(root, entry, verify), mmap_mode="r")
                  for part, entry in shard["files"].items()}
        r0, r1 = shard["rows"]
        if arrays["indptr"].shape != (r1 - r0 + 1,) or arrays["indices"].shape != arrays["data"].shape \
                or int(arrays["indptr"][-1]) != arrays["data"].shape[0]:
            raise GraphFormatError(f"graph {root}: shard {shard['files']['indptr']['file']} has inconsistent "
                                   f"array shapes; rebuild the graph (graphmax build … --overwrite)")
        # Built via the attributes so that scipy keeps the memory maps instead of copying them.
        m = sp.csr_matrix((r1 - r0, n), dtype=arrays["data"].dtype)
        m.indptr, m.indices, m.data = arrays["indptr"], arrays["indices"], arrays["data"]
        blocks.append(m)
    return blocks[0] if len(blocks) == 1 else sp.vstack(blocks, format="csr")


def write_edges(root: Path, path: Path, shards: list[dict], n: int, value_name: str) -> None:
    """An edge list (src, dst, value) in Parquet, written shard by shard to bound memory."""
    writer = None
    try:
        for shard in shards:
            block = read_csr(root, [shard], n, verify=False).tocoo()
            table = pa.table({"src": pa.array((block.row + shard["rows"][0]).astype(np.int32)),
                              "dst": pa.array(block.col.astype(np.int32)), value_name: pa.array(block.data)})
            writer = writer or pq.ParquetWriter(path, table.schema, compression="zstd")
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()


def write_manifest(root: Path, manifest: dict) -> None:
    """Write the manifest atomically (a temp file, then rename), so readers never see half of one."""
    tmp = root / f".{MANIFEST}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, root / MANIFEST)
    finally:
        tmp.unlink(missing_ok=True)


def update_manifest(root: Path, key: str, value: Any) -> dict:
    """Set one top-level entry of a built graph's manifest."""
    manifest = read_manifest(root)
    manifest[key] = value
    write_manifest(root, manifest)
    return manifest


def read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file():
        raise GraphFormatError(f"{root} is not a graph folder (no {MANIFEST}); build one with `graphmax build`")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GraphFormatError(f"{path} is not valid JSON ({e}); rebuild the graph") from e
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise GraphFormatError(f"{root} has format version {version}; this graphmax reads version "
                               f"{FORMAT_VERSION}; rebuild the graph with this version")
    return manifest


@contextmanager
def atomic_folder(final: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling folder that replaces ``final`` only if the block succeeds.

    A failed or interrupted build leaves the previous graph of that name intact.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise GraphExistsError(f"a graph already exists at {final}; choose another name or pass --overwrite")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
