"""The on-disk format: what the build writes (stats, n-gram tables, manifest), what a load checks, and the
verification cache that lets a reload skip the hashing."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gm_graphs import build_graph, load_graph
from gm_graphs.errors import GraphFormatError
from gm_graphs.format import graph_files as storage
from gm_graphs.format.writer import Hasher, NpyWriter
from gm_graphs.store.folders import GRAPH_FORMAT

from .helpers import make_docs


@pytest.fixture(scope="module")
def small_graph(tmp_path_factory, bpe_tokenizer):
    """A graph of 150 synthetic documents with Ã, Ã² and n-gram tables of orders 3 and 4."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    root = tmp_path_factory.mktemp("storage")
    pacsv.write_csv(pa.table({"text": make_docs(150, seed=11)}), root / "c.csv")
    return build_graph(root / "c.csv", bpe_tokenizer, path=root / "g", orders=(1, 2), ngrams=(3, 4), progress=False)


def _copy(graph, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(graph.path, dst)
    return dst


def _rewrite_manifest(folder: Path, edit) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    edit(m)
    (folder / "manifest.json").write_text(json.dumps(m))


def test_stats_are_the_counts_row_and_column_sums(small_graph):
    a = small_graph.counts.toarray()
    stats = small_graph.stats
    np.testing.assert_array_equal(stats["row_counts"], a.sum(axis=1))
    np.testing.assert_array_equal(stats["column_counts"], a.sum(axis=0))
    np.testing.assert_array_equal(stats["successors"], (a > 0).sum(axis=1))
    np.testing.assert_array_equal(stats["predecessors"], (a > 0).sum(axis=0))
    assert all(isinstance(v, np.memmap) and v.dtype == np.int64 for v in stats.values())


def test_a_graph_without_stats_or_format_marker_is_refused_as_damaged(small_graph, tmp_path):
    for edit in (lambda m: m.pop("stats"), lambda m: m.pop("format")):
        folder = _copy(small_graph, tmp_path / str(id(edit)))
        _rewrite_manifest(folder, edit)
        with pytest.raises(GraphFormatError, match="rebuild the graph"):
            load_graph(folder)

def test_the_npy_writer_writes_what_np_save_writes(tmp_path):
    hasher = Hasher()
    for a in (np.arange(5, dtype=np.int64), np.zeros(0, np.float32), np.linspace(0, 1, 7, dtype=np.float32)):
        w = NpyWriter(tmp_path, "a.npy", a.dtype, hasher)
        w.append(a[:3])
        w.append(a[3:])
        entry = w.close().result()
        np.save(tmp_path / "b.npy", a)
        assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()
        assert entry == {"file": "a.npy", "bytes": (tmp_path / "b.npy").stat().st_size,
                         "sha256": storage.sha256_file(tmp_path / "b.npy")}


def test_manifest_carries_the_format_marker_and_every_file(small_graph):
    m = small_graph.manifest
    assert m["format"] == GRAPH_FORMAT and m["format_version"] == 2
    listed = {entry["file"] for entry in storage.file_entries(m)}
    on_disk = {p.relative_to(small_graph.path).as_posix() for p in small_graph.path.rglob("*") if p.is_file()}
    assert on_disk - listed == {"manifest.json"} and listed <= on_disk


def _hashes(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = storage._Opened.sha256

    def counting(self):
        calls.append(self.rel)
        return real(self)

    monkeypatch.setattr(storage._Opened, "sha256", counting)
    return calls


def test_verification_cache_hashes_each_file_once_per_identity(small_graph, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "home"))  # an empty cache
    folder = _copy(small_graph, tmp_path)
    calls = _hashes(monkeypatch)
    load_graph(folder).validate()
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {"manifest.json"}
    assert sorted(calls) == sorted(files)  # first load: every file once
    calls.clear()
    g = load_graph(folder).validate()
    assert calls == [] and g.counts.nnz == small_graph.counts.nnz  # same identities: nothing hashed again
    data = folder / "order1" / "shard-00000" / "data.npy"
    os.utime(data, ns=(0, data.stat().st_mtime_ns))  # the same bytes; the ctime moves
    load_graph(folder).validate()
    assert calls == ["order1/shard-00000/data.npy"]
    calls.clear()
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))  # edited in place, same size
    with pytest.raises(GraphFormatError, match="SHA-256"):
        load_graph(folder).matrix


