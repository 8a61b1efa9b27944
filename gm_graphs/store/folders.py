"""Where graphs live, and how graphmax writes folders without ever losing one it did not write.

- A graph *name* (``[A-Za-z0-9_-][A-Za-z0-9._-]*``) means ``$GRAPHMAX_HOME/graphs/<name>``. A folder anywhere
  else is given explicitly: a ``pathlib.Path`` in Python, ``--path DIR`` on the command line. A ``str`` is always
  a name, so ``"../x"`` or ``"mydata/"`` are refused rather than read as paths.
- graphmax replaces or deletes only folders it wrote: a graph folder (its manifest carries the format marker),
  a folder holding one of its marker files (splits, eval reports), or one of its temporary folders.
- A writer holds the target's lock (``fcntl.flock`` on ``.<name>.lock`` beside it); a second writer of the same
  target fails at once with :class:`GraphBusyError`. The holder removes the lock file before releasing it, and a
  writer that locked a removed file's inode tries again, so no lock file is left and no two writers both hold one.
- A folder is written as a temporary sibling ``.<name>.tmp-<hex>`` (marked inside) and committed in one atomic
  step: a rename when the target is absent, ``renameat2(RENAME_EXCHANGE)`` when it replaces one, so the name
  always holds the old folder or the new one. Where the kernel lacks the exchange, the old folder is first moved
  aside to ``.<name>.old-<hex>``; if the process dies between the two renames, the next writer puts it back.
- Temporary and moved-aside folders of dead writers are removed by the next writer of that target (it holds the
  lock, so their writers are gone). Deleting keeps the marker until last, so a kill midway leaves them marked.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gm_graphs.errors import (
    GraphBusyError,
    GraphExistsError,
    GraphFormatError,
    GraphNameError,
    NotOwnedError,
    StorageError,
)
from gm_graphs.store.faults import fault_point

NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")  # ≤ 200 characters: room for ".<name>.tmp-<hex>"
MANIFEST = "manifest.json"
GRAPH_FORMAT = "graphmax-graph"  # the manifest's "format": what makes a folder a graph graphmax wrote
TEMP_MARKER = ".graphmax-temp"
REPORT_MARKER = ".graphmax-report"
MAX_MANIFEST_BYTES = 64 << 20
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def graphmax_home() -> Path:
    """``$GRAPHMAX_HOME`` or ``~/.cache/graphmax``; named graphs live in its ``graphs/``.

    Returns:
        ``pathlib.Path``: the folder (it may not exist yet).

    Example::

        >>> graph_path("reviews").relative_to(graphmax_home()).as_posix()
        'graphs/reviews'
    """
    return Path(os.environ.get("GRAPHMAX_HOME") or Path.home() / ".cache" / "graphmax")


def graphs_root() -> Path:
    return graphmax_home() / "graphs"


def list_graphs() -> list[str]:
    """The names of the folders under ``$GRAPHMAX_HOME/graphs`` that hold a manifest (whole or not).

    Returns:
        ``list[str]``: the graph names, sorted; empty when there is no such folder.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
        >>> from gm_graphs import build_graph
        >>> import os
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"GRAPHMAX_HOME": str(folder / "home")}):   # graphs live here
        ...     _ = build_graph(folder / "reviews.txt", tok, name="reviews", progress=False)
        ...     list_graphs()
        ['reviews']
    """
    root = graphs_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if NAME.fullmatch(p.name) and (p / MANIFEST).is_file())


def missing_graph(graph: str | os.PathLike) -> GraphFormatError | None:
    """The error that says a graph given by name (``str``) or folder is not there, with the command that builds it;
    None where something is at its path (what it is, :class:`gm_graphs.Graph` checks). Reads no graph."""
    path = graph_path(graph)
    if os.path.lexists(path):
        return None
    if isinstance(graph, str):
        known = ", ".join(list_graphs()) or "none"
        return GraphFormatError(f"no graph {graph!r} in {graphs_root()} (graphs there: {known}); build it with "
                                f"`graphmax build CORPUS --tokenizer T --name {graph}`")
    return GraphFormatError(f"no graph folder {path}; build one with `graphmax build CORPUS --tokenizer T "
                            f"--path {path}`")


def check_name(name: object) -> str:
    """``name`` if it is a valid graph name, else a :class:`GraphNameError` that says how to give a folder."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise GraphNameError(f"{name!r} is not a graph name (letters, digits, '.', '_', '-'; not starting with '.'; "
                             f"at most 200 characters); to use a folder, pass Path({str(name)!r}) in Python or "
                             f"--path on the command line")
    return name


