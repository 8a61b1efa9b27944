"""Where numba keeps the compiled kernels (``@numba.njit(cache=True)``), and when it may reuse them.

numba caches a kernel beside its source (``__pycache__``) or, where that is read-only (an installed package),
in the user's cache folder (``~/.cache/numba``); where both are read-only (a service user without a home) it
refuses to decorate a cached kernel at all: ``RuntimeError: cannot cache function …: no locator available``.
:func:`ensure_cache_dir` then points numba at a folder under the system's temporary directory, unless the user
chose one (``NUMBA_CACHE_DIR``). Every module that defines cached kernels calls it before defining them.

A cached kernel is code: whoever can write the cache can run code in every graphmax process, and a seal
(below) does not tell who wrote a file, since anyone can compute one. Another local user can create the
temporary folder's name first, so :func:`ensure_cache_dir` creates it for this user alone (mode 0700) and
refuses one that exists with another owner, wider permissions, or as a symlink: graphmax's kernels then run
uncached, with one warning that names the folder. Every other folder a graphmax kernel would be cached in
(``NUMBA_CACHE_DIR``'s, the sources' ``__pycache__``, the user's cache folder) is checked from ``/`` down before
numba makes or writes it (:func:`_distrusted`): each folder on the way owned by this user or root and not writable
by others unless sticky (the cache folder itself not even then: a hard link to a file root owns can be put into a
sticky folder), and no symlink that another user could have placed; otherwise the kernels run uncached with one
warning per process. In any folder, a cache file that is not a regular file of this user's (or root's) that no one
else may write is never read (:func:`gm_graphs.store.sealed.read_sealed`). The folder's lock file is this user's
alone (0600) and is waited for at most :data:`_LOCK_WAIT_S`: one held longer (by another user who could open an
older 0644 one, or a stuck process) means this process saves no kernel there, with one warning.

numba reuses a cached kernel while the kernel's own source file is unchanged: it does not track the modules the
kernel calls into (and inlines), nor the module constants it freezes in. ``gm_solver.backends.numba.context`` calls
the kernels of ``lambert.py`` beside it; after a merge changed ``lambert.py`` alone, ``context.reference_rows`` loaded
its old machine code, built against the old callees, and crashed the process (SIGSEGV). :func:`ensure_cache_dir`
therefore also puts locators ahead of numba's own that take graphmax's kernels only, at the same places, and
stamp them with a digest of every module of ``gm_graphs`` and ``gm_solver``: a change to any of them makes every
graphmax kernel recompile, while other libraries' kernels keep numba's own locators.

numba's own files are not safe to share between processes, nor to trust once written: it saves a kernel's index
(which signature is in which data file) and its data files separately, without a lock, so two processes compiling
one kernel for two argument types at once can leave an index that maps one type to the other's machine code
(run with the wrong types: wrong results, or a crash); and it unpickles whatever a data file holds, so one truncated
or garbled file raises on every run until someone deletes it. Its saves also fail the command when the cache
cannot be written (a full disk), although the kernel could run uncached. So graphmax's kernels get their own
files, ``<kernel>.gmi`` (the index) and ``<kernel>.<n>.gmc`` (one compiled signature each), written by
:class:`_SealedCacheFile`:

- each file is sealed (:mod:`gm_graphs.store.sealed`): it starts with the SHA-256 of what it must be (numba's and
  llvmlite's versions, the digest of all the sources, the kernel, and for a data file the signature and CPU it was
  compiled for) and of its bytes. A file that is truncated, garbled, of another signature or written from other
  sources fails its seal and is compiled again (and replaced), never unpickled;
- a save holds ``fcntl.flock`` on ``graphmax-kernels.lock`` in the cache folder, so the read-modify-write of an
  index is one process's at a time; each file is written whole to a temporary name and renamed over the old one,
  data before index, so a reader without the lock sees old or new files, never a mix that passes a seal;
- any failure to read the cache is a miss (the kernel compiles), and a failure to write it (disk full,
  read-only, even every folder a kernel could be cached in) is one warning per process, after which the kernels
  run uncached.

:func:`kernel_cached` tells, before a kernel is first called, whether this process would load it from the cache
rather than compile it (minutes for a decoder's step): ``gm_solver.backends.compile_in_background`` decodes with
torch meanwhile where it would not.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import grp
import hashlib
import os
import pickle
import pwd
import stat
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import llvmlite
import numba
from numba.misc.appdirs import AppDirs

from gm_graphs.store.sealed import read_sealed, write_sealed

try:
    from numba.core import caching, dispatcher
    from numba.core.registry import cpu_target
    from numba.core.serialize import dumps
except ImportError:  # checked in _stamp_with_all_sources
    caching = dispatcher = cpu_target = dumps = None

# the folders of graphmax's kernel modules, and of the modules whose constants and functions they compile in
_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = tuple(sorted({path.parent for package in ("gm_graphs", "gm_solver")
                          for path in (_ROOT / package).rglob("*.py") if "__pycache__" not in path.parts}))
# numba's locators, in numba's order: NUMBA_CACHE_DIR, then the sources' __pycache__, then the user's cache folder
# (named with a leading underscore in older numba, e.g. 0.59)
_NUMBA_LOCATORS = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
_MAX_BYTES = 1 << 30  # a cached kernel is a few MB; a larger file is not one graphmax wrote
_LOCK = "graphmax-kernels.lock"  # in each cache folder: held while saving into it
_LOCK_WAIT_S = 10.0  # a save holds the lock for milliseconds; one held longer is not a save's: save nothing there
_unwritable: set[str] = set()  # cache folders a save failed in: this process saves nothing more there
_uncached: str | None = None  # the fall-back folder ensure_cache_dir refused: graphmax's kernels are not cached
_distrust_warned = False  # one warning per process for the cache folders that others could write
_pycache_checked = False  # ensure_cache_dir looked at the sources' __pycache__ folders
# each graphmax kernel's Python function → its sealed cache (for kernel_cached); weak: a kernel made again (tests do)
# replaces its entry, and one dropped leaves none
_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _writable(folder: Path) -> bool:
    # numba's own test (caching._CacheLocator.ensure_cache_path): create the folder, then a file in it
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


@functools.cache
def _private_group(gid: int) -> bool:
    """Whether the group ``gid`` is this user's alone: a user private group (the user's primary group, named as the
    user, with no other member), which a umask of 002 gives the folders a user creates."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return False
    return gid == os.getgid() and group.gr_name == user and set(group.gr_mem) <= {user}


