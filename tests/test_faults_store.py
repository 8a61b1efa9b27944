"""Faults of local state in graphmax's caches and graph folders (issue 49, part A): a kernel cache another user could
write is never read, a FIFO in place of a cache entry or a manifest hangs nothing, a full disk during an n-gram
write leaves nothing half-written, and a failed write of a cache is reported as what it is."""

from __future__ import annotations

import errno
import json
import os
import pickle
import resource
import signal
import warnings
from pathlib import Path

import numba
import numpy as np
import pytest
from numba.core import caching

from gm_graphs import build_graph, load_graph, upgrade_graph, word_tokenizer
from gm_graphs.errors import GraphFormatError, StorageError
from gm_graphs.format import validate
from gm_graphs.store import folders, kernel_cache, sealed, verified
from gm_graphs.store.sealed import seal

from .helpers import as_format_1, finishes_within, forked, write_tiny_gguf

VALUES = np.array([3.0, 2.2, 1.0])
CALLS = [(VALUES, 2), (VALUES.astype(np.int32), 2), (VALUES, 2.5)]
EXPECTED = [validate._first_below.py_func(*call) for call in CALLS]


@pytest.fixture()
def fresh_warnings(monkeypatch):
    """Each module's once-per-process warning, as a new process has it."""
    monkeypatch.setattr(kernel_cache, "_unwritable", set())
    monkeypatch.setattr(sealed, "_warned", False, raising=False)


def _messages(caught) -> list[str]:
    return [str(w.message) for w in caught]


# ---- finding 1: nothing executable read from a folder another user can write --------------------------------------

class _Payload:
    """What a planted index unpickles to: it runs ``os.mkdir(marker)``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture()
def nowhere_else(tmp_path, monkeypatch, fresh_warnings):
    """As on a read-only install with no writable home: neither the sources' __pycache__ nor numba's user cache
    folder can be written, so ensure_cache_dir falls back to ``$TMPDIR/graphmax-numba-<uid>`` (under tmp_path).
    Returns where a planted index of ``validate._first_below`` goes inside that folder, and its seal."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "probe"))
    probe = numba.njit(cache=True)(validate._first_below.py_func)._cache
    index = Path(probe._cache_path).relative_to(tmp_path / "probe") / f"{probe._impl.filename_base}.gmi"
    identity = probe._cache_file._identity

    real_ensure = caching._CacheLocator.ensure_cache_path

    def ensure_cache_path(locator):
        if not Path(locator.get_cache_path()).is_relative_to(tmp_path):
            raise PermissionError(errno.EACCES, "Permission denied", locator.get_cache_path())
        real_ensure(locator)

    monkeypatch.setattr(caching._CacheLocator, "ensure_cache_path", ensure_cache_path)
    monkeypatch.setattr(kernel_cache, "_writable", lambda folder: False)
    monkeypatch.setattr(kernel_cache, "_uncached", None, raising=False)
    monkeypatch.setattr(numba.config, "CACHE_DIR", None)
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    return tmp / f"graphmax-numba-{os.getuid()}", index, identity


def _plant(folder: Path, index: Path, identity: tuple, marker: Path, mode: int = 0o644) -> None:
    path = folder / index
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(seal(identity, pickle.dumps(_Payload(marker))))  # anyone can compute a seal
    path.chmod(mode)


