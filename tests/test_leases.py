"""Mapped graph files under read leases (gm_graphs.store.leases): another program that rewrites a file in place while
a decoder has it mapped (``cp`` over it, a truncation) ends the decoder's next step in one GraphBusyError line, never
SIGBUS; a graph left alone decodes as before; where no lease is granted the file is read into memory instead."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gm_graphs import build_graph, load_graph, word_tokenizer
from gm_graphs.errors import GraphBusyError
from gm_graphs.store import reader
from gm_solver import ContextGraphmaxLogitsProcessor, PaperGraphmaxLogitsProcessor

from .helpers import fork_child


def _leases_granted() -> bool:
    """Whether this kernel and the temporary folder's file system grant a read lease (Linux's; not NFS)."""
    import fcntl
    import tempfile

    if not sys.platform.startswith("linux"):
        return False
    fd, name = tempfile.mkstemp()
    os.close(fd)  # a descriptor open for writing, even this process' own, refuses a read lease
    try:
        with open(name, "rb") as reading:
            try:
                fcntl.fcntl(reading.fileno(), fcntl.F_SETLEASE, fcntl.F_RDLCK)
            except OSError:
                return False
            fcntl.fcntl(reading.fileno(), fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    finally:
        os.unlink(name)


pytestmark = pytest.mark.skipif(not _leases_granted(), reason="no file leases here (Linux's, on a local file system)")

DATA = "counts/shard-00000/data.npy"  # the bigram counts every step of the context decoder reads
REWRITTEN = "GraphBusyError: graph .* was rewritten in place while this process had it loaded: another program " \
            "opened counts/shard-00000/data.npy for writing .*; load it again once it is whole \\(load_graph\\) " \
            "and make the decoder anew from it; replace a graph's files only by renaming"


def two_graphs(tmp_path: Path) -> tuple[Path, Path]:
    """Two small graphs of different counts: one to rewrite in place, one to leave alone."""
    tok = word_tokenizer("the cat dog sat ran".split())
    paths = []
    for name, text in (("a", "the cat sat\nthe dog sat\nthe cat ran\n"), ("b", "the dog ran\n")):
        (tmp_path / f"{name}.txt").write_text(text * 20)
        paths.append(build_graph(tmp_path / f"{name}.txt", tok, path=tmp_path / name, progress=False).path)
    return paths[0], paths[1]


def decode(proc) -> torch.Tensor:
    return proc(torch.tensor([[1, 2]]), torch.zeros(1, proc.reference.n))


def decode_across(paths: list[Path], rewrite, stderr: Path) -> int:
    """Fork a child that loads ``paths`` and decodes a step with each, then waits while ``rewrite()`` runs in this
    process, then decodes again: the graphs after the first as before, then the first. The child's exit code: 0 each
    decoded as before, 1 a GraphmaxError (on its stderr), 3 another exception, −7 SIGBUS."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()

    def run():
        procs = [ContextGraphmaxLogitsProcessor(load_graph(p), lam=2.0) for p in paths]
        before = [decode(p) for p in procs]
        os.write(ready_w, b"1")
        os.read(go_r, 1)
        for proc, logp in [*zip(procs[1:], before[1:]), (procs[0], before[0])]:
            assert torch.equal(decode(proc), logp)

    pid = fork_child(run, stderr=stderr)
    os.close(ready_w)
    os.close(go_r)
    try:
        if os.read(ready_r, 1) == b"1":  # (the child died before it was ready: its exit code tells)
            rewrite()
            os.write(go_w, b"1")
    finally:
        os.close(ready_r)
        os.close(go_w)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.parametrize("how", ["truncate", "cp"])
