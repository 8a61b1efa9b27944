"""The kNN datastore's folder (gm_graphs.format.datastore_files): a round trip, atomic writes under kills, a folder
graphmax did not write left alone, and hostile folders (arrays, index, marginals) refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import gm_graphs.format.datastore_files
import gm_solver.datastore as dsmod
from gm_graphs.errors import DatastoreError, GraphExistsError, NotOwnedError
from gm_graphs.format.datastore_files import (
    DATASTORE_MARKER,
    KEYS,
    MARGINALS,
    META,
    VALUES,
    open_datastore,
    write_datastore,
)
from gm_solver import Datastore

from .helpers import (
    REPO,
    forked,
    indexed_store,
    random_keys,
    random_marginals,
    resign,
    rewrite_meta,
    tokenizer_record,
    write_store,
)

# ---- the folder ---------------------------------------------------------------------------------------------------

@given(n=st.integers(1, 300), dim=st.integers(1, 40), chunks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_a_datastore_reads_back_what_was_written_in_float16(tmp_path_factory, n, dim, chunks, seed):
    rng = np.random.default_rng(seed)
    keys, values = rng.normal(scale=30, size=(n, dim)), rng.integers(0, 1000, n)
    cuts = np.sort(rng.integers(0, n + 1, chunks - 1))
    pieces = list(zip(np.split(keys, cuts), np.split(values, cuts)))
    path = tmp_path_factory.mktemp("ds") / "ds"
    write_datastore(path, pieces, dim=dim, tokenizer=tokenizer_record(1000), model="m", model_sha256="cd" * 32,
                    positions=3, documents=2)
    store = open_datastore(path)
    assert np.array_equal(store.keys, keys.astype(np.float16)) and np.array_equal(store.values, values)
    assert store.meta["keys"] == n and store.meta["dim"] == dim and store.meta["documents"] == 2


def _npy(path: Path, array: np.ndarray) -> None:
    np.save(path, array)


def _raw_npy(path: Path, header: str, version: int = 1) -> None:
    """A .npy file of any header at all (numpy would refuse to write most of these)."""
    import struct

    h = header.encode("latin1") + b"\n"
    path.write_bytes(b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<H" if version == 1 else "<I", len(h)) + h)


HOSTILE = {
    "no marker": lambda p: os.unlink(p / DATASTORE_MARKER),
    "meta not json": lambda p: (p / META).write_text("{nope"),
    "meta a list": lambda p: (p / META).write_text("[1, 2]"),
    "meta huge": lambda p: (p / META).write_text(" " * (2 << 20)),
    "other format": lambda p: rewrite_meta(p, format="something"),
    "other version": lambda p: rewrite_meta(p, version=99),
    "negative keys": lambda p: rewrite_meta(p, keys=-3),
    "keys a string": lambda p: rewrite_meta(p, keys="40"),
    "dim zero": lambda p: rewrite_meta(p, dim=0),
    "no file records": lambda p: rewrite_meta(p, files={}),
    "keys missing": lambda p: os.unlink(p / KEYS),
    "the folder a symlink": lambda p: (os.rename(p, p.with_name("real")), os.symlink(p.with_name("real"), p)),
    "keys a symlink": lambda p: (os.rename(p / KEYS, p / "elsewhere.npy"), os.symlink("elsewhere.npy", p / KEYS)),
    "keys a folder": lambda p: (os.unlink(p / KEYS), os.mkdir(p / KEYS)),
    "keys truncated": lambda p: os.truncate(p / KEYS, 100),
    "keys flipped": lambda p: (p / KEYS).write_bytes((p / KEYS).read_bytes()[:-1] + b"\x01"),
    "keys not npy": lambda p: ((p / KEYS).write_bytes(b"x" * 608), resign(p, KEYS)),
    "keys float32": lambda p: (_npy(p / KEYS, np.zeros(40 * 6, np.float32)), resign(p, KEYS)),
    "keys 2-d": lambda p: (_npy(p / KEYS, np.zeros((40, 6), np.float16)), resign(p, KEYS)),
    "keys too few": lambda p: (_npy(p / KEYS, np.zeros(40 * 5, np.float16)), resign(p, KEYS)),
    "keys nan": lambda p: (_npy(p / KEYS, np.full(40 * 6, np.nan, np.float16)), resign(p, KEYS)),
    "keys pickled objects": lambda p: (np.save(p / KEYS, np.array([{}] * 240, dtype=object), allow_pickle=True),
                                       resign(p, KEYS)),
    # headers that make numpy's own parser raise what no caller expects, or read 4 GiB before it checks the size
    "keys header unclosed": lambda p: (_raw_npy(p / KEYS, "{"), resign(p, KEYS)),
    "keys header nested": lambda p: (_raw_npy(p / KEYS, "-" * 9000 + "1"), resign(p, KEYS)),
    "keys header huge shape": lambda p: (_raw_npy(p / KEYS, "{'descr': '<f2', 'fortran_order': False, 'shape': (0x"
                                                          + "f" * 3600 + ",), }"), resign(p, KEYS)),
    "keys header 4 GiB": lambda p: ((p / KEYS).write_bytes(b"\x93NUMPY\x02\x00\xff\xff\xff\xff"), resign(p, KEYS)),
    "keys a fifo": lambda p: (os.unlink(p / KEYS), os.mkfifo(p / KEYS)),
    "values out of range": lambda p: (_npy(p / VALUES, np.full(40, 50, np.int32)), resign(p, VALUES)),
    "values negative": lambda p: (_npy(p / VALUES, np.full(40, -1, np.int32)), resign(p, VALUES)),
    "values int64": lambda p: (_npy(p / VALUES, np.zeros(40, np.int64)), resign(p, VALUES)),
    "values big-endian": lambda p: (_npy(p / VALUES, np.zeros(40, ">i4")), resign(p, VALUES)),
}


@pytest.mark.parametrize("damage", sorted(HOSTILE))
def test_a_hostile_datastore_folder_is_one_line_error(tmp_path, damage):
    path = write_store(tmp_path / "ds", *random_keys(np.random.default_rng(0)))
    HOSTILE[damage](path)
    with pytest.raises(DatastoreError) as err:
        dsmod.load_datastore(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message, message


@pytest.mark.parametrize("version,got", [("2", "got '2' (a str)"), (2.0, "got 2.0 (a float)"),
                                         (True, "got True (a bool)"), (None, "but it is missing (or null)")])
def test_a_datastore_version_that_is_not_an_integer_is_named_as_such(tmp_path, version, got):
    path = write_store(tmp_path / "ds", *random_keys(np.random.default_rng(0)))
    rewrite_meta(path, version=version)
    with pytest.raises(DatastoreError) as err:
        dsmod.load_datastore(path)
    assert f"datastore {path}: meta.json field version should be an integer, {got}; this graphmax reads version 2; " \
           f"write it again" in str(err.value)


def test_a_datastore_larger_than_the_memory_left_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = write_store(tmp_path / "ds", *random_keys(np.random.default_rng(0)))
    monkeypatch.setattr(gm_graphs.store.reader, "available_memory", lambda: 100)  # keys.npy holds 608 bytes
    with pytest.raises(DatastoreError, match=r"keys.npy needs 0.00 GB of memory to load, and 0.00 GB is available"):
        dsmod.load_datastore(path)
    monkeypatch.setattr(gm_graphs.store.reader, "available_memory", lambda: None)  # unknown: read it
    assert len(dsmod.load_datastore(path)) == 40


def test_a_file_a_user_put_into_a_datastore_is_never_deleted(tmp_path):
    path = write_store(tmp_path / "ds", *random_keys(np.random.default_rng(0)))
    (path / "LICENSE").write_text("the user's")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    for replace in (lambda: dsmod.index_datastore(path, 4),
                    lambda: write_store(path, *random_keys(np.random.default_rng(1)), overwrite=True)):
        with pytest.raises(NotOwnedError, match="holds 'LICENSE', which graphmax did not write.*move it out"):
            replace()
        assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    (path / "LICENSE").unlink()
    assert dsmod.index_datastore(path, 4).approximate


def test_a_datastore_is_never_written_over_a_folder_graphmax_did_not_write(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(NotOwnedError):
        write_store(mine, *random_keys(np.random.default_rng(0)), overwrite=True)
    assert (mine / "notes.txt").read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["mine"]
    path = write_store(tmp_path / "ds", *random_keys(np.random.default_rng(0)))
    with pytest.raises(GraphExistsError):
        write_store(path, *random_keys(np.random.default_rng(1)))
    keys, values = random_keys(np.random.default_rng(1))
    write_store(path, keys, values, overwrite=True)
    assert np.array_equal(open_datastore(path).values, values)


@pytest.mark.parametrize("bad", ["nan key", "token beyond", "negative token", "wrong width", "no keys"])
def test_bad_chunks_leave_the_old_datastore_and_nothing_else(tmp_path, bad):
    keys, values = random_keys(np.random.default_rng(0))
    path = write_store(tmp_path / "ds", keys, values)
    k2, v2 = random_keys(np.random.default_rng(1))
    if bad == "nan key":
        k2[3, 2] = np.nan
    elif bad == "token beyond":
        v2[5] = 50
    elif bad == "negative token":
        v2[5] = -1
    elif bad == "wrong width":
        k2 = k2[:, :5]
    else:
        k2, v2 = k2[:0], v2[:0]
    with pytest.raises(DatastoreError) as err:
        write_datastore(path, [(keys, values), (k2, v2)] if bad != "no keys" else [(k2, v2)], dim=6,
                        tokenizer=tokenizer_record(50), model="m", model_sha256="cd" * 32, positions=8, documents=1,
                        overwrite=True)
    assert "\n" not in str(err.value)
    assert np.array_equal(open_datastore(path).values, values) and sorted(os.listdir(tmp_path)) == ["ds"]


def _run_writer(path: Path, seed: int, env: dict[str, str]) -> int:
    """Write a datastore of ``documents=seed`` in a forked child with ``env``: its exit code."""
    rng = np.random.default_rng(seed)
    chunks = [(rng.normal(size=(30, 6)), rng.integers(0, 50, 30)) for _ in range(3)]
    return forked(lambda: write_datastore(path, chunks, dim=6, tokenizer=tokenizer_record(50), model="m",
                                          model_sha256="cd" * 32, positions=8, documents=seed, overwrite=True), env)


def test_a_kill_at_any_point_of_a_datastore_write_leaves_the_old_one_or_the_new_one(tmp_path):
    path = tmp_path / "ds"
    assert _run_writer(path, 1, {}) == 0
    log = tmp_path / "points"
    assert _run_writer(path, 2, {"GRAPHMAX_FAULT_LOG": str(log)}) == 0
    points = list(dict.fromkeys(log.read_text().split()))
    assert {"stage.created", "datastore.chunk", "datastore.written", "stage.filled", "stage.unmarked"} <= set(points)
    before = 2
    for seed, point in enumerate(points, start=10):
        assert _run_writer(path, seed, {"GRAPHMAX_FAULT": point}) == 137, point
        docs = open_datastore(path).meta["documents"]
        assert docs in (before, seed), point
        before = docs
    assert _run_writer(path, 99, {}) == 0  # the next writer removes the debris of the killed ones
    assert open_datastore(path).meta["documents"] == 99 and sorted(os.listdir(tmp_path)) == ["ds", "points"]


def test_a_file_truncated_after_it_was_checked_changes_nothing(tmp_path):
    keys, values = random_keys(np.random.default_rng(0))
    path = write_store(tmp_path / "ds", keys, values)
    arrays = open_datastore(path)
    os.truncate(path / KEYS, 0)  # a memory map would now fault the process on its next read
    assert np.array_equal(arrays.keys, keys.astype(np.float16))


@pytest.mark.parametrize("bad", [dict(dim=70000), dict(tokenizer={"vocab_size": 2**31, "vocab_sha256": "ab" * 32}),
                                 dict(tokenizer={"vocab_size": True, "vocab_sha256": "ab" * 32}),
                                 dict(model_sha256="x"), dict(positions="x"), dict(values=np.array([0.5] * 40))])
def test_the_writer_refuses_what_the_reader_would(tmp_path, bad):
    keys, values = random_keys(np.random.default_rng(0))
    kw = dict(dim=6, tokenizer=tokenizer_record(50), model="m", model_sha256="cd" * 32, positions=8, documents=1)
    values = bad.pop("values", values)
    kw.update(bad)
    with pytest.raises(DatastoreError):
        write_datastore(tmp_path / "ds", [(keys, values)], **kw)
    assert os.listdir(tmp_path) == []


# ---- the inverted-file index ---------------------------------------------------------------------------------------

IVF_HOSTILE = {
    "lists zero": lambda p: rewrite_meta(p, ivf_lists=0),
    "lists a string": lambda p: rewrite_meta(p, ivf_lists="4"),
    "lists without files": lambda p: rewrite_meta(p, files={k: v for k, v in json.loads((p / META).read_text())[
        "files"].items() if k != "ivf_lists.npy"}),
    "offsets short": lambda p: (_npy(p / "ivf_lists.npy", np.array([0, 10, 20, 40], np.int64)),
                                resign(p, "ivf_lists.npy")),
    "offsets past the keys": lambda p: (_npy(p / "ivf_lists.npy", np.array([0, 10, 20, 30, 41], np.int64)),
                                        resign(p, "ivf_lists.npy")),
    "offsets decreasing": lambda p: (_npy(p / "ivf_lists.npy", np.array([0, 30, 20, 35, 40], np.int64)),
                                     resign(p, "ivf_lists.npy")),
    "offsets from 1": lambda p: (_npy(p / "ivf_lists.npy", np.array([1, 10, 20, 30, 40], np.int64)),
                                 resign(p, "ivf_lists.npy")),
    "offsets int32": lambda p: (_npy(p / "ivf_lists.npy", np.array([0, 10, 20, 30, 40], np.int32)),
                                resign(p, "ivf_lists.npy")),
    "centroids nan": lambda p: (_npy(p / "ivf_centroids.npy", np.full(4 * 6, np.nan, np.float32)),
                                resign(p, "ivf_centroids.npy")),
    "centroids beyond float16": lambda p: (_npy(p / "ivf_centroids.npy", np.full(4 * 6, 1e20, np.float32)),
                                           resign(p, "ivf_centroids.npy")),
    "centroids short": lambda p: (_npy(p / "ivf_centroids.npy", np.zeros(3 * 6, np.float32)),
                                  resign(p, "ivf_centroids.npy")),
    "centroids flipped": lambda p: (p / "ivf_centroids.npy").write_bytes(
        (p / "ivf_centroids.npy").read_bytes()[:-1] + b"\x01"),
    "centroids a symlink": lambda p: (os.rename(p / "ivf_centroids.npy", p / "c.npy"),
                                      os.symlink("c.npy", p / "ivf_centroids.npy")),
}


@pytest.mark.parametrize("damage", sorted(IVF_HOSTILE))
def test_a_hostile_index_is_one_line_error(tmp_path, damage):
    path = indexed_store(tmp_path / "ds")
    IVF_HOSTILE[damage](path)
    with pytest.raises(DatastoreError) as err:
        dsmod.load_datastore(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value), str(err.value)


_WRAPPED = """
import sys, numpy as np
from pathlib import Path
sys.path.insert(0, "tests")
from helpers import random_keys, resign, rewrite_meta, write_store
from gm_graphs.errors import DatastoreError
from gm_solver.datastore import load_datastore
path = Path(sys.argv[1])
keys, values = random_keys(np.random.default_rng(0), 40, 4096)
write_store(path, keys, values, ivf=(np.zeros((1, 4096)), np.array([0, 40])))
np.save(path / "ivf_centroids.npy", np.zeros(3 * 4096, "<f4"))
np.save(path / "ivf_lists.npy", np.array([0, 2**63 - 1, -2, 40], "<i8"))  # its differences wrap around in int64
rewrite_meta(path, ivf_lists=3)
resign(path, "ivf_centroids.npy")
resign(path, "ivf_lists.npy")
try:
    load_datastore(path)