def _ensure_and_run() -> tuple[list, list[str]]:
    """ensure_cache_dir() as each kernel module calls it, then the kernel as a new process has it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel_cache.ensure_cache_dir()
        kernel_cache.ensure_cache_dir()
        kernel = numba.njit(cache=True)(validate._first_below.py_func)
        answers = [int(kernel(*call)) for call in CALLS]
    return answers, _messages(caught)


def test_the_fallback_kernel_cache_folder_is_created_for_this_user_alone(nowhere_else):
    # it was created by numba's os.makedirs, 0755 under the usual umask, or whatever another user made it
    folder, index, _ = nowhere_else
    answers, messages = _ensure_and_run()
    assert answers == EXPECTED and messages == []
    assert numba.config.CACHE_DIR == str(folder) and (os.stat(folder).st_mode & 0o777) == 0o700
    assert (folder / index).is_file()  # cached there


def _other_owner(folder: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    folder.chmod(0o755)
    os.chown(folder, 65534, 65534)


FOREIGN_FOLDERS = {
    "writable by all": lambda folder: folder.chmod(0o777),
    "readable by the group": lambda folder: folder.chmod(0o750),
    "another user's": _other_owner,
}


@pytest.mark.parametrize("foreign", FOREIGN_FOLDERS)
def test_a_fallback_kernel_cache_folder_not_ours_alone_is_never_read(foreign, nowhere_else, tmp_path):
    # a planted index, sealed as anyone can seal one, was unpickled: its code ran inside `graphmax graphs info`
    folder, index, identity = nowhere_else
    marker = tmp_path / "payload-ran"
    folder.mkdir(mode=0o700)
    _plant(folder, index, identity, marker)
    FOREIGN_FOLDERS[foreign](folder)
    answers, messages = _ensure_and_run()
    assert answers == EXPECTED and not marker.exists()
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert messages[0].startswith(f"graphmax does not cache its kernels in {folder}: ")
    assert "NUMBA_CACHE_DIR" in messages[0] and numba.config.CACHE_DIR is None
    assert not any(p.name.endswith(".gmc") for p in folder.rglob("*"))  # nor written there


def test_a_symlink_in_place_of_the_fallback_kernel_cache_folder_is_refused(nowhere_else, tmp_path):
    folder, index, identity = nowhere_else
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    marker = tmp_path / "payload-ran"
    _plant(elsewhere, index, identity, marker)
    folder.symlink_to(elsewhere)
    answers, messages = _ensure_and_run()
    assert answers == EXPECTED and not marker.exists()
    assert len(messages) == 1 and "symlink" in messages[0]


def _loosen(path: Path) -> None:
    path.chmod(0o666)


def _give_away(path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, 65534, 65534)


@pytest.mark.parametrize("foreign", [_loosen, _give_away], ids=["writable by all", "another user's"])
def test_a_kernel_cache_file_another_user_could_write_is_never_unpickled(foreign, nowhere_else, tmp_path):
    # in a folder of this user's alone, a file that another user owns or may write was still unpickled
    folder, index, identity = nowhere_else
    folder.mkdir(mode=0o700)
    marker = tmp_path / "payload-ran"
    _plant(folder, index, identity, marker)
    foreign(folder / index)
    answers, messages = _ensure_and_run()
    assert answers == EXPECTED and not marker.exists()
    st = os.lstat(folder / index)  # replaced by this process's own
    assert st.st_uid == os.getuid() and not st.st_mode & 0o022


# ---- finding 13: the kernel cache on a full disk ------------------------------------------------------------------

def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_kernels_on_a_full_disk_run_uncached_with_one_warning(tmp_path, monkeypatch, fresh_warnings):
    # as in `graphmax generate` with the cache's disk full: every kernel compiles, runs, and fails to save
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_cache, "write_sealed", _full_disk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = numba.njit(cache=True)(validate._first_below.py_func)
        other = numba.njit(cache=True)(validate._first_decrease.py_func)
        answers = [int(first(*call)) for call in CALLS] + [int(other(VALUES)), int(other(VALUES[::-1].copy()))]
    assert answers == [*EXPECTED, 1, -1]
    messages = _messages(caught)
    assert len(messages) == 1 and messages[0].startswith("graphmax cannot write its kernel cache in ")
    assert "No space left on device" in messages[0] and "\n" not in messages[0]
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.suffix in (".gmi", ".gmc", ".tmp")]


# ---- finding 3: no FIFO hangs a reader ----------------------------------------------------------------------------

def test_a_fifo_in_place_of_a_kernel_index_is_a_miss_with_one_warning(tmp_path, monkeypatch, fresh_warnings):
    # read_sealed opened it blocking: every command that loaded the kernel waited for a writer, forever
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "cache"))
    probe = numba.njit(cache=True)(validate._first_below.py_func)._cache
    index = Path(probe._cache_path) / f"{probe._impl.filename_base}.gmi"
    index.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(index)

    def run():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel = numba.njit(cache=True)(validate._first_below.py_func)
            return [int(kernel(*call)) for call in CALLS], _messages(caught)

    answers, messages = finishes_within(20, run, [index])
    assert answers == EXPECTED
    assert len(messages) == 1 and f"ignores the cache entry {index}: it is not a regular file" in messages[0]
    assert index.is_file()  # the save replaced it


@pytest.fixture()
def tiny_gguf(tmp_path, monkeypatch):
    from gm_graphs.tokenize import gguf

    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(gguf, "_warned", False, raising=False)
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def test_a_fifo_in_place_of_a_tokenizer_cache_entry_is_a_miss(tiny_gguf, fresh_warnings):
    from gm_graphs import load_tokenizer
    from gm_graphs.tokenize import gguf

    entry = gguf.cache_file(gguf._identity(tiny_gguf))
    entry.parent.mkdir(parents=True)
    os.mkfifo(entry)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = finishes_within(20, lambda: load_tokenizer(tiny_gguf), [entry])
    assert tok("the")["input_ids"] and entry.is_file()
    assert [m for m in _messages(caught) if "not a regular file" in m] != []


def test_no_fifo_in_a_graph_folder_or_the_verification_cache_hangs(tmp_path, monkeypatch, home):
    # a manifest swapped for a FIFO between its check (lstat) and its read, a FIFO where a passed check is
    # remembered, and one in a folder being synced, each waited for a writer forever
    graph = tmp_path / "g"
    graph.mkdir()
    manifest = graph / folders.MANIFEST
    os.mkfifo(manifest)
    regular = tmp_path / "regular.json"
    regular.write_text(json.dumps({"format": folders.GRAPH_FORMAT}))
    real_lstat = os.lstat

    def lstat(path, *args, **kwargs):  # the check sees the file as it was a moment before
        return real_lstat(regular if os.fspath(path) == os.fspath(manifest) else path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "lstat", lstat)
        assert finishes_within(10, lambda: folders.is_graph_folder(graph), [manifest]) is False
    with pytest.raises(GraphFormatError, match="not a regular file"):
        finishes_within(10, lambda: load_graph(graph), [manifest])

    entry = Path(verified._entry("sha256", {}, []))
    entry.parent.mkdir(parents=True)
    os.mkfifo(entry)
    finishes_within(10, lambda: verified.remember("sha256", {}, []), [entry])
    assert not verified.is_verified("sha256", {}, [])

    staged = tmp_path / "staged"
    staged.mkdir()
    os.mkfifo(staged / "planted")
    finishes_within(10, lambda: folders.sync_tree(staged), [staged / "planted"])


# ---- finding 10: a full disk during an n-gram write leaves nothing half-written -----------------------------------

@pytest.fixture()
def format_1_graph(tmp_path, home) -> Path:
    """A tiny graph as format 1 stored its n-gram tables (flat contexts, indptr, next, counts)."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat\nthe dog sat\nthe cat ran\nthe dog ran\n")
    tok = word_tokenizer("the cat dog sat ran".split())
    folder = tmp_path / "g"
    build_graph(corpus, tok, path=folder, orders=(1, 2), ngrams=(3,), progress=False)
    as_format_1(folder)
    return folder


