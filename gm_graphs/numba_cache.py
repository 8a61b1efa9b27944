"""Where numba keeps the compiled kernels (``@numba.njit(cache=True)``), so that importing graphmax never fails.

numba caches a kernel beside its source (``__pycache__``) or, where that is read-only (an installed package),
in the user's cache folder (``~/.cache/numba``); where both are read-only (a service user without a home) it
refuses to decorate a cached kernel at all: ``RuntimeError: cannot cache function …: no locator available``.
:func:`ensure_cache_dir` then points numba at a folder under the system's temporary directory, unless the user
chose one (``NUMBA_CACHE_DIR``). Every module that defines cached kernels calls it before defining them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numba
from numba.misc.appdirs import AppDirs


def _writable(folder: Path) -> bool:
    # numba's own test (caching._CacheLocator.ensure_cache_path): create the folder, then a file in it
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def ensure_cache_dir() -> None:
    """Set ``numba.config.CACHE_DIR`` to a writable temporary folder when numba has nowhere else to cache.

    Example::

        >>> ensure_cache_dir()   # a no-op here: the sources' __pycache__ is writable
    """
    if numba.config.CACHE_DIR:  # NUMBA_CACHE_DIR, or an earlier call
        return
    if _writable(Path(__file__).parent / "__pycache__"):
        return
    if _writable(Path(AppDirs(appname="numba", appauthor=False).user_cache_dir)):
        return
    numba.config.CACHE_DIR = os.path.join(tempfile.gettempdir(), f"graphmax-numba-{os.getuid()}")