def test_a_build_records_what_it_wrote(tmp_path, bpe_tokenizer, monkeypatch):
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "home"))
    (tmp_path / "c.txt").write_text("\n".join(make_docs(40, seed=3)) + "\n")
    calls = _hashes(monkeypatch)
    g = build_graph(tmp_path / "c.txt", bpe_tokenizer, name="g", ngrams=(3,), progress=False)
    load_graph("g").validate()
    assert calls == [] and g.ngrams[3].entries > 0


def test_structure_is_checked_without_verify_too(small_graph, tmp_path):
    folder = _copy(small_graph, tmp_path)
    indices = folder / "order1" / "shard-00000" / "indices.npy"
    a = np.load(indices)
    a[3] = small_graph.vocab_size
    np.save(indices, a)
    with pytest.raises(GraphFormatError, match="outside"):  # the sizes match, the checksum is not read
        load_graph(folder, verify=False).matrix


@pytest.mark.parametrize("version,got", [("1", "got '1' (a str)"), (1.0, "got 1.0 (a float)"),
                                         (True, "got True (a bool)"), (None, "but it is missing (or null)")])
def test_a_format_version_that_is_not_an_integer_is_named_as_such(small_graph, tmp_path, version, got):
    folder = _copy(small_graph, tmp_path)
    _rewrite_manifest(folder, lambda m: m.update(format_version=version))
    with pytest.raises(GraphFormatError) as e:
        load_graph(folder)
    assert str(e.value) == (f"graph {folder}: manifest field format_version should be an integer, {got}; this "
                            f"graphmax reads version 2; rebuild the graph (graphmax build … --overwrite)")
    _rewrite_manifest(folder, lambda m: m.update(format_version=3))  # an integer of another version: a mismatch
    with pytest.raises(GraphFormatError, match="has format version 3; this graphmax reads version 2"):
        load_graph(folder)
    _rewrite_manifest(folder, lambda m: m.update(format_version=1))  # format 1 with n-gram tables: upgrade it
    # named as the user gave it (a copied folder), never by the manifest's build-time name "g"
    upgrade = f"format 1; convert it in place with `graphmax graphs upgrade --path {folder}`"
    with pytest.raises(GraphFormatError, match=re.escape(upgrade)):
        load_graph(folder)
    _rewrite_manifest(folder, lambda m: m.pop("ngrams"))  # format 1 without n-gram tables is laid out as format 2
    assert load_graph(folder).manifest["format_version"] == 1


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
                    | st.text(max_size=8), lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=8)


@given(path=st.lists(st.sampled_from(["tokenizer", "vocab_size", "counts", "shards", 0, "rows", "files", "indptr",
                                      "file", "bytes", "operators", "order1", "nnz", "ngrams", "orders", "3", "stats",
                                      "corpus", "documents", "eps", "decoder", "format_version"]), min_size=1,
                     max_size=6),
       value=JSON)
def test_any_edit_of_the_manifest_loads_or_fails_with_graph_format_error(small_graph, tmp_path_factory, path, value):
    m = json.loads((small_graph.path / "manifest.json").read_text())
    node = m
    for key in path[:-1]:  # walk as far as the path exists, then replace what is there
        nxt = node[key] if isinstance(node, dict) and key in node else (
            node[key] if isinstance(node, list) and isinstance(key, int) and key < len(node) else None)
        if not isinstance(nxt, (dict, list)):
            break
        node = nxt
    if isinstance(node, dict):
        node[str(path[-1])] = value
    elif isinstance(node, list) and node:
        node[0] = value
    folder = tmp_path_factory.mktemp("edit") / "g"
    shutil.copytree(small_graph.path, folder, copy_function=os.link)  # hard links: the arrays as built
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").write_text(json.dumps(m))
    try:
        g = load_graph(folder, verify=False)
        g.validate()
        g.stats, g.ngrams, g.row_mass_kept  # noqa: B018 - every accessor
    except GraphFormatError as e:
        assert "\n" not in str(e)