def _others_may_write(st: os.stat_result, last: bool) -> str | None:
    """Why a folder of status ``st`` lets someone but this user (or root) put entries in it, or None. The folder
    holding the cache files (``last``) may not be writable by others even when sticky: a sticky folder stops
    others from removing an entry, not from adding one (a hard link to a file root owns, say)."""
    if st.st_uid not in (os.getuid(), 0):
        return f"belongs to another user (uid {st.st_uid})"
    sticky = bool(st.st_mode & stat.S_ISVTX) and not last
    if st.st_mode & 0o002 and not sticky:
        return f"every user may write it (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & 0o020 and not sticky and not _private_group(st.st_gid):
        return f"its group (gid {st.st_gid}) may write it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _distrusted(folder: str, create: bool) -> tuple[str, str] | None:
    """None when no one but this user (or root) can put a file into ``folder``: each folder from ``/`` down to it
    is owned by this user or root and not writable by others unless sticky (``/tmp`` on the way is fine, the cache
    folder itself must not be writable by others at all), and no symlink on the way could have been placed by
    another user (one that this user or root owns, in a folder others may not write unless sticky, is followed).
    Else the folder at fault and why, in a few words.

    ``create``: folders missing below the last one checked are made (mode 0755, whatever the umask adds) and then
    checked as any other; without it, a missing folder ends the walk (what is missing holds nothing). Raises
    OSError where a folder cannot be made or read, or a file stands where a folder should (not writable: numba's
    next locator is tried)."""
    path = os.path.abspath(folder)
    current, parts = "/", Path(path).parts[1:]
    st = os.lstat(current)
    why = _others_may_write(st, not parts)
    if why:
        return current, why
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        above, current = current, os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            if not create:
                return None
            with contextlib.suppress(FileExistsError):  # (made meanwhile: checked below as found)
                os.mkdir(current, 0o755)
            st = os.lstat(current)
        if stat.S_ISLNK(st.st_mode):
            parent = os.lstat(above)
            # (in a sticky folder others may add entries, never replace this user's or root's)
            if st.st_uid not in (os.getuid(), 0) or _others_may_write(parent, last=False):
                return current, "it is a symlink that another user could have made, which graphmax does not follow"
            target = os.path.realpath(current)
            found = _distrusted(target, create=False)  # where it leads, from / down, symlinks resolved
            if found:
                return found
            current = target
            st = os.lstat(current)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(20, "a file stands where a cache folder would be", current)
        why = _others_may_write(st, last)
        if why:
            return current, why
    return None


