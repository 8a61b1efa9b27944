"""Sealed files: a cache entry that can tell whether it still holds what was written for a given identity.

A sealed file is ``MAGIC``, then the SHA-256 of ``repr(identity)``, a NUL byte and the payload, then the payload.
:func:`read_sealed` gives the payload back only when the seal matches: a file that is missing, unreadable,
truncated, garbled or written for another identity reads as None (a cache miss), never as data.
:func:`write_sealed` writes a new file whole under a temporary name beside it and renames it over the old one, so
a reader sees the old file or the new one. graphmax's caches (the kernels', the tokenizers') keep their entries
this way because every file in a cache is untrusted local state.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid

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


def read_sealed(path: str | os.PathLike, identity: tuple, limit: int) -> bytes | None:
    """The payload of the sealed file ``path``; None for a missing, unreadable or damaged file, one sealed for
    another identity, or one longer than ``limit`` bytes (not read past it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            blob = f.read(limit + 1)
    except OSError:
        return None
    return None if len(blob) > limit else unseal(identity, blob)


def write_sealed(path: str | os.PathLike, identity: tuple, payload: bytes) -> None:
    """Seal ``payload`` for ``identity`` into ``path``, replacing it whole; raises OSError when it cannot."""
    path = os.fspath(path)
    temporary = f"{path}.{uuid.uuid4().hex[:16]}.tmp"
    try:
        with open(temporary, "xb") as f:
            f.write(seal(identity, payload))
        fault_point("sealed.written")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
