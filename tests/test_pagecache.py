"""Files written through the page cache without growing it (``gm_graphs.store.pagecache``): the same bytes whatever the
chunking, pages gone once written, write-back errors raised, and a whole build unchanged."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gm_graphs import build_graph
from gm_graphs.count.runs import SortedRuns
from gm_graphs.format.graph_files import file_entries, sha256_file
from gm_graphs.format.writer import NpyWriter
from gm_graphs.store import pagecache
from gm_graphs.store.pagecache import DropBehind

from .helpers import make_docs

needs_sync_file_range = pytest.mark.skipif(pagecache._sync_range is None, reason="needs Linux's sync_file_range")


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(pagecache, "CHUNK", 1 << 16)


def _resident(path: Path) -> int:
    """Pages of ``path`` in the page cache, by ``mincore`` over a mapping that touches none of them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with open(path, "rb") as fh:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fh.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    return sum(v & 1 for v in vec)


@settings(max_examples=40, deadline=None)
@given(pieces=st.lists(st.integers(0, 5000), max_size=12), chunk=st.sampled_from([4096, 8192, 12288]),
       head=st.integers(0, 300))
def test_the_file_holds_the_bytes_written_whatever_the_pieces_and_the_chunk(pieces, chunk, head):
    rng = np.random.default_rng(len(pieces) * 7919 + chunk + head)
    data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in pieces]
    old, pagecache.CHUNK = pagecache.CHUNK, chunk
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "f.bin"
            with open(path, "wb") as fh:
                fh.write(b"h" * head)  # a file already written up to here when it is handed over
                out = DropBehind(fh)
                for piece in data:
                    out.write(piece)
                out.finish()
            assert path.read_bytes() == b"h" * head + b"".join(data)
    finally:
        pagecache.CHUNK = old


def test_an_npy_file_written_in_chunks_loads_as_the_pieces_appended(tmp_path, small_chunks):
    rng = np.random.default_rng(0)
    pieces = [rng.integers(-2**40, 2**40, n) for n in (1, 30_000, 0, 9_000, 17)]
    w = NpyWriter(tmp_path, "a.npy", np.int64, None)
    for p in pieces:
        w.append(p)
    w.close()
    assert np.array_equal(np.load(tmp_path / "a.npy"), np.concatenate(pieces))


@needs_sync_file_range
def test_written_pages_leave_the_cache_as_the_file_grows(tmp_path, monkeypatch):
    chunk = 1 << 20
    monkeypatch.setattr(pagecache, "CHUNK", chunk)
    block = np.random.default_rng(1).integers(0, 256, chunk, dtype=np.uint8)
    chunk_pages = chunk // mmap.PAGESIZE
    control = tmp_path / "control.bin"  # written back with sync_file_range and dropped by hand
    with open(control, "wb") as fh:
        for _ in range(4):
            fh.write(block)
        fh.flush()
        pagecache._sync_range(fh.fileno(), 0, 0, 7)  # wait before, write, wait after: the whole file
        pagecache.drop(fh.fileno(), 0, 0)
    if _resident(control) > chunk_pages // 8:  # e.g. tmpfs, or overlayfs, whose mapping sync_file_range misses
        pytest.skip("this file system keeps written pages in memory whatever it is told")
    path = tmp_path / "big.bin"
    with open(path, "wb") as fh:
        out = DropBehind(fh)
        peak = 0
        for _ in range(12):
            out.write(block)
            peak = max(peak, _resident(path))
        out.finish()
    assert path.stat().st_size == 12 * chunk
    assert peak <= 2 * chunk_pages + 2  # the chunk being written back and the one before it, at most
    assert _resident(path) <= 2  # finished: nothing left but what a partial page may keep


@pytest.mark.parametrize("code, raised", [(errno.EIO, True), (errno.ENOSPC, True), (errno.ENOSYS, False),
                                          (errno.EINVAL, False)])
def test_a_failed_write_back_is_raised_and_an_unsupported_one_only_stops_dropping(tmp_path, monkeypatch,
                                                                                   small_chunks, code, raised):
    calls = []

    def failing(fd, offset, length, flags):
        calls.append(flags)
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(pagecache, "_sync_range", failing)
    data = bytes(range(256)) * 1024  # 4 chunks
    path = tmp_path / "f.bin"
    with open(path, "wb") as fh:
        out = DropBehind(fh)
        if raised:
            with pytest.raises(OSError) as e:
                out.write(data)
            assert e.value.errno == code and str(path) in str(e.value)
            return
        out.write(data)
        out.write(data)
        out.finish()
    assert len(calls) == 1  # tried once, then written as if the kernel had no sync_file_range
    assert path.read_bytes() == data + data


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), run_entries=st.integers(50, 2000))
def test_runs_written_and_read_with_dropped_pages_count_what_runs_in_memory_count(seed, run_entries):
    rng = np.random.default_rng(seed)
    ids = rng.zipf(1.3, 6000).clip(max=300).astype(np.int32) - 1
    offsets = np.array([0, 2500, 2501, 6000])
    old, pagecache.CHUNK = pagecache.CHUNK, 4096
    try:
        with tempfile.TemporaryDirectory() as tmp:
            on_disk = SortedRuns(3, 300, run_entries, folder=Path(tmp))
            on_disk.add(ids, offsets)
            keys, counts = on_disk.merged()
    finally:
        pagecache.CHUNK = old
    in_memory = SortedRuns(3, 300, run_entries)
    in_memory.add(ids, offsets)
    keys2, counts2 = in_memory.merged()
    assert np.array_equal(keys, keys2) and np.array_equal(counts, counts2)
    assert counts.sum() == 2500 - 2 + 0 + 3499 - 2


def test_a_build_written_in_small_chunks_is_the_same_graph_to_the_byte(tmp_path, bpe_tokenizer, monkeypatch):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(make_docs(300, seed=5)) + "\n")
    hashes = []
    for name, chunk in (("default", pagecache.CHUNK), ("small", 4096)):
        monkeypatch.setattr(pagecache, "CHUNK", chunk)
        g = build_graph(str(corpus), bpe_tokenizer, path=tmp_path / name, orders=(1, 2), ngrams=(3, 4),
                        ngram_run_entries=500, progress=False)
        files = {e["file"]: e["sha256"] for e in file_entries(g.manifest)}
        assert all(sha256_file(tmp_path / name / f) == h for f, h in files.items())
        hashes.append(files)
    assert hashes[0] == hashes[1] and len(hashes[0]) > 10

