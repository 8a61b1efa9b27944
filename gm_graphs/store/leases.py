"""Memory maps that another program's in-place rewrite cannot crash: a read lease on each mapped file.

A page of a memory-mapped file that another program truncates away (``cp`` or ``rsync --inplace`` over it, any
``open(path, "r+b").truncate(0)``) raises SIGBUS at its next read, and SIGBUS kills Python: no exception can catch it,
and a numba kernel reading the page cannot even see it coming. A rewrite that keeps the size changes checked bytes
under a kernel that trusts them. graphmax never writes a graph in place (it renames a new folder over the old one,
and the old files live on while mapped), but other tools do.

So each file graphmax maps holds a Linux read lease (``fcntl(F_SETLEASE, F_RDLCK)``): a program that opens it for
writing or truncates it waits in that call (at most ``/proc/sys/fs/lease-break-time``, 45 s by default) while the
kernel signals the holder. The signal goes to one watcher thread only (``F_SETOWN_EX``), which copies the mapped
bytes into anonymous memory and moves the copy over the same addresses in one ``mremap``: a reader in another thread,
a numba kernel mid-loop included, reads the same bytes before and after, and no page can fault any more. It then
marks the :class:`Lease` revoked and releases it; the writer goes on once the copy is made, and the graph's next
decoding step raises ``GraphBusyError`` (``gm_graphs.format.graph_files``). A forked child takes leases of its own
for what it inherited. Where there is not the memory for a copy, zero pages take the file's place instead.

Where the kernel grants no lease (a file of another user, a file system without leases, a file open for writing
elsewhere), :func:`map_leased` raises :class:`Refused` and the caller reads the file into memory instead
(``gm_graphs.store.reader``). Not on Linux, there are no leases.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import signal
import struct
import sys
import threading
import weakref
from collections.abc import Callable
from typing import BinaryIO

import numpy as np

# SIGURG, whose default is to be ignored: the watcher blocks it and waits for it, and one sent to the whole process
# (between F_SETLEASE, which makes the process the owner, and F_SETOWN_EX) is dropped, never fatal as SIGIO's default
_SIGNAL = signal.SIGURG
_F_SETOWN_EX, _F_OWNER_TID = 15, 0  # <linux/fcntl.h>; Python's fcntl module lacks them
_MAP_FIXED, _MREMAP_MAYMOVE, _MREMAP_FIXED = 0x10, 1, 2
_SUPPORTED = sys.platform.startswith("linux") and hasattr(fcntl, "F_SETLEASE") and hasattr(signal, "sigwaitinfo")


def _libc():
    if not _SUPPORTED:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fns = libc.mmap, libc.mremap, libc.mprotect, libc.munmap
    except (OSError, AttributeError):
        return None
    for fn in fns:
        fn.restype = ctypes.c_void_p if fn in fns[:2] else ctypes.c_int
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


_c = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


class Refused(Exception):
    """The kernel grants no lease on the file; the message says why."""


class Lease:
    """The read lease on one mapped file: :attr:`revoked` once another program opened it for writing (its mapping
    then holds a copy of the bytes it held, or zero pages).

    Attributes:
        name (``str``): the file's path as the caller named it, for messages.
        revoked (``bool``): the file was opened for writing or truncated while mapped.
    """

    __slots__ = ("name", "revoked", "fd", "pid", "mapping", "address", "length")

    def __init__(self, name: str, fd: int):
        self.name, self.revoked, self.fd, self.pid = name, False, fd, os.getpid()
        self.mapping: weakref.ref | None = None  # the mmap.mmap: None once its deallocation began (and unmapped it)
        self.address = self.length = 0

    @property
    def held(self) -> bool:
        """True while the lease protects a live mapping (neither revoked nor released)."""
        return self.fd >= 0


_lock = threading.RLock()  # re-entrant: a finalizer (_release) may run inside a locked section of its thread
_held: dict[int, Lease] = {}  # by descriptor
_watcher_tid: int | None = None
_revocations = 0


def revocations() -> int:
    """How many leases of this process were revoked so far: a holder compares it with the count it last saw
    before it looks at its own leases."""
    return _revocations


def map_leased(fh: BinaryIO, name: str, dtype: np.dtype, offset: int, length: int,
               unchanged: Callable[[], None] = lambda: None) -> tuple[np.memmap, Lease]:
    """``length`` values of ``dtype`` at ``offset`` in the open file ``fh``, memory-mapped read-only under a read lease.

    Args:
        fh (binary file): the file, opened read-only.
        name (``str``): its name in messages.
        dtype (``numpy.dtype``): the values' type.
        offset (``int``): where the values start, in bytes.
        length (``int``): how many values, at least 1.
        unchanged (callable, defaults to none): called once the lease is held, before the file is mapped: raises
            if the file is no longer what the caller checked (a writer that came and went before the lease).

    Returns:
        ``(numpy.memmap, Lease)``: the array, and the lease that protects it while it lives.

    Raises:
        Refused: no lease is granted (the message says why); nothing was mapped.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> path = Path(tempfile.mkdtemp()) / "a.bin"; _ = path.write_bytes(np.arange(4, dtype="<i8").tobytes())
        >>> with open(path, "rb") as fh:
        ...     values, lease = map_leased(fh, "a.bin", np.dtype("<i8"), 8, 3)
        >>> values.tolist(), lease.held, lease.revoked
        ([1, 2, 3], True, False)
    """
    tid = _watcher()
    fd = os.dup(fh.fileno())  # the lease's own descriptor: released through it once the mapping goes
    try:
        with _lock:
            lease = Lease(name, fd)
            _take(fd, tid)
            unchanged()
            values = np.memmap(fh, dtype=dtype, mode="r", offset=offset, shape=(length,))
            whole = values.base  # the mmap.mmap numpy made, from its page-aligned start
            lease.mapping = weakref.ref(whole)
            lease.address, lease.length = np.frombuffer(whole, np.uint8).ctypes.data, len(whole)
            _held[fd] = lease
            weakref.finalize(whole, _release, lease).atexit = False
            return values, lease
    except BaseException:
        if fd not in _held:
            _unlock(fd)  # (a lease left on the description would hold the next writer up until the kernel broke it)
            os.close(fd)
        raise


def _take(fd: int, tid: int) -> None:
    """Lease ``fd`` with its breaks signalled to the watcher thread ``tid``, or raise :class:`Refused`."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, _SIGNAL)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as e:
        raise Refused(_why(e)) from None
    try:  # the lease made the whole process its owner: the watcher alone is to be signalled
        fcntl.fcntl(fd, _F_SETOWN_EX, struct.pack("ii", _F_OWNER_TID, tid))
        if fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK:
            return
    except OSError as e:
        _unlock(fd)
        raise Refused(_why(e)) from None
    _unlock(fd)  # a writer came between the lease and its owner: its break was signalled to no one
    raise Refused("another process opened it for writing as it was loaded")