def graph_path(graph: str | os.PathLike) -> Path:
    """The folder of a graph given by name (``str``) or by folder (any other ``os.PathLike``).

    Args:
        graph (``str`` or ``os.PathLike``): a name (letters, digits, ``.``, ``_``, ``-``) or a folder.

    Returns:
        ``pathlib.Path``: ``$GRAPHMAX_HOME/graphs/<name>``, or the folder itself.

    Example::

        >>> from pathlib import Path
        >>> graph_path("reviews") == graphmax_home() / "graphs" / "reviews"
        True
        >>> graph_path(Path("work/reviews")).as_posix()
        'work/reviews'
    """
    if isinstance(graph, str):
        return graphs_root() / check_name(graph)
    if isinstance(graph, os.PathLike):
        folder = os.fspath(graph)
        if isinstance(folder, str):
            return Path(folder)
    raise TypeError(f"a graph is a name (str) or a folder (pathlib.Path), got {type(graph).__name__}")


def target_folder(name: str | None, path: str | os.PathLike | None) -> Path:
    """The folder a writer fills: ``$GRAPHMAX_HOME/graphs/<name>`` or the explicit ``path``, exactly one of them."""
    if (name is None) == (path is None):
        raise GraphNameError("give exactly one of name= (stored under $GRAPHMAX_HOME/graphs) or path= (a folder); "
                             "on the command line --name NAME or --path DIR")
    if name is not None:
        return graphs_root() / check_name(name)
    folder = Path(os.fspath(path))
    if not folder.name or folder.name in (".", ".."):
        raise GraphNameError(f"--path {str(path)!r} does not end in a folder name; give the folder to write, "
                             f"e.g. {os.path.join(str(path), 'graph')!r}")
    return folder


# ---- what graphmax owns -------------------------------------------------------------------------------------------

def read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a symlink) of at most ``limit`` bytes, else None. It is
    opened without blocking and checked on the descriptor, so a FIFO or a device put there, even between a check
    and the read, is never read: reading a FIFO waits for a writer, forever. Raises OSError when it cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)
    finally:
        os.close(fd)
    return data if len(data) <= limit else None


