"""Sealed files: a cache entry that can tell whether it still holds what was written for a given identity.

A sealed file is ``MAGIC``, then the SHA-256 of ``repr(identity)``, a NUL byte and the payload, then the payload.
:func:`read_sealed` gives the payload back only when the seal matches: a file that is missing, unreadable,
truncated, garbled or written for another identity reads as None (a cache miss), never as data.
:func:`write_sealed` writes a new file whole under a temporary name beside it and renames it over the old one, so
a reader sees the old file or the new one. graphmax's caches (the kernels', the tokenizers') keep their entries
this way because every file in a cache is untrusted local state.

A seal is an integrity check, not an authentication: it is a SHA-256 of public values (versions, a digest of the
sources, a kernel's name) and of the payload, so anyone who can write a file can seal it. What keeps another user's
file out is where it is and whose it is: :func:`read_sealed` reads only a regular file owned by this user (or
root) that no one else may write, opened without following a symlink and without blocking (a FIFO in place of an
entry would otherwise hang every reader); anything else is a miss. The kernel cache also keeps its fall-back
folder to this user alone (:mod:`gm_graphs.store.kernel_cache`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import uuid
import warnings

from gm_graphs.store.faults import fault_point

MAGIC = b"graphmax-sealed\n"


def _digest(identity: tuple, payload: bytes) -> bytes:
    digest = hashlib.sha256(repr(identity).encode())  # a repr holds no NUL byte: the two parts cannot run together
    digest.update(b"\0")
    digest.update(payload)
    return digest.digest()


def seal(identity: tuple, payload: bytes) -> bytes:
    """The bytes of a sealed file holding ``payload`` for ``identity``.

    Example::

        >>> blob = seal(("tokenizer", 1), b"data")
        >>> unseal(("tokenizer", 1), blob), unseal(("tokenizer", 2), blob), unseal(("tokenizer", 1), blob[:-1])
        (b'data', None, None)
    """
    return MAGIC + _digest(identity, payload) + payload


def unseal(identity: tuple, blob: bytes) -> bytes | None:
    """The payload of a sealed ``blob``, or None when it was not sealed with ``identity`` or was changed since."""
    head, payload = blob[:len(MAGIC) + 32], blob[len(MAGIC) + 32:]
    return payload if head == MAGIC + _digest(identity, payload) else None


def trusted(st: os.stat_result) -> str | None:
    """None when a file of status ``st`` may be read as a cache entry; else why not, in a few words: it is not a
    regular file, or another user owns it or may write it."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid not in (os.getuid(), 0):
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"may be written by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


_warned = False  # one warning per process: a cache folder holds dozens of entries


def read_sealed(path: str | os.PathLike, identity: tuple, limit: int) -> bytes | None:
    """The payload of the sealed file ``path``; None for a missing, unreadable or damaged file, one sealed for
    another identity, or one longer than ``limit`` bytes (not read past it). None also for anything but a regular
    file that this user (or root) owns and no one else may write: it is opened without blocking and checked before
    a byte is read, and the first such file of a process gets one warning that names it (an entry of this user's
    that the group may write gets none: an older graphmax wrote it so under a umask of 002)."""
    global _warned
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        why = trusted(st)
        if why is None:
            with os.fdopen(fd, "rb", closefd=False) as f:
                blob = f.read(limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if why is not None:
        if not _warned and not (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()):
            _warned = True
            warnings.warn(f"graphmax ignores the cache entry {os.fsdecode(path)}: it {why}; what it would hold is "
                          f"made again, and the entry replaced where graphmax can write there; remove it if it is "
                          f"not yours", RuntimeWarning, stacklevel=2)
        return None
    return None if len(blob) > limit else unseal(identity, blob)


def write_sealed(path: str | os.PathLike, identity: tuple, payload: bytes) -> None:
    """Seal ``payload`` for ``identity`` into ``path``, replacing it whole; raises OSError when it cannot."""
    path = os.fspath(path)
    temporary = f"{path}.{uuid.uuid4().hex[:16]}.tmp"
    try:
        # writable by its owner alone whatever the umask: read_sealed refuses a file that others may write
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(seal(identity, payload))
        fault_point("sealed.written")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
