"""Where numba keeps the compiled kernels (``@numba.njit(cache=True)``), and when it may reuse them.

numba caches a kernel beside its source (``__pycache__``) or, where that is read-only (an installed package),
in the user's cache folder (``~/.cache/numba``); where both are read-only (a service user without a home) it
refuses to decorate a cached kernel at all: ``RuntimeError: cannot cache function …: no locator available``.
:func:`ensure_cache_dir` then points numba at a folder under the system's temporary directory, unless the user
chose one (``NUMBA_CACHE_DIR``). Every module that defines cached kernels calls it before defining them.

numba reuses a cached kernel while the kernel's own source file is unchanged: it does not track the modules the
kernel calls into (and inlines), nor the module constants it freezes in. ``context_kernel`` calls the kernels of
``lambert_kernel``; after a merge changed ``lambert_kernel.py`` alone, ``context_kernel.reference_rows`` loaded
its old machine code, built against the old callees, and crashed the process (SIGSEGV). :func:`ensure_cache_dir`
therefore also puts locators ahead of numba's own that take graphmax's kernels only, at the same places, and
stamp them with a digest of every module of ``gm_graphs`` and ``gm_solver``: a change to any of them makes every
graphmax kernel recompile, while other libraries' kernels keep numba's own locators.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numba
from numba.misc.appdirs import AppDirs

try:
    from numba.core import caching
except ImportError:  # checked in _stamp_with_all_sources
    caching = None

# the folders of graphmax's kernel modules, and of the modules whose constants and functions they compile in
_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = tuple(sorted({path.parent for package in ("gm_graphs", "gm_solver")
                          for path in (_ROOT / package).rglob("*.py") if "__pycache__" not in path.parts}))
# numba's locators, in numba's order: NUMBA_CACHE_DIR, then the sources' __pycache__, then the user's cache folder
# (named with a leading underscore in older numba, e.g. 0.59)
_NUMBA_LOCATORS = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")


def _writable(folder: Path) -> bool:
    # numba's own test (caching._CacheLocator.ensure_cache_path): create the folder, then a file in it
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


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
        return super().from_function(py_func, py_file)

    def get_source_stamp(self) -> str:
        # numba stores this in the cache index and reuses the index's entries only while it is equal
        return _sources_digest()


def _stamp_with_all_sources() -> None:
    """Put the locators of graphmax's kernels ahead of numba's own, once per process."""
    impl = getattr(caching, "CacheImpl", None)
    locators = getattr(impl, "_locator_classes", None)
    bases = [getattr(caching, name, None) or getattr(caching, "_" + name, None) for name in _NUMBA_LOCATORS]
    if not isinstance(locators, list) or not all(hasattr(base, "get_source_stamp") for base in bases):
        warnings.warn(
            f"numba {numba.__version__}'s cache locators are not the ones graphmax knows: a graphmax kernel's "
            "cache is then refreshed only when its own module changes (delete the __pycache__ folders after "
            "changing the kernels)",
            RuntimeWarning,
            stacklevel=2,  # this module's line: shown once, however many modules call ensure_cache_dir
        )
        return
    if any(locator.__module__ == __name__ for locator in locators):
        return  # an earlier call
    # (NUMBA_CACHE_LOCATOR_CLASSES, where a user sets it, replaces numba's list, and these with it)
    locators[:0] = [
        type("Graphmax" + base.__name__.lstrip("_"), (_AllSourcesStamp, base), {"__module__": __name__})
        for base in bases
    ]


def ensure_cache_dir() -> None:
    """Make numba's cache of graphmax's kernels follow all of their sources, and set ``numba.config.CACHE_DIR``
    to a writable temporary folder when numba has nowhere else to cache.

    Example::

        >>> ensure_cache_dir()   # a no-op here: the locators are in place, the sources' __pycache__ is writable
    """
    _stamp_with_all_sources()
    if numba.config.CACHE_DIR:  # NUMBA_CACHE_DIR, or an earlier call
        return
    if all(_writable(folder / "__pycache__") for folder in _PACKAGES):  # numba caches each kernel beside its module
        return
    if _writable(Path(AppDirs(appname="numba", appauthor=False).user_cache_dir)):
        return
    numba.config.CACHE_DIR = os.path.join(tempfile.gettempdir(), f"graphmax-numba-{os.getuid()}")