except DatastoreError as e:
    print("refused:", e)
"""


def test_offsets_that_wrap_around_are_refused_before_faiss_reads_them(tmp_path):
    run = subprocess.run([sys.executable, "-c", _WRAPPED, str(tmp_path / "ds")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("refused:") and "offsets" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize("bad", [[1.0, 1.0], [np.nan, 1.0, 2.0], [-1.0, 2.0, 2.0], [1.0, 1.0, 1.5], "abc",
                                 [[1.0, 1.0, 1.0]], ["1", "1", "1"], [True, True, True], [1 + 0j, 1.0, 1.0],
                                 [10**400, 0, 0]])
def test_bad_marginals_are_refused_by_the_writer_and_the_datastore(tmp_path, bad):
    keys, values = np.eye(3, 2), np.array([0, 1, 2])
    with pytest.raises(DatastoreError, match="marginals") as err:
        write_store(tmp_path / "ds", keys, values, vocab=3, marginals=bad)
    assert "\n" not in str(err.value) and not (tmp_path / "ds").exists()
    assert sorted(os.listdir(tmp_path)) == []
    with pytest.raises(DatastoreError, match="marginals"):
        Datastore(keys, values, vocab_size=3, marginals=bad)


MARGINAL_HOSTILE = {
    "missing": lambda p: os.unlink(p / MARGINALS),
    "flipped": lambda p: (p / MARGINALS).write_bytes((p / MARGINALS).read_bytes()[:-1] + b"\x01"),
    "nan": lambda p: (_npy(p / MARGINALS, np.full(50, np.nan)), resign(p, MARGINALS)),
    "negative": lambda p: (_npy(p / MARGINALS, np.r_[-1.0, np.full(49, 41 / 49)]), resign(p, MARGINALS)),
    "wrong sum": lambda p: (_npy(p / MARGINALS, np.full(50, 1.0)), resign(p, MARGINALS)),
    "too short": lambda p: (_npy(p / MARGINALS, np.full(40, 1.0)), resign(p, MARGINALS)),
    "float32": lambda p: (_npy(p / MARGINALS, np.full(50, 0.8, np.float32)), resign(p, MARGINALS)),
    "a symlink": lambda p: (os.rename(p / MARGINALS, p / "m.npy"), os.symlink("m.npy", p / MARGINALS)),
    "permuted (the same sum: the checksum alone tells)": lambda p: _npy(p / MARGINALS,
                                                                       np.load(p / MARGINALS)[::-1].copy()),
    "record not an object": lambda p: rewrite_meta(p, files={**json.loads((p / META).read_text())["files"],
                                                               MARGINALS: "yes"}),
}


@pytest.mark.parametrize("damage", sorted(MARGINAL_HOSTILE))
def test_hostile_marginals_are_a_one_line_error(tmp_path, damage):
    path = write_store(tmp_path / "ds", *random_keys(np.random.default_rng(0)), marginals=random_marginals(50, 40))
    assert dsmod.load_datastore(path).marginals is not None
    MARGINAL_HOSTILE[damage](path)
    with pytest.raises(DatastoreError) as err:
        dsmod.load_datastore(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message, message
