"""The one reader of the files graphmax loads from folders it does not trust: a graph's arrays and a datastore's.

A file is opened inside its folder through no symlink (each path component is checked, then opened relative to the
one before), as a regular file only (a FIFO or a device node is never opened: opening one can block, or act on the
device), and its size must be the one the folder's record (manifest.json, meta.json) gives. An array's ``.npy``
header is read without numpy's parser (``gm_graphs.store.npy``) and must be 1-D, of an expected dtype, and fill the
file exactly. Only then is its data memory-mapped (under a read lease, ``gm_graphs.store.leases``) or read. Each
folder kind passes the error it raises (a one-line message naming the folder and the fix), so every check reads the
same for graphs and datastores.
"""

from __future__ import annotations

import hashlib
import os
import stat
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gm_graphs.errors import GraphmaxError
from gm_graphs.store import leases, npy
from gm_graphs.store.leases import Lease, available_memory

READ_IN_MAX = 256 << 20  # the largest file read into memory where no lease protects its mapping
Fail = Callable[[str], GraphmaxError]  # what is wrong → the error of the folder's kind, naming the folder and the fix


def open_inside(root: Path, rel: str, fail: Fail) -> int:
    """A read descriptor of ``root/rel``, following no symlink on the way and accepting only a regular file."""
    parts = rel.split("/")
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise fail(f"cannot open its folder ({e.strerror})") from None
    try:
        for i, part in enumerate(parts):
            where = "/".join(parts[:i + 1])
            try:
                st = os.stat(part, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise fail(f"{where} is missing") from None
            except OSError as e:
                raise fail(f"cannot open {where} ({e.strerror})") from None
            last = i == len(parts) - 1
            if stat.S_ISLNK(st.st_mode):
                raise fail(f"{where} is a symlink; its files must be inside the folder")
            if last and not stat.S_ISREG(st.st_mode):
                raise fail(f"{where} is not a regular file")
            if not last and not stat.S_ISDIR(st.st_mode):
                raise fail(f"{where} is not a folder")
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                fd = os.open(part, flags, dir_fd=dir_fd)
            except OSError as e:
                raise fail(f"cannot open {where} ({e.strerror})") from None
            os.close(dir_fd)
            dir_fd = fd
            if last and not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the stat and the open
                raise fail(f"{where} is not a regular file")
        return dir_fd
    except BaseException:
        os.close(dir_fd)
        raise


class RecordedFile:
    """A file of an untrusted folder, opened with :func:`open_inside` and checked against its recorded size.

    Args:
        root (``pathlib.Path``): the folder.
        rel (``str``): the file's path inside it, ``/``-separated.
        size (``int``): its size in bytes as the folder's record gives it.
        fail (``Fail``): makes the folder kind's error from what is wrong.
        record (``str``): the record's name in messages ("the manifest", "meta.json").

    Example::

        >>> import tempfile; from pathlib import Path
        >>> folder = Path(tempfile.mkdtemp()); np.save(folder / "a.npy", np.arange(3, dtype="<i4"))
        >>> with RecordedFile(folder, "a.npy", (folder / "a.npy").stat().st_size, ValueError, "the record") as f:
        ...     f.read_header((np.dtype("<i4"),), 3)
        ...     f.array().tolist()
        [0, 1, 2]
        >>> RecordedFile(folder, "a.npy", 7, ValueError, "the record")
        Traceback (most recent call last):
        ...
        ValueError: a.npy has 140 bytes, the record says 7 (truncated or replaced)
    """

    def __init__(self, root: Path, rel: str, size: int, fail: Fail, record: str):
        self.root, self.rel, self.fail = root, rel, fail
        self.lease: Lease | None = None  # what protects the array from a rewrite in place, once mapped
        self._bytes: bytearray | None = None  # the file, where it was read into memory instead
        fd = open_inside(root, rel, fail)
        try:
            self.stat = os.fstat(fd)
            if self.stat.st_size != size:
                raise fail(f"{rel} has {self.stat.st_size} bytes, {record} says {size} (truncated or replaced)")
            self.fh = os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        self.dtype: np.dtype | None = None  # until read_header: a file read as bytes only
        self.offset = self.length = 0

    def __enter__(self) -> RecordedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_header(self, dtypes: tuple[np.dtype, ...], length: int | None = None) -> None:
        """Read the ``.npy`` header: a 1-D array of one of ``dtypes`` (and ``length`` values) filling the file."""
        try:
            try:
                dtype, shape, fortran = npy.read_header(self.fh)
            except ValueError as e:
                raise self.fail(f"{self.rel} is not a .npy array ({e})") from None
            if dtype not in dtypes:
                raise self.fail(f"{self.rel} holds {dtype.str} values, expected {' or '.join(d.str for d in dtypes)}")
            if fortran or len(shape) != 1 or (length is not None and shape[0] != length):
                want = "a 1-D array" if length is None else f"shape ({length},)"
                raise self.fail(f"{self.rel} has shape {shape}, the format stores {want}")
            self.offset, self.dtype, self.length = self.fh.tell(), dtype, int(shape[0])
            if self.offset + self.length * dtype.itemsize != self.stat.st_size:
                raise self.fail(f"{self.rel}: {self.length} values of {dtype.str} do not fill its "
                                f"{self.stat.st_size} bytes")
        except BaseException:
            self.close()
            raise

    def array(self) -> np.ndarray:
        """The array, read-only, in a form that another program rewriting the file in place cannot crash (SIGBUS) or
        change: memory-mapped under a read lease (:attr:`lease`, ``gm_graphs.store.leases``) where the kernel grants
        one; else read into memory where it takes at most ``READ_IN_MAX`` and a quarter of the memory available (a
        graph on a file system without leases, e.g. NFS, would otherwise be read whole at every load); else mapped
        unprotected, with one warning that names the fix. Not on Linux (no leases), memory-mapped as such.
        """
        if self.length == 0:
            return np.zeros(0, dtype=self.dtype)
        try:
            values, self.lease = leases.map_leased(self.fh, self.rel, self.dtype, self.offset, self.length,
                                                   self._unchanged)
            return values
        except leases.Refused as refused:
            why = str(refused)
        available = available_memory()
        if available is not None and self.stat.st_size <= min(available // 4, READ_IN_MAX):
            values = self.read()
            self._unchanged()
            values.flags.writeable = False
            return values
        if available is not None:
            _warn_unprotected(self.root, self.rel, why)
        self._unchanged()
        return np.memmap(self.fh, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.length,))

    def _unchanged(self) -> None:
        """Raise the folder's error if the file was written since it was opened (its size, mtime or ctime)."""
        now = os.fstat(self.fh.fileno())
        if (now.st_size, now.st_mtime_ns, now.st_ctime_ns) != (self.stat.st_size, self.stat.st_mtime_ns,
                                                              self.stat.st_ctime_ns):
            raise self.fail(f"{self.rel} changed while it was loaded")

    def read(self, sha256: str | None = None) -> np.ndarray:
        """The array read once into memory through this descriptor (``sha256``: the bytes checked against it), so
        that a file replaced or truncated afterwards can change neither what was checked nor fault a memory map."""
        size = self.stat.st_size
        available = available_memory()
        if available is not None and size > available:
            raise self.fail(f"{self.rel} needs {size / 1e9:.2f} GB of memory to load, and {available / 1e9:.2f} GB "
                            f"is available (sizes as its record declares them); free memory or load it on a larger "
                            f"machine")
        try:
            raw = bytearray(size)
        except MemoryError:
            raise self.fail(f"{self.rel} needs {size / 1e9:.2f} GB of memory to load, more than this process can "
                            f"allocate; free memory or load it on a larger machine") from None
        self.fh.seek(0)
        if self.fh.readinto(raw) != size:
            raise self.fail(f"{self.rel} changed while it was read")
        self._bytes = raw
        if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
            raise self.fail(f"{self.rel} fails its SHA-256 checksum (corrupted)")
        return np.frombuffer(raw, dtype=self.dtype, count=self.length, offset=self.offset)

    def sha256(self) -> str:
        """The SHA-256 of the whole file: of the bytes read into memory where it was (what the array holds), else
        read through this descriptor."""
        if self._bytes is not None:
            return hashlib.sha256(self._bytes).hexdigest()
        self.fh.seek(0)
        return hashlib.file_digest(self.fh, "sha256").hexdigest()

    def close(self) -> None:
        self.fh.close()


_warned = False


def _warn_unprotected(root: Path, rel: str, why: str) -> None:
    """One warning per process: a file mapped without a lease can still crash it when rewritten in place."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"{root}/{rel} is memory-mapped without protection ({why}, and it is too large to read "
                      f"in): a program that rewrites it in place (cp or rsync --inplace over it) while this process "
                      f"reads it will crash this process (SIGBUS); own the files (chown) on a local file system, or "
                      f"replace them only by renaming", stacklevel=4)