def is_graph_folder(path: Path) -> bool:
    """A real folder whose manifest (a regular file) carries graphmax's format marker."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        blob = read_regular(path / MANIFEST, MAX_MANIFEST_BYTES)
        if blob is None:
            return False
        data = json.loads(blob.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(data, dict):
        return False
    return data.get("format") == GRAPH_FORMAT


def _is_marked(path: Path, marker: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and stat.S_ISREG(os.lstat(path / marker).st_mode)
    except OSError:
        return False


@dataclass(frozen=True)
class Artefact:
    """A kind of folder graphmax writes, and what tells that graphmax wrote one. Each writer passes its own to
    :func:`check_replaceable` and :func:`staged_folder`, so this module knows no artefact's layout.

    Args:
        kind (``str``): its name in messages ("graph", "datastore", "split", "report").
        owned (``Callable[[Path], bool]``): whether graphmax wrote the folder as one of these.
        written (``Callable[[Path], tuple[set[str], re.Pattern | None]]`` or ``None``, defaults to ``None``): the
            paths (relative to the folder) such a folder holds, and a pattern of names graphmax's own writers leave
            behind there; ``None`` for kinds whose folders are never replaced whole.
    """

    kind: str
    owned: Callable[[Path], bool]
    written: Callable[[Path], tuple[set[str], re.Pattern | None]] | None = None


def marked(kind: str, marker: str, files: tuple[str, ...] | None = None) -> Artefact:
    """The artefact whose folders hold the file ``marker``, and (``files``) only it and those."""
    written = None if files is None else (lambda path: ({marker, *files}, None))
    return Artefact(kind, lambda path: _is_marked(path, marker), written)


REPORT = marked("report", REPORT_MARKER)


def foreign_entry(path: Path, artefact: Artefact) -> str | None:
    """The first file or folder inside ``path``, a folder graphmax wrote as ``artefact``, that graphmax did not put
    there (a user's notes, a licence), as a path relative to ``path``; None if there is none. Replacing the folder
    would delete it."""
    if artefact.written is None:
        return None
    files, debris = artefact.written(path)
    folders = {str(Path(f).parent) for f in files} - {"."}
    folders |= {str(p) for f in folders for p in Path(f).parents if str(p) != "."}
    for folder, dirs, names in os.walk(path):
        rel = os.path.relpath(folder, path)
        for name in sorted(dirs) + sorted(names):
            entry = name if rel == "." else f"{rel}/{name}"
            if debris is not None and debris.fullmatch(entry):
                continue
            if entry not in (folders if name in dirs and not os.path.islink(os.path.join(folder, name)) else files):
                return entry
    return None


def _describe(path: Path, kind: str) -> str:
    if kind == "graph" and path.parent == graphs_root():
        return f"graph {path.name!r} ({path})"
    return f"{kind} folder {path}"


def check_replaceable(target: Path, overwrite: bool, artefact: Artefact) -> None:
    """Refuse a target that exists unless ``overwrite`` and graphmax wrote it as ``artefact``."""
    if not os.path.lexists(target):
        return
    kind = artefact.kind
    if not artefact.owned(target):
        what = "a symlink" if os.path.islink(target) else ("a folder" if target.is_dir() else "a file")
        raise NotOwnedError(f"{target} exists and is {what} graphmax did not write as a {kind} (no graphmax "
                            f"{'manifest' if kind == 'graph' else 'marker'} in it); graphmax never replaces it: "
                            f"choose another {'name or --path' if kind == 'graph' else 'folder'}")
    if not overwrite:
        raise GraphExistsError(f"{_describe(target, kind)} already exists; choose another name or pass --overwrite")
    foreign = foreign_entry(target, artefact)
    if foreign is not None:
        raise NotOwnedError(f"{_describe(target, kind)} holds {foreign!r}, which graphmax did not write; replacing the "
                            f"folder would delete it, and graphmax never does: move it out, then run again")


def claim_folder(path: Path, marker: str = REPORT_MARKER) -> Path:
    """Make ``path`` a folder graphmax may write into: create it (absent), or accept it if empty or already marked.

    Anything else is refused, so a report never lands in (or replaces files of) a folder the user owns.

    Args:
        path (``pathlib.Path``): the folder.
        marker (``str``, defaults to ``".graphmax-report"``): the file that marks the folder as graphmax's.

    Returns:
        ``pathlib.Path``: ``path``, now a folder holding the marker.

    Raises:
        NotOwnedError: ``path`` is a file, or a non-empty folder without the marker.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> out = claim_folder(folder / "report")       # created and marked
        >>> claim_folder(out) == out                    # graphmax's own: accepted again
        True
        >>> (folder / "mine").mkdir(); _ = (folder / "mine" / "notes.txt").write_text("keep")
        >>> claim_folder(folder / "mine")
        Traceback (most recent call last):
        ...
        gm_graphs.errors.NotOwnedError: ...mine is a folder graphmax did not write (no .graphmax-report in it) ...
    """
    path = Path(path)
    if os.path.lexists(path):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise NotOwnedError(f"{path} exists and is not a folder; choose another --out")
        if not _is_marked(path, marker) and any(os.scandir(path)):
            raise NotOwnedError(f"{path} is a folder graphmax did not write (no {marker} in it) and is not empty; "
                                f"choose a new or empty folder for --out")
    path.mkdir(parents=True, exist_ok=True)
    _write_marker(path / marker)
    return path


def _write_marker(path: Path) -> None:
    # not through a symlink, and never waiting on a FIFO put in its place
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps({"pid": os.getpid()}) + "\n")


# ---- locks --------------------------------------------------------------------------------------------------------

_held = threading.local()  # the lock paths this thread holds: re-entrant within it, exclusive across threads/processes


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


@contextmanager
def locked(target: Path) -> Iterator[None]:
    """Hold ``target``'s writer lock; fail at once with :class:`GraphBusyError` if another writer holds it."""
    lock = lock_path(Path(target))
    key = os.path.abspath(lock)
    held = _held.__dict__.setdefault("paths", set())
    if key in held:  # an outer block of this thread holds it
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = _acquire(lock, target)
    held.add(key)
    try:
        yield
    finally:
        held.discard(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)  # while still holding it: a writer that opened this inode sees it gone and retries
        os.close(fd)


def _acquire(lock: Path, target: Path) -> int:
    """An fd holding the flock of the file now at ``lock`` (a removed lock file's inode does not count)."""
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP and os.path.islink(lock):  # O_NOFOLLOW refused it: not a folder's permissions
                raise StorageError(f"the lock file {lock} is a symlink, which graphmax did not create and does not "
                                   f"follow; remove the link and run again") from e
            raise StorageError(f"cannot create the lock file {lock}: {e.strerror}; check that its folder is "
                               f"writable") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GraphBusyError(f"{target} is being written by another graphmax process (it holds {lock.name}); "
                                 f"wait for it to finish, or write another name") from None
        mine = os.fstat(fd)
        try:
            now = os.stat(lock, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # its holder removed it as we opened it: lock the file that is there now


# ---- atomic commit ------------------------------------------------------------------------------------------------

_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _libc_renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()  # None where libc lacks it (not Linux, old glibc): the fallback is used


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(src, dst, flags); False where the kernel or file system does not support it."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (before a rename makes them visible under the final name)."""
    for folder, _dirs, files in os.walk(root):
        for f in files:
            # not a symlink's target; a FIFO put there is opened without waiting for a writer, and not synced
            fd = os.open(os.path.join(folder, f), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def remove_tree(path: Path) -> None:
    """Delete a folder graphmax owns so that a kill midway leaves it recognisable for cleanup: marked, and with its
    marker and its manifest (what makes a graph folder graphmax's) removed last.

    Removing needs no room on the disk: where the marker cannot be written (a full disk, the very case a failed
    write is cleaned up in), the folder is removed all the same, and until the end its manifest or its name (an
    n-gram folder, a temporary folder) tells the next writer that it is graphmax's.
    """
    marker = path / TEMP_MARKER
    if not os.path.lexists(marker):
        try:
            _write_marker(marker)
        except OSError:
            pass  # see the docstring
    last = []
    for entry in os.scandir(path):
        if entry.name in (TEMP_MARKER, MANIFEST) and entry.is_file(follow_symlinks=False):
            last.append(entry.path)
        elif entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    fault_point("remove.emptied")
    for file in sorted(last, key=lambda f: os.path.basename(f) == TEMP_MARKER):  # the marker after the manifest
        os.unlink(file)
    os.rmdir(path)


def _stale_pattern(target: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-[0-9a-f]{{12}}")


def clean_stale(target: Path, artefact: Artefact) -> None:
    """Remove temporary and moved-aside folders of dead writers of ``target`` (call with its lock held).

    Only folders named like graphmax's and marked as its own (or empty) are touched; a moved-aside folder whose
    target is missing (a death between the fallback's two renames) is put back instead.
    """
    parent, pattern = target.parent, _stale_pattern(target)
    if not parent.is_dir():
        return
    for entry in sorted(os.scandir(parent), key=lambda e: e.name):
        match = pattern.fullmatch(entry.name)
        if not match or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if match.group(1) == "old" and not os.path.lexists(target) and artefact.owned(path):
            os.rename(path, target)
            fsync_dir(parent)
            continue
        if _is_marked(path, TEMP_MARKER) or artefact.owned(path) or not any(os.scandir(path)):
            remove_tree(path)


def _commit(tmp: Path, target: Path) -> None:
    parent = target.parent
    if not os.path.lexists(target):
        if not _rename2(tmp, target, _RENAME_NOREPLACE):
            os.rename(tmp, target)  # the target is checked absent under the lock; no graphmax writer races us
        fsync_dir(parent)
        fault_point("commit.renamed")
        return
    if _rename2(tmp, target, _RENAME_EXCHANGE):
        fsync_dir(parent)
        fault_point("commit.exchanged")
        _remove_after_commit(tmp)  # now holds the old folder
        return
    old = parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
    os.rename(target, old)
    fault_point("commit.moved_aside")
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    fsync_dir(parent)
    fault_point("commit.replaced")
    _remove_after_commit(old)


def note_left(error: BaseException, path: Path | None) -> None:
    """Record on ``error``, as it propagates, that the clean-up of its failed write left ``path`` behind (None:
    nothing), so that :func:`disk_errors` does not say that nothing was written."""
    if path is not None:
        error.graphmax_left = path


def _remove_after_commit(path: Path) -> None:
    """The replaced folder, best effort: the new one is committed, so a failure here fails nothing; what is left
    stays marked (or a graph) under a temporary name, and the next writer removes it."""
    try:
        remove_tree(path)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


@contextmanager
def disk_errors(target: Path) -> Iterator[None]:
    """Turn a full disk (or a read-only file system) while writing ``target`` into a one-line StorageError."""
    try:
        yield
    except OSError as e:
        if e.errno in _FULL_DISK and not isinstance(e, StorageError):
            # a write to an open file names no path: the target, named first, is then all there is to say
            where = "" if not isinstance(e.filename, (str, bytes)) else f" ({os.fsdecode(e.filename)})"
            fix = "choose a writable location" if e.errno == errno.EROFS else "free space and run again"
            left = getattr(e, "graphmax_left", None)
            outcome = ("nothing was written and what was there is unchanged" if left is None else
                       f"what was there is unchanged, but the partial {left} could not be removed (the next write "
                       f"there removes it, or delete it)")
            raise StorageError(f"cannot write {target}: {e.strerror}{where}; {outcome}; {fix}") from e
        raise


@contextmanager
def staged_folder(target: Path, *, overwrite: bool, artefact: Artefact) -> Iterator[Path]:
    """Yield a marked temporary sibling of ``target`` that atomically becomes ``target`` if the block succeeds.

    Holds ``target``'s lock throughout; refuses at once (before any work) a target that exists and is not
    ``overwrite``-able. A failure removes the temporary folder; a kill leaves it, marked, for the next writer.
    Disk-full errors become a one-line :class:`StorageError`.
    """
    target = Path(target)
    check_replaceable(target, overwrite, artefact)  # before the lock file: a refused target gets nothing beside it
    with locked(target), disk_errors(target):
        check_replaceable(target, overwrite, artefact)
        clean_stale(target, artefact)
        tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            os.mkdir(tmp)
            _write_marker(tmp / TEMP_MARKER)
            fault_point("stage.created")
            yield tmp
            fault_point("stage.filled")
            check_replaceable(target, overwrite, artefact)  # again: a user may have put something there meanwhile
            os.unlink(tmp / TEMP_MARKER)
            sync_tree(tmp)
            fault_point("stage.unmarked")
            _commit(tmp, target)
        except BaseException as error:
            note_left(error, _discard(tmp))
            raise


def _discard(tmp: Path) -> Path | None:
    """Remove the temporary folder of a failed write: None, or ``tmp`` where it could not be."""
    if os.path.lexists(tmp):
        try:
            remove_tree(tmp)
        except OSError:
            return tmp  # still marked (or unmarked but a graph): the next writer removes it
    return None
