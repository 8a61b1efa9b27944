"""The verification cache: which graph files already passed their checks, so a multi-GB graph is hashed once.

A passed check is remembered as an empty file ``$GRAPHMAX_HOME/verified/<key>``: a file's SHA-256 (kind ``sha256``)
or the structure checks of a unit of arrays (one CSR shard, one n-gram order, the stats). The key hashes what was
checked (the kind, its manifest context, the checks' version) and each file's identity: real path, device, inode,
size, mtime and ctime in ns, and the SHA-256 the manifest expects. Rewriting a file makes a new
inode; editing it in place moves its ctime, which no user can set back; either gives a new key, so the file is
checked again. The build records what it wrote (it hashed the bytes as it wrote them).

The cache is best effort: where ``$GRAPHMAX_HOME`` is not writable, every load checks everything.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import astuple, dataclass

from gm_graphs.store.folders import graphmax_home

CHECKS_VERSION = 1  # bump when the checks change, so that older entries no longer count


@dataclass(frozen=True)
class FileIdentity:
    realpath: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    sha256: str  # what the manifest expects

    @classmethod
    def of(cls, realpath: str, st: os.stat_result, sha256: str) -> FileIdentity:
        return cls(realpath, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, sha256)


def _entry(kind: str, context: dict, files: list[FileIdentity]) -> str:
    blob = json.dumps([CHECKS_VERSION, kind, context, [astuple(f) for f in files]], sort_keys=True)
    return os.path.join(graphmax_home(), "verified", hashlib.sha256(blob.encode()).hexdigest())


def is_verified(kind: str, context: dict, files: list[FileIdentity]) -> bool:
    return os.path.isfile(_entry(kind, context, files))


def remember(kind: str, context: dict, files: list[FileIdentity]) -> None:
    path = _entry(kind, context, files)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # a FIFO put in its place would make a blocking open wait for a reader, forever: refused (ENXIO) instead
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW, 0o644))
    except OSError:
        pass  # a read-only home, or not a file: the next load checks again