class _Distrusted(Exception):
    """A cache folder that others could write (not an OSError: numba would take it for a folder not writable and
    try the next place, where graphmax's kernels run uncached instead)."""

    def __init__(self, cache: str, folder: str, why: str):
        super().__init__(cache, folder, why)
        self.cache, self.folder, self.why = cache, folder, why


def _warn_distrusted(cache: str, folder: str, why: str) -> None:
    """The one warning per process for graphmax's kernels left uncached in a folder others could write."""
    global _distrust_warned
    if _distrust_warned:
        return
    _distrust_warned = True
    where = "" if folder == cache else f" ({folder} {why})"
    pyc = " (Python runs the .pyc files there too: make it yours alone)" \
        if os.path.basename(cache) == "__pycache__" else ""
    warnings.warn(
        f"graphmax does not cache its kernels in {cache}: "
        + (f"it {why}" if folder == cache else f"another user could write it{where}")
        + f", so another user could put code of theirs in it{pyc}; they compile anew in each process (seconds "
        f"each); set NUMBA_CACHE_DIR to a folder only you can write, or remove the write permission of others "
        f"(chmod go-w) on the way to it",
        RuntimeWarning,
        stacklevel=2,
    )


@functools.cache
def _sources_digest() -> str:
    # SHA-256 over the name and bytes of every module of gm_graphs and gm_solver: read once per process, < 1 ms
    digest = hashlib.sha256()
    for path in sorted(path for folder in _PACKAGES for path in folder.glob("*.py")):
        digest.update(f"{path.relative_to(_ROOT)}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


class _AllSourcesStamp:
    """Mixed into a numba locator: takes graphmax's kernels only, and stamps them with all of graphmax's sources."""

    @classmethod
    def from_function(cls, py_func: Callable, py_file: str) -> caching._CacheLocator | None:
        if Path(py_file).resolve().parent not in _PACKAGES:
            return None  # another library's kernel: numba's own locators take it
        try:
            return super().from_function(py_func, py_file)
        except _Distrusted as distrusted:  # never read nor written: the kernel runs uncached
            _warn_distrusted(distrusted.cache, distrusted.folder, distrusted.why)
            return _uncached_locator(py_func, py_file, distrusted.cache)

    def ensure_cache_path(self) -> None:
        # before numba makes the folder (os.makedirs would follow another user's symlink) or writes a file into it
        found = _distrusted(self.get_cache_path(), create=True)
        if found:
            raise _Distrusted(self.get_cache_path(), *found)
        super().ensure_cache_path()

    def get_source_stamp(self) -> str:
        # every cache file of the kernel is sealed with it: a file sealed with another is never loaded
        return _sources_digest()


class _NowhereWritable(_AllSourcesStamp):
    """Mixed into numba's ``NUMBA_CACHE_DIR`` locator, after graphmax's others: where no folder a kernel could be
    cached in is writable, numba refuses to decorate it (``no locator available``); this takes it instead, at
    ``NUMBA_CACHE_DIR`` (set by :func:`ensure_cache_dir` when nothing else is writable). A cache found there is
    loaded, and the first save warns that the kernels run uncached."""

    @classmethod
    def from_function(cls, py_func: Callable, py_file: str) -> caching._CacheLocator | None:
        if Path(py_file).resolve().parent not in _PACKAGES or not numba.config.CACHE_DIR:
            return None
        return cls(py_func, py_file)  # without numba's check that the folder is writable


class _Uncached(_AllSourcesStamp):
    """Mixed into numba's ``NUMBA_CACHE_DIR`` locator, last of graphmax's: where :func:`ensure_cache_dir` refused
    the fall-back folder, it takes graphmax's kernels (numba would refuse to decorate them otherwise), and
    :class:`_SealedCache` neither reads nor writes their cache."""

    def __init__(self, py_func: Callable, py_file: str, folder: str | None = None):
        # numba's locator joins NUMBA_CACHE_DIR, unset here; the refused folder stands in, for what names the path
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = folder or _uncached

    def ensure_cache_path(self) -> None:
        pass  # never written

    @classmethod
    def from_function(cls, py_func: Callable, py_file: str) -> caching._CacheLocator | None:
        if Path(py_file).resolve().parent not in _PACKAGES or _uncached is None:
            return None
        return cls(py_func, py_file)


def _uncached_locator(py_func: Callable, py_file: str, folder: str) -> caching._CacheLocator:
    """A locator that keeps a graphmax kernel uncached, naming ``folder`` (one graphmax refused)."""
    cls = next(c for c in caching.CacheImpl._locator_classes if isinstance(c, type) and issubclass(c, _Uncached))
    return cls(py_func, py_file, folder)


class _LockHeld(OSError):
    """The cache folder's lock stayed held past :data:`_LOCK_WAIT_S`."""


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
    # this user's alone (0600): another user who could open it could hold it forever; one that an older graphmax
    # made 0644, or that another process holds, is waited for a bounded time, then the save is given up
    fd = os.open(os.path.join(folder, _LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                 0o600)
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file is closed
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    held = f"another process has held {_LOCK} there for over {_LOCK_WAIT_S:g} s, where a save " \
                        f"takes milliseconds (fuser -v {os.path.join(folder, _LOCK)} names it)"
                    raise _LockHeld(held) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


class _SealedCacheFile:
    """The index and data files of one graphmax kernel (what numba's ``IndexDataCacheFile`` is for other kernels),
    each sealed with what it must hold, saved under the cache folder's lock."""

    def __init__(self, cache_path: str, filename_base: str, source_stamp: str):
        self._folder = cache_path
        self._base = filename_base
        self._identity = (numba.__version__, llvmlite.__version__, source_stamp, filename_base)

    def _path(self, name: str) -> str:
        return os.path.join(self._folder, name)

    def _read(self, name: str, identity: tuple) -> object | None:
        payload = read_sealed(self._path(name), identity, _MAX_BYTES)
        try:
            return None if payload is None else pickle.loads(payload)
        except Exception:  # sealed by a numba whose pickles this one cannot read: a miss
            return None

    def _write(self, name: str, identity: tuple, obj: object) -> None:
        write_sealed(self._path(name), identity, dumps(obj))

    def _index(self) -> dict:
        overloads = self._read(f"{self._base}.gmi", self._identity)
        return overloads if isinstance(overloads, dict) else {}

    def loadable(self, wanted: Callable[[tuple], bool]) -> list[tuple]:
        """The keys of the index that ``wanted`` accepts whose data file passes its seal (read, never unpickled)."""
        return [key for key, name in self._index().items()
                if isinstance(key, tuple) and isinstance(name, str) and wanted(key)
                and read_sealed(self._path(name), (*self._identity, repr(key)), _MAX_BYTES) is not None]

    def load(self, key: tuple) -> object | None:
        name = self._index().get(key)
        return None if name is None else self._read(name, (*self._identity, repr(key)))

    def save(self, key: tuple, data: object) -> None:
        with _locked(self._folder):
            overloads = self._index()
            name = overloads.get(key)
            if name is None:
                taken = set(overloads.values())
                name = next(n for n in (f"{self._base}.{i}.gmc" for i in range(1, len(taken) + 2)) if n not in taken)
            self._write(name, (*self._identity, repr(key)), data)
            self._write(f"{self._base}.gmi", self._identity, {**overloads, key: name})

    def flush(self) -> None:
        with _locked(self._folder):
            self._write(f"{self._base}.gmi", self._identity, {})


def _keep_reload_init(overload) -> None:
    """Give a kernel loaded from the cache the start-up steps its code needs (``reload_init``: for a parallel
    kernel, launching numba's threads) on its code library too, where a kernel compiled later that calls it
    inherits them (numba does so at link time). numba's rebuilt library has none: a caller compiled after loading
    a cached parallel callee was cached without them, and a later process that loaded the caller from the cache
    ran the callee's parallel region before any thread was launched (SIGSEGV; numba issue 8578)."""
    steps = getattr(overload, "reload_init", None)
    inherited = getattr(getattr(overload, "library", None), "_reload_init", None)
    if steps and isinstance(inherited, set):
        inherited.update(steps)


class _SealedCache:
    """Mixed into numba's ``FunctionCache``: a graphmax kernel's cache is kept in :class:`_SealedCacheFile`, any
    failure to load it is a miss, and a failure to save it a warning; other kernels keep numba's own."""

    def __init__(self, py_func: Callable):
        super().__init__(py_func)
        self._code = py_func.__code__
        locator = self._impl.locator
        self._sealed = isinstance(locator, _AllSourcesStamp)
        self._uncached = isinstance(locator, _Uncached)
        if self._sealed:
            self._cache_file = _SealedCacheFile(self._cache_path, self._impl.filename_base, locator.get_source_stamp())
            _caches[py_func] = self

    def cached_signatures(self) -> int:
        """How many signatures of this kernel a new process would load from the cache rather than compile: those
        its index holds for this machine's CPU and this kernel's code whose data file passes its seal. 0 for a
        kernel that is not cached, and for an index or data file that is missing, damaged, sealed for other
        sources, another user's or unreadable: a miss, never an error, as when the kernel is called."""
        if not self._sealed or self._uncached:
            return 0
        try:
            # numba's key: (signature, the CPU's target triple and features, the hashes of the kernel's code)
            here = self._index_key(None, cpu_target.target_context.codegen())[1:]
            return len(self._cache_file.loadable(lambda key: key[1:] == here))
        except Exception:  # whatever a damaged index holds: a miss
            return 0

    def load_overload(self, sig, target_context):
        if not self._sealed:
            return super().load_overload(sig, target_context)
        if self._uncached:
            return None
        target_context.refresh()
        try:
            overload = self._load_overload(sig, target_context)
        except Exception:  # a file that passed its seal but does not rebuild: compiled again
            return None
        _keep_reload_init(overload)
        return overload

    def save_overload(self, sig, data) -> None:
        if not self._sealed:
            return super().save_overload(sig, data)
        if self._uncached or self._cache_path in _unwritable:
            return None
        try:
            self._save_overload(sig, data)
        except OSError as error:
            self._give_up(error)
        return None

    def _give_up(self, error: OSError) -> None:
        """Save nothing more into this cache folder in this process, with one warning per process."""
        if not _unwritable:
            fix = "the kernels compile anew in each process until it can; free space there or make it writable, " \
                "or set NUMBA_CACHE_DIR to a writable folder"
            if isinstance(error, _LockHeld):
                fix = ("this process saves no kernel there; if no graphmax is compiling there, another user may "
                       "hold the lock: set NUMBA_CACHE_DIR to a folder only you can write")
            warnings.warn_explicit(  # shown at the kernel that was being saved
                f"graphmax cannot write its kernel cache in {self._cache_path} ({error.strerror or error}): {fix}",
                RuntimeWarning, self._code.co_filename, self._code.co_firstlineno,
            )
        _unwritable.add(self._cache_path)

    def flush(self) -> None:
        if self._uncached or self._cache_path in _unwritable:  # numba's recompile() empties the index: none here
            return
        try:
            super().flush()
        except OSError as error:
            self._give_up(error)


def _known_internals() -> bool:
    """Whether numba's caching is made of the parts this module extends (numba 0.59 to 0.68 at least)."""
    locators = getattr(getattr(caching, "CacheImpl", None), "_locator_classes", None)
    bases = [getattr(caching, name, None) or getattr(caching, "_" + name, None) for name in _NUMBA_LOCATORS]
    function_cache = getattr(caching, "FunctionCache", None)
    return (isinstance(locators, list) and all(hasattr(base, "get_source_stamp") for base in bases)
            and isinstance(function_cache, type) and getattr(dispatcher, "FunctionCache", None) is not None
            and all(hasattr(function_cache, name) for name in ("_load_overload", "_save_overload", "_impl_class",
                                                                "_index_key"))
            and cpu_target is not None)


def _stamp_with_all_sources() -> None:
    """Put the locators of graphmax's kernels ahead of numba's own, and its sealed files in place of numba's, once
    per process."""
    if not _known_internals():
        warnings.warn(
            f"numba {numba.__version__}'s cache locators are not the ones graphmax knows: a graphmax kernel's "
            "cache is then refreshed only when its own module changes, and kept in numba's own unlocked, unchecked "
            "files (delete the __pycache__ folders after changing the kernels, or after a crash in one)",
            RuntimeWarning,
            stacklevel=2,  # this module's line: shown once, however many modules call ensure_cache_dir
        )
        return
    locators = caching.CacheImpl._locator_classes
    if any(locator.__module__ == __name__ for locator in locators):
        return  # an earlier call
    # (NUMBA_CACHE_LOCATOR_CLASSES, where a user sets it, replaces numba's list, and these with it)
    bases = [getattr(caching, name, None) or getattr(caching, "_" + name) for name in _NUMBA_LOCATORS]
    locators[:0] = [
        type("Graphmax" + base.__name__.lstrip("_"), (_AllSourcesStamp, base), {"__module__": __name__})
        for base in bases
    ] + [type("GraphmaxUnwritableCacheLocator", (_NowhereWritable, bases[0]), {"__module__": __name__}),
         type("GraphmaxUncachedLocator", (_Uncached, bases[0]), {"__module__": __name__})]
    # every dispatcher made from now on (numba.njit(cache=True) calls Dispatcher.enable_caching) takes this class
    dispatcher.FunctionCache = type("GraphmaxFunctionCache", (_SealedCache, caching.FunctionCache),
                                    {"__module__": __name__})


def kernel_cached(kernel: Callable) -> bool | None:
    """Whether this process would load the graphmax kernel ``kernel`` from the cache at its first call rather than
    compile it: its cache holds a compiled signature for this machine (:meth:`_SealedCache.cached_signatures`).

    Read from graphmax's sealed files alone, without loading or compiling anything, and never raising: a damaged,
    foreign or unreadable cache is a miss. One signature is enough: the arrays of a stored graph have one type.

    Args:
        kernel (``Callable``): a kernel of ``gm_graphs`` or ``gm_solver`` (``numba.njit(cache=True)``).

    Returns:
        ``bool`` or ``None``: None where graphmax's cache does not keep ``kernel`` (not a graphmax kernel, numba's
        own caching where its internals are not the ones graphmax knows, ``NUMBA_DISABLE_JIT``), so that it cannot
        be told.

    Example::

        >>> kernel_cached(len) is None  # not a numba kernel of graphmax's
        True
    """
    py_func = getattr(kernel, "py_func", None)
    cache = _caches.get(py_func) if callable(py_func) else None
    return None if cache is None else cache.cached_signatures() > 0


def ensure_cache_dir() -> None:
    """Make numba's cache of graphmax's kernels follow all of their sources, and set ``numba.config.CACHE_DIR``
    to a temporary folder of this user's alone when numba has nowhere else to cache (with one warning, and no
    cache, where that folder is not this user's alone).

    Example::

        >>> ensure_cache_dir()   # a no-op here: the locators are in place, the sources' __pycache__ is writable
    """
    global _uncached, _pycache_checked
    _stamp_with_all_sources()
    if not _pycache_checked:  # Python reads the .pyc files there whatever numba does: said once, where they are
        _pycache_checked = True
        for folder in _PACKAGES:
            with contextlib.suppress(OSError):
                if found := _distrusted(str(folder / "__pycache__"), create=False):
                    _warn_distrusted(str(folder / "__pycache__"), *found)
                    break
    if numba.config.CACHE_DIR or _uncached is not None:  # NUMBA_CACHE_DIR, or an earlier call
        return
    if all(_writable(folder / "__pycache__") for folder in _PACKAGES):  # numba caches each kernel beside its module
        return
    if _writable(Path(AppDirs(appname="numba", appauthor=False).user_cache_dir)):
        return
    folder = os.path.join(tempfile.gettempdir(), f"graphmax-numba-{os.getuid()}")
    why = _not_private(folder)
    if why is None:
        numba.config.CACHE_DIR = folder
        return
    _uncached = folder
    remove = f", or remove {folder} if it is yours: graphmax then creates it for you alone" \
        if os.path.lexists(folder) else ""
    warnings.warn(
        f"graphmax does not cache its kernels in {folder}: {why}; they compile anew in each process (seconds each); "
        f"set NUMBA_CACHE_DIR to a folder only you can write{remove}",
        RuntimeWarning,
        stacklevel=2,  # the line of the first module that defines kernels; later calls return at once
    )


def _not_private(folder: str) -> str | None:
    """Create ``folder`` for this user alone (mode 0700), or check that it is so: None when it is, else why not.

    It lies in a folder that every user may write (``/tmp``): another user may have created it first, with
    kernels of theirs in it."""
    try:
        os.mkdir(folder, 0o700)  # the umask may only narrow it
    except FileExistsError:
        pass
    except OSError as error:
        return f"it cannot be created ({error.strerror})"
    try:
        st = os.lstat(folder)
    except OSError as error:
        return f"it cannot be read ({error.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink, which graphmax does not follow there"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != os.getuid():
        return f"it belongs to another user (uid {st.st_uid}), who could put code of theirs in it"
    if st.st_mode & 0o077:
        return (f"other users have permissions on it (mode {stat.S_IMODE(st.st_mode):04o}, not 0700), so another "
                f"user could have put code of theirs in it")
    return None