def test_a_graph_file_rewritten_in_place_while_decoding_is_one_line_not_sigbus(home, tmp_path, how):
    a, b = two_graphs(tmp_path)
    if how == "truncate":
        def rewrite():
            with open(a / DATA, "r+b") as fh:  # held in open() until the decoder's process has let go
                fh.truncate(0)
    else:
        def rewrite():  # another graph's counts copied over these
            subprocess.run(["cp", str(b / DATA), str(a / DATA)], check=True, timeout=30)
    code = decode_across([a, b], rewrite, tmp_path / "stderr")
    err = (tmp_path / "stderr").read_text()
    assert code == 1, f"exit code {code} (-7: SIGBUS); stderr: {err}"
    assert len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(REWRITTEN + r"[^\n]*\n", err), err


def test_a_forked_child_holds_leases_of_its_own(home, tmp_path):
    # the parent's decoder maps the file too; its own truncation is held until both processes have let go
    a, b = two_graphs(tmp_path)
    proc = ContextGraphmaxLogitsProcessor(load_graph(a), lam=2.0)
    decode(proc)

    def rewrite():
        os.truncate(a / DATA, 0)

    code = decode_across([a, b], rewrite, tmp_path / "stderr")
    assert code == 1, (tmp_path / "stderr").read_text()
    with pytest.raises(GraphBusyError, match="was rewritten in place"):
        decode(proc)
    with pytest.raises(GraphBusyError, match="was rewritten in place"):  # again: it stays refused
        proc.reference(torch.tensor([[1, 2]]))


def test_the_paper_decoder_raises_as_well(home, tmp_path):
    # a rewrite by a thread of this very process is held likewise (its open() lets the watcher thread run)
    a, _ = two_graphs(tmp_path)
    proc = PaperGraphmaxLogitsProcessor(load_graph(a), lam=2.0)
    scores = torch.zeros(1, proc.operator.n)
    proc(None, scores)
    os.truncate(a / "order1/shard-00000/data.npy", 0)
    with pytest.raises(GraphBusyError, match="another program opened order1/shard-00000/data.npy for writing"):
        proc(None, scores)


def test_a_file_that_cannot_be_leased_is_read_into_memory_and_a_rewrite_changes_nothing(home, tmp_path):
    # a file open for writing elsewhere cannot be leased (as one of another user, or on a file system without leases)
    a, b = two_graphs(tmp_path)
    with open(a / DATA, "r+b") as writer:
        graph = load_graph(a)
        assert not isinstance(graph.counts.data, np.memmap) and isinstance(graph.counts.indptr, np.memmap)
        del graph
        code = decode_across([a, b], lambda: writer.truncate(0), tmp_path / "stderr")
    assert code == 0, (tmp_path / "stderr").read_text()


def test_a_file_too_large_to_read_in_is_mapped_unprotected_with_one_warning(home, tmp_path, monkeypatch):
    a, _ = two_graphs(tmp_path)
    monkeypatch.setattr(reader, "available_memory", lambda: 100)  # a quarter: 25 bytes, less than the file
    monkeypatch.setattr(reader, "_warned", False)
    with open(a / DATA, "r+b"):
        with pytest.warns(UserWarning, match=r"counts/shard-00000/data.npy is memory-mapped without protection "
                                             r"\(another process has it open for writing, and it is too large to "
                                             r"read in\): a program that rewrites it in "
                                             r"place .* will crash this process \(SIGBUS\); own the files"):
            counts = load_graph(a).counts
    assert isinstance(counts.data, np.memmap)


def test_a_lease_is_given_back_when_its_array_goes(tmp_path):
    from gm_graphs.store import leases  # (here, so that the tests above also run where it is missing: on main)

    path = tmp_path / "a.bin"
    path.write_bytes(np.arange(4, dtype="<i8").tobytes())
    with open(path, "rb") as fh:
        values, lease = leases.map_leased(fh, "a.bin", np.dtype("<i8"), 0, 4)
    assert lease.held
    del values
    assert not lease.held and not lease.revoked
    with open(path, "r+b") as fh:  # not held up: no lease is left
        fh.truncate(0)
