"""The graph folder (its layout: docs/format.md): writing its manifest, and opening its files with every one checked.

Opening a file (:class:`GraphFiles`) walks its path component by component from the folder without following
symlinks, accepts only regular files of the recorded size, reads the ``.npy`` header itself (dtype, 1-D shape,
size) and memory-maps the descriptor it checked, under a read lease (``gm_graphs.store.leases``): another program
that rewrites a mapped file in place cannot crash the process, and :meth:`GraphFiles.check_unchanged` then raises
``GraphBusyError``. Arrays are handed out only after ``gm_graphs.format.validate``'s checks, once per file identity
(``gm_graphs.store.verified``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from gm_graphs.count.ngram_trie import Level, part_dtypes
from gm_graphs.errors import GraphBusyError, GraphFormatError
from gm_graphs.format import validate
from gm_graphs.format.validate import FORMAT_VERSION, STATS, V1_NGRAM_PARTS
from gm_graphs.store import leases, pagecache, verified
from gm_graphs.store.faults import fault_point
from gm_graphs.store.folders import GRAPH_FORMAT, MANIFEST, MAX_MANIFEST_BYTES, Artefact, fsync_dir, is_graph_folder
from gm_graphs.store.reader import RecordedFile

DEFAULT_SHARD_NNZ = 1 << 26  # 64M non-zeros: 768 MB of float32 data + int64 indices at most
NGRAMS = "ngrams"
_INDEX = (np.dtype("<i4"), np.dtype("<i8"))
_INT64 = (np.dtype("<i8"),)
_DTYPES = {  # the dtypes each kind of array may have on disk
    "indptr": _INDEX, "indices": _INDEX, "weights": (np.dtype("<f4"),), "counts": _INT64, "stats": _INT64,
    "row_mass": (np.dtype("<f4"),),
}
_V1_NGRAM_DTYPES = {"contexts": _INT64, "indptr": _INDEX, "next": (np.dtype("<i4"),), "counts": _INDEX}


# ---- writing ------------------------------------------------------------------------------------------------------

def sha256_file(path: Path, drop: bool = False) -> str:
    """SHA-256 of a file; ``drop``: leave none of it in the page cache (a file just written, read back once)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        at = 0
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
            if drop:
                pagecache.drop(fh.fileno(), at, len(block))
            at += len(block)
    return h.hexdigest()


def _graph_written(path: Path) -> tuple[set[str], re.Pattern]:
    """The files a graph folder's manifest names, and the debris graphmax's own writers leave in one: n-gram tables
    a replaced or dead ``add_ngrams`` left, and its manifest's temporary files (``remove_unreferenced``)."""
    try:
        files = {e["file"] for e in file_entries(json.loads((path / MANIFEST).read_bytes().decode("utf-8")))}
    except (OSError, ValueError, RecursionError):
        files = set()  # a manifest that changed since it was found graphmax's: it names nothing else as graphmax's
    debris = re.compile(rf"({re.escape(NGRAMS)}(-[0-9a-f]{{12}})?|\.{re.escape(MANIFEST)}\.tmp-[0-9a-f]{{12}})(/.*)?")
    return {MANIFEST, *files}, debris


GRAPH = Artefact("graph", is_graph_folder, _graph_written)


def new_ngram_folder() -> str:
    return f"{NGRAMS}-{uuid.uuid4().hex[:12]}"


def write_manifest(root: Path, manifest: dict) -> None:
    """Write the manifest atomically (a synced temp file, then rename): it is the commit point of every change."""
    manifest = {**manifest, "format": GRAPH_FORMAT, "format_version": FORMAT_VERSION}
    tmp = root / f".{MANIFEST}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "w") as fh:
            fh.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        fault_point("manifest.written")
        os.replace(tmp, root / MANIFEST)
        fsync_dir(root)
    finally:
        tmp.unlink(missing_ok=True)
    fault_point("manifest.replaced")


def file_entries(manifest: Any) -> Iterator[dict]:
    """Every file entry of a manifest (a dict with a ``file`` path and its ``sha256``), depth first."""
    if isinstance(manifest, dict):
        if isinstance(manifest.get("file"), str) and "sha256" in manifest:
            yield manifest
        for v in manifest.values():
            yield from file_entries(v)
    elif isinstance(manifest, list):
        for v in manifest:
            yield from file_entries(v)


def referenced_folders(manifest: dict) -> set[str]:
    """The top-level folders the manifest's file entries live in."""
    return {entry["file"].split("/", 1)[0] for entry in file_entries(manifest)}


