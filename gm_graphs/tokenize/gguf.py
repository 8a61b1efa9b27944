"""The tokenizer inside a GGUF file, converted once and kept in a sealed cache file.

transformers rebuilds a GGUF file's tokenizer on every load by reading all of the file's metadata: 5.7 s for the
bundled SmolLM2 in a fresh process, against 1.3 s from the files it converts to (``benchmarks/model_load.py``). Every
command that loads the model or its tokenizer paid it, and so did every Ray worker of a build. The converted files
are kept in ``$GRAPHMAX_HOME/tokenizers/<key>.gmt``, one sealed file (:mod:`gm_graphs.store.sealed`) per GGUF
file, its key and seal naming the GGUF file's identity (real path, device, inode, size, mtime and ctime in ns)
and the versions of transformers and tokenizers. A GGUF file replaced or touched gets a new entry; a damaged or
foreign entry is a miss, converted again and replaced; a cache that cannot be written (a full disk, a file-size
limit, a read-only home) means the next load converts again, with one warning per process that names the failure
and where it happened. A cached tokenizer is loaded from a private copy of the sealed bytes, so nothing written into
the cache folder after the check is read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path

from gm_graphs.store.folders import graphmax_home
from gm_graphs.store.sealed import read_sealed, write_sealed

SUFFIX = ".gmt"
_MAX_BYTES = 256 << 20  # a tokenizer's files: a few MB for a 50k vocabulary, tens for the largest
_MAX_FILES = 16


@functools.cache
def _plain_reader():
    """gguf's reader over a plain ndarray view of its memory map: the same bytes, but each of the ~250,000 slices
    its parser takes (two per token of a 49,152-token vocabulary) skips numpy.memmap's Python-level hooks."""
    import gguf
    import numpy as np

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

    return PlainReader


_read_once = threading.RLock()  # the patch is the gguf module's, seen by every thread: one block at a time


@contextlib.contextmanager
def read_once():
    """A block in which transformers reads GGUF files with gguf's reader made once per file (it makes one for the
    config, one for the tokenizer and one for the weights), over a plain view of its memory map, and gguf's
    tensor-name map made once instead of once per submodule (397 times for SmolLM2): the same values, only not
    rebuilt. In a block already (this thread's), nothing more is done; another thread's block waits for this one
    to end. SmolLM2's model and tokenizer, two cores: ``benchmarks/model_load.py``."""
    import gguf

    with _read_once:
        if getattr(gguf.GGUFReader, "graphmax_read_once", False):
            yield
            return
        real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader = functools.cache(_plain_reader())
        gguf.GGUFReader.graphmax_read_once = True
        gguf.get_tensor_name_map = functools.cache(real_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _identity(path: Path) -> tuple:
    import tokenizers
    import transformers

    real = os.path.realpath(path)
    st = os.stat(real)
    return ("gguf-tokenizer", transformers.__version__, tokenizers.__version__, real, st.st_dev, st.st_ino,
            st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def cache_file(identity: tuple) -> Path:
    """Where the tokenizer of the GGUF file of ``identity`` is cached."""
    return graphmax_home() / "tokenizers" / (hashlib.sha256(repr(identity).encode()).hexdigest()[:32] + SUFFIX)


def _from_files(files: dict[str, str]):
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="graphmax-tokenizer-") as folder:
        for name, text in files.items():
            Path(folder, name).write_text(text, encoding="utf-8")
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _cached(identity: tuple):
    payload = read_sealed(cache_file(identity), identity, _MAX_BYTES)
    if payload is None:
        return None
    try:
        files = json.loads(payload.decode("utf-8"))
        if not (isinstance(files, dict) and 0 < len(files) <= _MAX_FILES
                and all(isinstance(k, str) and os.path.basename(k) == k and k not in ("", ".", "..")
                        and isinstance(v, str) for k, v in files.items())):
            return None
        return _from_files(files)
    except Exception:  # a sealed entry that does not load (another transformers wrote it): converted again
        return None


class _SaveFailed(Exception):
    """A save of the cache failed: ``where`` (a folder) could not be written, for ``why``."""

    def __init__(self, where: str, why: str, fix: str):
        super().__init__(why)
        self.where, self.why, self.fix = where, why, fix


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _save(tok, identity: tuple) -> None:
    """Write the converted tokenizer into its cache entry; raises :class:`_SaveFailed`."""
    temporary = tempfile.gettempdir()
    try:
        with tempfile.TemporaryDirectory(prefix="graphmax-tokenizer-") as folder:
            tok.save_pretrained(folder)
            files = {p.name: p.read_text(encoding="utf-8") for p in sorted(Path(folder).iterdir()) if p.is_file()}
    except Exception as error:  # tokenizers' Rust writer raises a plain Exception for a failed write (EFBIG, ENOSPC)
        raise _SaveFailed(temporary, _reason(error), "free space there, or set TMPDIR to a folder with room") \
            from error
    target = cache_file(identity)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_sealed(target, identity, json.dumps(files, ensure_ascii=False).encode("utf-8"))
    except (OSError, UnicodeError) as error:
        raise _SaveFailed(str(target.parent), _reason(error),
                          "free space there or make it writable, or set GRAPHMAX_HOME to a writable folder") \
            from error


_warned = False  # a save that failed once fails again: one warning per process


def load_gguf_tokenizer(path: Path):
    """The tokenizer in the GGUF file ``path``, from the cache when it holds this file's; converted and cached
    otherwise. Raises what transformers raises for a file it cannot read.

    Example::

        >>> from gm_graphs import bundled
        >>> tok = load_gguf_tokenizer(bundled.smollm2_gguf())
        >>> len(tok), tok.eos_token
        (49152, '<|im_end|>')
    """
    global _warned
    path = Path(path)
    identity = _identity(path)
    tok = _cached(identity)
    if tok is None:
        from transformers import AutoTokenizer

        with read_once():
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        try:
            _save(tok, identity)
        except _SaveFailed as failed:  # the tokenizer is loaded all the same: only the cache is missing
            if not _warned:
                _warned = True
                warnings.warn(f"graphmax cannot cache the tokenizer of {path}: writing in {failed.where} failed "
                              f"({failed.why}); it is converted again at each load (seconds) until it can be; "
                              f"{failed.fix}", RuntimeWarning, stacklevel=2)
    tok.name_or_path = str(path)
    return tok
