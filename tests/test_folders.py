"""The folders graphmax writes (gm_graphs.store.folders): a graph's name never leaves the graphs folder, a folder
graphmax did not write is never written over nor emptied, staged folders of dead builds are removed, and a report
goes only into a new, empty or report folder."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gm_graphs import build_graph, load_graph
from gm_graphs.errors import GraphExistsError, GraphFormatError, GraphNameError, NotOwnedError, StorageError
from gm_graphs.store.folders import (
    NAME,
    REPORT_MARKER,
    TEMP_MARKER,
    claim_folder,
    disk_errors,
    graph_path,
    graphs_root,
    locked,
)
from pipelines.cli import main

# ---- names, folders and what graphmax may replace -----------------------------------------------------------------

@pytest.mark.parametrize("bad", ["../escaped", "a/b", ".hidden", "", "with space", "x" * 201, "/abs", "..", "ü"])
def test_a_string_that_is_not_a_name_is_refused(home, bad, csv_corpus, bpe_tokenizer):
    with pytest.raises(GraphNameError, match=r"Path\("):
        load_graph(bad)
    with pytest.raises(GraphNameError):
        build_graph(csv_corpus[0], bpe_tokenizer, name=bad, progress=False)
    assert not (home / "graphs").exists() and not (home.parent / "escaped").exists()


@given(st.text(max_size=40))
def test_a_name_never_leaves_the_graphs_folder(text):
    try:
        folder = graph_path(text)
    except GraphNameError:
        assert not NAME.fullmatch(text)
        return
    assert folder.parent == graphs_root() and folder.name == text and not text.startswith(".") and "/" not in text
    assert os.path.normpath(folder) == str(folder)  # nothing like '..' to resolve


def test_cli_name_outside_home_is_refused_in_one_line(home, csv_corpus, bpe_tokenizer_file, capsys):
    assert main(["build", str(csv_corpus[0]), "--tokenizer", str(bpe_tokenizer_file), "--name", "../escaped"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("graphmax build: error: '../escaped' is not a graph name") and "--path" in err
    assert "\n" not in err and not (home.parent / "escaped").exists() and not (home / "escaped").exists()


def test_a_name_is_never_a_folder_in_the_current_directory(home, tmp_path, csv_corpus, bpe_tokenizer_file,
                                                           monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / "thesis.txt").write_text("x\n")
    tok = str(bpe_tokenizer_file)
    assert main(["build", str(csv_corpus[0]), "--tokenizer", tok, "--name", "mydata", "--overwrite"]) == 0
    assert (home / "graphs" / "mydata" / "manifest.json").is_file()
    capsys.readouterr()
    assert main(["build", str(csv_corpus[0]), "--tokenizer", tok, "--path", "mydata", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()  # refused before the corpus is read: no progress bar either
    assert err.startswith("graphmax build: error: mydata exists") and "did not write as a graph" in err
    assert "\n" not in err
    assert sorted(p.name for p in (tmp_path / "mydata").iterdir()) == ["thesis.txt"]
    assert (tmp_path / "mydata" / "thesis.txt").read_text() == "x\n"
    with pytest.raises(GraphFormatError, match="not a graph folder"):
        load_graph(Path("mydata"))
    assert graph_path("mydata") == home / "graphs" / "mydata"


def test_overwrite_replaces_only_a_graph_graphmax_wrote(home, tmp_path, csv_corpus, bpe_tokenizer):
    path, _ = csv_corpus
    user = tmp_path / "user"
    user.mkdir()
    (user / "manifest.json").write_text('{"name": "my own manifest", "format_version": 1}')  # not graphmax's
    (home / "graphs").mkdir(parents=True)
    (home / "graphs" / "linked").symlink_to(user)
    for target in ({"path": user}, {"name": "linked"}, {"path": user / "manifest.json"}):
        with pytest.raises(NotOwnedError, match="never replaces it"):
            build_graph(path, bpe_tokenizer, overwrite=True, progress=False, **target)
    assert sorted(p.name for p in user.iterdir()) == ["manifest.json"] and (home / "graphs" / "linked").is_symlink()
    g = build_graph(path, bpe_tokenizer, path=tmp_path / "mine", progress=False)
    with pytest.raises(GraphExistsError, match="--overwrite"):
        build_graph(path, bpe_tokenizer, path=tmp_path / "mine", progress=False)
    assert build_graph(path, bpe_tokenizer, path=g.path, overwrite=True, progress=False).path == g.path


def test_overwrite_never_deletes_a_file_a_user_put_into_a_graph(home, tmp_path, csv_corpus, bpe_tokenizer):
    path, _ = csv_corpus
    g = build_graph(path, bpe_tokenizer, path=tmp_path / "g", ngrams=(3,), progress=False)
    before = {p: p.read_bytes() for p in g.path.rglob("*") if p.is_file()}
    cases = (("NOTES.md", "NOTES.md"), ("counts/mine.txt", "counts/mine.txt"), ("elsewhere/x", "elsewhere"))
    for extra, named in cases:
        (g.path / extra).parent.mkdir(exist_ok=True)
        (g.path / extra).write_text("the user's")
        with pytest.raises(NotOwnedError, match=f"holds {named!r}, which graphmax did not write.*move it out"):
            build_graph(path, bpe_tokenizer, path=g.path, overwrite=True, progress=False)
        assert (g.path / extra).read_text() == "the user's"
        assert {p: p.read_bytes() for p in g.path.rglob("*") if p.is_file() and p not in before} \
            == {g.path / extra: b"the user's"}
        assert all(p.read_bytes() == b for p, b in before.items())
        shutil.rmtree(g.path / "elsewhere") if extra.startswith("elsewhere") else (g.path / extra).unlink()
    # what graphmax's own writers leave there (tables a dead add_ngrams left, a manifest's temporary) is its own
    (g.path / "ngrams-0123456789ab" / "3").mkdir(parents=True)
    (g.path / "ngrams-0123456789ab" / "3" / "next.npy").write_bytes(b"")
    (g.path / ".manifest.json.tmp-0123456789ab").write_text("{")
    assert build_graph(path, bpe_tokenizer, path=g.path, overwrite=True, progress=False).path == g.path
    assert not (g.path / "ngrams-0123456789ab").exists()


def test_temporary_folders_of_dead_builds_are_removed_by_the_next_build(home, csv_corpus, bpe_tokenizer):
    path, _ = csv_corpus
    graphs = home / "graphs"
    graphs.mkdir(parents=True)
    dead = graphs / f".g.tmp-{uuid.uuid4().hex[:12]}"  # marked: a build of g that was killed
    (dead / "counts").mkdir(parents=True)
    (dead / TEMP_MARKER).write_text("{}")
    (dead / "counts" / "x.npy").write_bytes(b"partial")
    empty = graphs / f".g.old-{uuid.uuid4().hex[:12]}"
    empty.mkdir()
    foreign = [graphs / f".g.tmp-{uuid.uuid4().hex[:12]}", graphs / ".g.tmp-short", graphs / f".h.tmp-{'a' * 12}"]
    for f in foreign:  # not marked, or not named like g's temporary folders: never touched
        f.mkdir()
        (f / TEMP_MARKER if f.name.startswith(".h") else f / "notes.txt").write_text("mine")
    build_graph(path, bpe_tokenizer, name="g", progress=False)
    assert not dead.exists() and not empty.exists() and all(f.exists() for f in foreign)
    assert sorted(p.name for p in graphs.iterdir()) == sorted(["g", *(f.name for f in foreign)])


def test_eval_writes_only_into_a_new_empty_or_report_folder(tmp_path, capsys):
    user = tmp_path / "results"
    user.mkdir()
    (user / "paper.tex").write_text("x")
    assert main(["eval", "--corpus", "drug-reviews", "--out", str(user)]) == 2  # before any model loads
    assert "not empty" in capsys.readouterr().err and sorted(p.name for p in user.iterdir()) == ["paper.tex"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotOwnedError):
        claim_folder(tmp_path / "file")
    for folder in (tmp_path / "new" / "report", tmp_path / "empty"):
        if folder.name == "empty":
            folder.mkdir()
        assert (claim_folder(folder) / REPORT_MARKER).is_file()
        (folder / "report.md").write_text("old report")
        assert claim_folder(folder) == folder  # a report folder graphmax wrote may be written again


# ---- what a failed write says ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("error,says", [
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device; nothing was written"),
    (OSError(errno.EFBIG, "File too large"), "File too large; nothing was written"),
    (OSError(errno.ENOSPC, "No space left on device", "/x/g/counts.parquet"),
     "No space left on device (/x/g/counts.parquet); nothing was written"),
    (OSError(errno.EROFS, "Read-only file system"), "unchanged; choose a writable location"),
])
def test_a_full_disk_names_the_target_and_never_a_missing_path(tmp_path, error, says):
    with pytest.raises(StorageError) as e, disk_errors(tmp_path / "g"):
        raise error  # a write to an open file: the OS names no path
    assert str(e.value).startswith(f"cannot write {tmp_path / 'g'}: ") and says in str(e.value)
    assert "None" not in str(e.value)


@pytest.mark.parametrize("points_to", ["elsewhere", "missing"])
def test_a_symlinked_lock_file_is_named_as_a_link_graphmax_did_not_create(tmp_path, points_to):
    (tmp_path / "elsewhere").write_text("a user's file")
    (tmp_path / ".g.lock").symlink_to(tmp_path / points_to)
    says = r"the lock file .*\.g\.lock is a symlink, which graphmax did not create and does not follow; remove the link"
    with pytest.raises(StorageError, match=says), locked(tmp_path / "g"):
        pass
    assert (tmp_path / ".g.lock").is_symlink() and (tmp_path / "elsewhere").read_text() == "a user's file"
    assert not (tmp_path / "missing").exists()