def _why(e: OSError) -> str:
    if e.errno == errno.EACCES:
        return "it belongs to another user, and only a file's owner may lease it"
    if e.errno == errno.EAGAIN:
        return "another process has it open for writing"
    if e.errno in (errno.EINVAL, errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
        return "its file system grants no file leases"
    return f"the kernel grants no lease on it ({e.strerror})"


def _unlock(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError:
        pass  # not leased, or the kernel broke it already


def _watcher() -> int:
    """The native id of the thread that answers lease breaks, started on first use."""
    if not _SUPPORTED or _c is None:
        raise Refused("this system has no file leases")
    if _watcher_tid is None:
        with _lock:
            if _watcher_tid is None:
                ready = threading.Event()
                threading.Thread(target=_watch, args=(ready,), name="graphmax-leases", daemon=True).start()
                ready.wait()
    return _watcher_tid


def _watch(ready: threading.Event) -> None:
    global _watcher_tid
    signal.pthread_sigmask(signal.SIG_BLOCK, {_SIGNAL})  # only ever taken by sigwaitinfo, never delivered
    _watcher_tid = threading.get_native_id()
    ready.set()
    while True:
        signal.sigwaitinfo({_SIGNAL})  # one signal may stand for several breaks: look at every lease
        with _lock:
            for lease in list(_held.values()):
                try:
                    if lease.held and fcntl.fcntl(lease.fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK:
                        _revoke(lease)
                except Exception:  # the watcher must outlive any one lease: the others need it
                    try:
                        _release(lease)
                    except Exception:
                        pass


def _revoke(lease: Lease) -> None:
    """Put a copy of the mapping's bytes in its place (zero pages where the memory is lacking), mark the lease
    revoked and release it: the writer waiting in ``open`` goes on."""
    global _revocations
    # a strong reference for the time of the copy: a mapping whose deallocation began is unmapped, or soon will be,
    # and its addresses may be another mapping's by now; it needs no cover, as nothing can read it any more
    mapping = lease.mapping() if lease.mapping is not None else None
    try:
        if mapping is not None:
            _cover(lease.address, lease.length)
    finally:
        if mapping is not None:
            lease.revoked = True
            _revocations += 1
        _release(lease)


def _cover(address: int, length: int) -> None:
    pages = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
    available = available_memory()
    if available is None or length <= available // 2:
        # shared anonymous memory: MADV_DONTNEED (gm_graphs.format.validate drops checked windows) keeps its bytes
        copy = _c.mmap(None, pages, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS, -1, 0)
        if copy not in (None, _MAP_FAILED):
            ctypes.memmove(copy, address, length)  # the writer waits: the file still holds every byte
            _c.mprotect(copy, pages, mmap.PROT_READ)
            if _c.mremap(copy, pages, pages, _MREMAP_MAYMOVE | _MREMAP_FIXED, address) == address:
                return
            _c.munmap(copy, pages)
    _c.mmap(address, pages, mmap.PROT_READ, _MAP_FIXED | mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)


def _release(lease: Lease) -> None:
    """Give the lease back and close its descriptor (its mapping is gone, or copied away)."""
    with _lock:
        if lease.fd >= 0 and _held.get(lease.fd) is lease:
            del _held[lease.fd]
            if lease.pid == os.getpid():  # an inherited one is the parent's: unlocking it would unprotect it
                _unlock(lease.fd)
            os.close(lease.fd)
            lease.fd = -1


def _after_fork_in_child() -> None:
    """Threads do not survive a fork, and the inherited leases signal the parent's watcher: lease what the child
    inherited again, through descriptors of its own, or cover it now where that fails."""
    global _lock, _watcher_tid
    _lock, _watcher_tid = threading.RLock(), None
    inherited = list(_held.values())
    _held.clear()
    for lease in inherited:
        try:
            fd = os.open(f"/proc/self/fd/{lease.fd}", os.O_RDONLY | os.O_CLOEXEC)  # a new open file description
        except OSError:
            fd = -1
        os.close(lease.fd)  # the child's copy of the parent's descriptor: closing it leaves the parent's lease be
        lease.fd, lease.pid = fd, os.getpid()
        if fd >= 0:
            _held[fd] = lease
            try:
                _take(fd, _watcher())
                continue
            except Exception:  # Refused, or no thread to answer its breaks
                pass
        _revoke(lease)


if _SUPPORTED:
    os.register_at_fork(after_in_child=_after_fork_in_child)


def available_memory() -> int | None:
    """Bytes of memory the kernel can give without swapping (Linux' MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