def _upgrade_on_a_full_disk(folder: Path) -> None:
    # every write of a byte fails (EFBIG, as ENOSPC would): the tables, and the marker the clean-up wrote first
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        upgrade_graph(folder)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_full_disk_during_upgrade_leaves_no_partial_tables(format_1_graph, tmp_path):
    # the clean-up wrote a marker into the folder it removed, failed on the full disk, and left ngrams-<hex>
    before = sorted(p.name for p in format_1_graph.iterdir())
    code = forked(lambda: _upgrade_on_a_full_disk(format_1_graph), None, tmp_path / "err")
    err = (tmp_path / "err").read_text()
    assert code == 1 and err.startswith("StorageError: cannot write ") and "nothing was written" in err, err
    assert sorted(p.name for p in format_1_graph.iterdir()) == before
    with pytest.raises(GraphFormatError, match="format 1"):
        load_graph(format_1_graph)
    assert upgrade_graph(format_1_graph) and sorted(load_graph(format_1_graph).ngrams) == [3]


def test_a_clean_up_that_fails_is_not_reported_as_nothing_written(format_1_graph, monkeypatch):
    from gm_graphs.build import ngram_tables

    monkeypatch.setenv("GRAPHMAX_FAULT", "upgrade.written:enospc")

    def remove_tree(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    real = ngram_tables.remove_tree
    monkeypatch.setattr(ngram_tables, "remove_tree", remove_tree)
    with pytest.raises(StorageError) as e:
        upgrade_graph(format_1_graph)
    left = [p for p in format_1_graph.iterdir() if p.name.startswith("ngrams-") and p.name != "ngrams-00000000000f"]
    assert len(left) == 1 and "nothing was written" not in str(e.value)
    assert f"the partial {left[0]} could not be removed" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.delenv("GRAPHMAX_FAULT")
    monkeypatch.setattr(ngram_tables, "remove_tree", real)
    assert upgrade_graph(format_1_graph) and not left[0].exists()  # the next write removed it


# ---- finding 11a: a failed write of the tokenizer cache is named as such ------------------------------------------

def test_a_failed_write_of_the_tokenizer_cache_is_a_warning_not_a_failed_load(tiny_gguf, monkeypatch):
    # tokenizers' Rust writer raises a plain Exception (`ulimit -f`: "File too large"), reported as "cannot load the
    # tokenizer"
    from transformers import PreTrainedTokenizerFast

    from gm_graphs import load_tokenizer

    def save(*args, **kwargs):
        raise Exception("File too large (os error 27)")

    monkeypatch.setattr(PreTrainedTokenizerFast, "_save_pretrained", save)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = load_tokenizer(tiny_gguf)
        load_tokenizer(tiny_gguf)
    assert tok("the")["input_ids"]
    messages = [m for m in _messages(caught) if "tokenizer" in m]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert messages[0].startswith(f"graphmax cannot cache the tokenizer of {tiny_gguf}: writing in ")
    assert "File too large" in messages[0] and "TMPDIR" in messages[0]


def test_a_full_cache_disk_for_the_tokenizer_is_one_warning_naming_the_cache(tiny_gguf, monkeypatch):
    from gm_graphs import load_tokenizer
    from gm_graphs.tokenize import gguf

    monkeypatch.setattr(gguf, "write_sealed", _full_disk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_tokenizer(tiny_gguf)
    messages = [m for m in _messages(caught) if "tokenizer" in m]
    assert len(messages) == 1 and "No space left on device" in messages[0]
    assert str(gguf.cache_file(gguf._identity(tiny_gguf)).parent) in messages[0] and "GRAPHMAX_HOME" in messages[0]
