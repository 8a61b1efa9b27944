"""Streaming big files through the page cache without growing it.

On a VM, a page of memory left free for a few seconds can go back to the host, and touching it again costs system
CPU on the cores the tokenizer needs, for every page of the ~10 GB a 4M-document build writes. Dropping each chunk
from the cache once it is on disk lets the next chunk reuse the same warm pages (a 4M build's system CPU 40 s →
26 s: ``benchmarks/build.py``, in benchmarks/RESULTS.md). Durability is unchanged: a graph is still fsynced before
its rename; this only decides when written pages leave memory. Where ``sync_file_range`` or ``posix_fadvise`` is
missing (not Linux) files are written as before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import BinaryIO

from gm_graphs.store.faults import fault_point

CHUNK = 32 << 20  # bytes whose writeback starts at once; the chunk before is then waited for and dropped

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* of <linux/fs.h>
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP)


def _sync_file_range():
    if not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_range = _sync_file_range()


def drop(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to forget the clean cached pages of ``fd`` in ``[offset, offset + length)`` (0: to the
    end); a file that was just read and will not be read again."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass  # advice only: a file system that cannot take it keeps its pages


class DropBehind:
    """Writes a file from its current position on, and drops what it wrote from the page cache as it goes.

    Writeback of each :data:`CHUNK` starts once it is written; the chunk before it is then waited for and
    dropped, so that at most two chunks of the file are in memory. ``finish`` waits for the rest and drops the
    whole file; a file that never reached a chunk is left alone (small files gain nothing from a wait).

    Args:
        fh: a file opened for writing (buffered or not).

    Raises:
        OSError: writing back a chunk failed (EIO, ENOSPC …), as the fsync before a commit would have reported.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> path = Path(tempfile.mkdtemp()) / "big.bin"
        >>> with open(path, "wb") as fh:
        ...     out = DropBehind(fh)
        ...     out.write(bytes(CHUNK + 5))
        ...     out.finish()
        >>> path.stat().st_size == CHUNK + 5
        True
    """

    def __init__(self, fh: BinaryIO):
        self.fh = fh
        self._enabled = _sync_range is not None
        self._start = fh.tell()  # where the next writeback starts
        self._pending: tuple[int, int] | None = None  # written back, not yet waited for

    def write(self, data) -> None:
        """Append ``data`` (any buffer), starting writeback of every full chunk it completes."""
        view = memoryview(data).cast("B")
        for i in range(0, len(view), CHUNK):
            self.fh.write(view[i:i + CHUNK])
            if self._enabled:
                end = self.fh.tell()
                if end - self._start >= CHUNK:
                    self._advance(end)

    def _advance(self, end: int) -> None:
        self.fh.flush()
        fd = self.fh.fileno()
        self._call(fd, self._start, end - self._start, _WRITE)
        if self._pending is not None:
            self._settle(fd, *self._pending)
        self._pending = (self._start, end - self._start)
        self._start = end

    def _settle(self, fd: int, offset: int, length: int) -> None:
        self._call(fd, offset, length, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
        fault_point("write.synced")
        if self._enabled:
            drop(fd, offset, length)

    def _call(self, fd: int, offset: int, length: int, flags: int) -> None:
        if not self._enabled:
            return
        if _sync_range(fd, offset, length, flags) != 0:
            code = ctypes.get_errno()
            if code in _UNSUPPORTED:
                self._enabled = False  # e.g. a file system without it: the pages stay, as they would anyway
                return
            raise OSError(code, os.strerror(code), getattr(self.fh, "name", None))

    def finish(self) -> None:
        """Wait for everything written so far and drop the file from the cache (before ``close``)."""
        if not self._enabled or self._pending is None:
            return
        self.fh.flush()
        self._settle(self.fh.fileno(), 0, 0)  # length 0: to the end of the file
        self._pending = None
        self._start = self.fh.tell()