def remove_unreferenced(root: Path, manifest: dict) -> None:
    """Remove n-gram folders and manifest temp files no manifest refers to (left by a replaced or dead write).

    Call with the graph's lock held. Nothing else in the folder is touched.
    """
    from gm_graphs.store.folders import remove_tree

    keep = referenced_folders(manifest)
    for entry in os.scandir(root):
        name = entry.name
        if name.startswith(f".{MANIFEST}.tmp-") and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
        elif (name == NGRAMS or (name.startswith(f"{NGRAMS}-") and len(name) == len(NGRAMS) + 13)) \
                and name not in keep and entry.is_dir(follow_symlinks=False):
            remove_tree(Path(entry.path))


# ---- reading ------------------------------------------------------------------------------------------------------

def _fail(root: Path, what: str) -> GraphFormatError:
    return validate.fail(root, what)


def read_manifest(root: Path, v1_ngrams: bool = False) -> dict:
    """The manifest of the graph folder ``root``, schema-checked (types, ranges, file paths inside the folder);
    ``v1_ngrams``: a format-1 graph's n-gram tables are accepted (for ``gm_graphs.upgrade_graph``)."""
    return read_manifest_and_key(root, v1_ngrams)[0]


def manifest_key(st: os.stat_result) -> tuple:
    """What tells one manifest file from another: every writer replaces the manifest by a rename (a new inode), so
    a Graph can tell whether the folder still holds the manifest it read."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_manifest_and_key(root: Path, v1_ngrams: bool = False) -> tuple[dict, tuple]:
    """:func:`read_manifest`, and the :func:`manifest_key` of the very file it read."""
    path = root / MANIFEST
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise GraphFormatError(f"{root} is not a graph folder (no {MANIFEST}); build one with `graphmax build`") \
            from None
    except OSError as e:
        raise GraphFormatError(f"cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _fail(root, f"{MANIFEST} is not a regular file (a symlink or something else)")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise _fail(root, f"{MANIFEST} has {st.st_size:,} bytes, more than a manifest can")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            key = manifest_key(os.fstat(fh.fileno()))
            manifest = json.loads(fh.read(MAX_MANIFEST_BYTES + 1).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _fail(root, f"{MANIFEST} is not UTF-8 text (byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise _fail(root, f"{MANIFEST} is not valid JSON ({str(e).splitlines()[0][:80]})") from None
    except OSError as e:
        raise GraphFormatError(f"cannot read {path}: {e.strerror}") from None
    validate.check_manifest(root, manifest, v1_ngrams)
    return manifest, key


def _record(entry: dict) -> tuple:
    return entry["file"], entry["bytes"], entry["sha256"]


class _Opened(RecordedFile):
    """One file of a graph folder opened safely (``gm_graphs.store.reader``), with its identity for the
    verification cache."""

    def __init__(self, root: Path, real_root: str, entry: dict, dtypes: tuple | None):
        rel = entry["file"]
        validate.check_relative(root, rel, "file")
        super().__init__(root, rel, entry["bytes"], lambda what: validate.fail(root, what), "the manifest")
        self.entry = entry
        if dtypes is not None:  # else a file that is not an array (Parquet): checked by size and SHA-256 only
            self.read_header(dtypes)
        self.identity = verified.FileIdentity.of(os.path.join(real_root, *rel.split("/")), self.stat, entry["sha256"])


class GraphFiles:
    """Opens a graph folder's arrays, each unit checked (structure; SHA-256 when ``verify``) before it is returned.

    A file is hashed once per identity, and a unit's structure checked once per identity of its files
    (``gm_graphs.store.verified``); :meth:`trust_written` records what a build wrote.

    Files are opened by path when first used, so another process may have replaced the folder (a build
    ``--overwrite``, a merge) or its tables (``add_ngrams``) since ``manifest`` was read, and the files there are then
    the new graph's, healthy but not those ``manifest`` records. Given ``key`` (the :func:`manifest_key` of the
    manifest read), each unit's files, once open, count as this manifest's only while the folder's manifest is still
    that one, or records the same files; else :class:`GraphBusyError` says the graph was replaced, not corrupted.

    The arrays are mapped under read leases (``gm_graphs.store.leases``): another program that opens one of their
    files for writing is held until the mapping holds a copy of its bytes, and :meth:`check_unchanged` then raises.
    """

    def __init__(self, root: Path, manifest: dict, verify: bool = True, key: tuple | None = None):
        self.root, self.manifest, self.verify, self.key = Path(root), manifest, verify, key
        self.n = int(manifest["tokenizer"]["vocab_size"])
        self._real_root = os.path.realpath(self.root)
        self._trusted = False
        self._now: tuple[tuple, set | None] | None = None  # the manifest on disk last seen, and its file records
        self._leases: list[leases.Lease] = []  # of the arrays handed out
        self._revocations = leases.revocations()  # the process' count when the leases were last looked at
        self._rewritten: str | None = None  # the file of a revoked lease

    def check_unchanged(self) -> None:
        """Raise :class:`GraphBusyError` if another program opened a file of an array handed out for writing (``cp``
        or ``rsync --inplace`` over it) since; the arrays themselves stay readable (the lease's copy). Costs a
        comparison of two integers while no lease of the process was revoked."""
        if leases.revocations() != self._revocations:
            self._revocations = leases.revocations()
            if self._rewritten is None:
                self._rewritten = next((lease.name for lease in self._leases if lease.revoked), None)
            self._leases = [lease for lease in self._leases if lease.held]
        if self._rewritten is not None:
            raise GraphBusyError(f"graph {self.root} was rewritten in place while this process had it loaded: another "
                                 f"program opened {self._rewritten} for writing (cp or rsync --inplace over it?); "
                                 f"load it again once it is whole (load_graph) and make the decoder anew from it; "
                                 f"replace a graph's files only by renaming")

    def _check_not_replaced(self, entries: list[dict]) -> None:
        """Raise GraphBusyError if the folder's manifest is no longer the one read and records other files than
        ``entries``; a manifest that cannot be read now proves nothing, and the files' own checks decide."""
        if self.key is None:
            return
        try:
            now = manifest_key(os.stat(self.root / MANIFEST, follow_symlinks=False))
        except OSError:
            now = None
        if now == self.key:
            return
        if now is None or self._now is None or self._now[0] != now:
            try:
                manifest, now = read_manifest_and_key(self.root)
                records = {_record(e) for e in file_entries(manifest)}
            except GraphFormatError:
                records = None
            self._now = (now, records)
        records = self._now[1]
        if records is None and now is not None:
            return
        if records is None or not all(_record(e) in records for e in entries):
            raise GraphBusyError(f"graph {self.root} was replaced (a build --overwrite or merge), changed "
                                 f"(add_ngrams) or removed after it was opened: its files are not those of the "
                                 f"manifest read then; load it again (load_graph, or graph.refresh())")

    def _unit(self, kind: str, context: dict, entries: dict[str, tuple[dict, tuple]],
              check: Callable[[dict[str, np.ndarray]], None]) -> dict[str, np.ndarray]:
        opened: dict[str, _Opened] = {}
        records = [entry for entry, _ in entries.values()]
        try:
            try:
                for part, (entry, dtypes) in entries.items():
                    opened[part] = _Opened(self.root, self._real_root, entry, dtypes)
            except GraphFormatError:
                self._check_not_replaced(records)  # a file missing or of another size: the new graph's, maybe
                raise
            # after opening: the descriptors hold this manifest's files whatever is written there next
            self._check_not_replaced(records)
            # mapped (under a lease) or read before the checks: the bytes checked are the bytes handed out
            arrays = {part: o.array() for part, o in opened.items() if o.dtype is not None}
            self._leases += [o.lease for o in opened.values() if o.lease is not None]
            for o in opened.values():
                if (self.verify or self._trusted) and not verified.is_verified("sha256", {}, [o.identity]):
                    if not self._trusted and o.sha256() != o.entry["sha256"]:
                        self.check_unchanged()  # rewritten while it was hashed: busy, not corrupted
                        raise GraphFormatError(f"graph {self.root}: {o.rel} fails its SHA-256 checksum "
                                               f"(corrupted); {validate.REBUILD}")
                    verified.remember("sha256", {}, [o.identity])
            ids = [o.identity for o in opened.values()]
            if arrays and not verified.is_verified(kind, context, ids):
                if not (self._trusted and kind == "ngram_level"):  # NgramWriter checked them range by range
                    check(arrays)
                verified.remember(kind, context, ids)
            self.check_unchanged()  # a file opened for writing while it was checked: what passed may be a copy
            return arrays
        finally:
            for o in opened.values():
                o.close()

    def csr(self, shards: list[dict], weights: bool) -> sp.csr_matrix:
        """The CSR matrix of an operator's (``weights``) or the counts' shards: memory-mapped, zero-copy if one."""
        blocks = []
        for shard in shards:
            r0, r1 = shard["rows"]
            files = shard["files"]
            what = files["indptr"]["file"].rsplit("/", 1)[0]
            data_dtypes = _DTYPES["weights" if weights else "counts"]
            a = self._unit("csr", {"rows": [r0, r1], "n": self.n, "nnz": shard["nnz"], "weights": weights},
                           {"indptr": (files["indptr"], _DTYPES["indptr"]),
                            "indices": (files["indices"], _DTYPES["indices"]), "data": (files["data"], data_dtypes)},
                           lambda a, what=what, rows=r1 - r0, nnz=shard["nnz"]: validate.check_csr(
                               self.root, what, a["indptr"], a["indices"], a["data"], rows, self.n, nnz,
                               counts=not weights))
            # Built via the attributes so that scipy keeps the memory maps instead of copying them.
            m = sp.csr_matrix((r1 - r0, self.n), dtype=a["data"].dtype)
            m.indptr, m.indices, m.data = a["indptr"], a["indices"], a["data"]
            blocks.append(m)
        return blocks[0] if len(blocks) == 1 else sp.vstack(blocks, format="csr")

    def row_mass(self, entry: dict) -> np.ndarray:
        arrays = self._unit("row_mass", {"n": self.n}, {"row_mass": (entry, _DTYPES["row_mass"])},
                            lambda a: validate.check_row_mass(self.root, entry["file"], a["row_mass"], self.n))
        return arrays["row_mass"]

    def ngram_levels(self) -> list[Level]:
        """The n-gram trie's levels 2 … m, checked (empty if the graph has no tables)."""
        entry = self.manifest.get(NGRAMS)
        if entry is None:
            return []
        counted = {int(o) for o in entry["orders"]}
        levels = []
        for key, e in sorted(entry["levels"].items(), key=lambda kv: int(kv[0])):
            depth = int(key)
            dtypes = part_dtypes(self.n, depth in counted)
            context = {"depth": depth, "n": self.n, "parents": e["parents"], "nodes": e["nodes"],
                       "counted": depth in counted}
            arrays = self._unit(
                "ngram_level", context, {part: (e["files"][part], (dt,)) for part, dt in dtypes.items()},
                lambda a, depth=depth, e=e: validate.check_level(self.root, depth, a, e["parents"], e["nodes"],
                                                                 self.n, depth in counted))
            levels.append(Level(depth, e["parents"], arrays))
        return levels

    def v1_ngram_tables(self) -> dict[int, dict[str, np.ndarray]]:
        """A format-1 graph's flat n-gram tables by order, checked (for ``gm_graphs.upgrade_graph``)."""
        tables = {}
        for key, e in sorted(self.manifest[NGRAMS]["orders"].items(), key=lambda kv: int(kv[0])):
            order = int(key)
            tables[order] = self._unit(
                "v1_ngrams", {"order": order, "n": self.n, "contexts": e["contexts"], "entries": e["entries"]},
                {part: (e["files"][part], _V1_NGRAM_DTYPES[part]) for part in V1_NGRAM_PARTS},
                lambda a, order=order, e=e: validate.check_v1_ngram_table(
                    self.root, order, a["contexts"], a["indptr"], a["next"], a["counts"], self.n, e["contexts"],
                    e["entries"]))
        return tables

    def stats(self) -> dict[str, np.ndarray]:
        entry = self.manifest["stats"]
        nnz = sum(sh["nnz"] for sh in self.manifest["counts"]["shards"])
        total = self.manifest["corpus"]["bigrams"]
        return self._unit("stats", {"n": self.n, "nnz": nnz, "total": total},
                          {name: (entry[name], _DTYPES["stats"]) for name in STATS},
                          lambda a: validate.check_stats(self.root, a, self.n, nnz, total))

    def plain_file(self, entry: dict) -> None:
        """A file graphmax does not read (Parquet, for other tools): its path, size and SHA-256."""
        self._unit("file", {}, {"file": (entry, None)}, lambda a: None)

    def check_all(self) -> None:
        """Check every file the manifest lists now (each unit once per identity)."""
        m = self.manifest
        self.csr(m["counts"]["shards"], weights=False)
        self.plain_file(m["counts"]["parquet"])
        for op in m["operators"].values():
            self.csr(op["shards"], weights=True)
            self.plain_file(op["edges"])
            if "row_mass" in op:
                self.row_mass(op["row_mass"])
        self.ngram_levels()
        self.stats()

    def trust_written(self, only: str | None = None) -> None:
        """Record the units this process just wrote (and hashed as it wrote them) as fully verified: all of them,
        or only the n-gram tables (``only="ngrams"``). The structure checks of the shards and stats still run: they
        catch a writer's bug. The n-gram tables, the bulk of a graph, had theirs range by range as ``NgramWriter``
        wrote them, so they are not read back.
        """
        self._trusted = True
        try:
            self.ngram_levels() if only == NGRAMS else self.check_all()
        finally:
            self._trusted = False
