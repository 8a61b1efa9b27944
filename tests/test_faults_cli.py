"""The third hostile-input audit's findings in the command line, eval and the graph format's validator (issue 49):
an OSError that names a descriptor or bytes, a refused ``eval --out`` that leaves nothing behind, a format-1 graph
that ``graphs upgrade`` would have broken, and the messages that named the wrong thing."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gm_graphs import build_graph, load_graph
from gm_graphs.errors import GraphFormatError
from pipelines.cli import main, os_error_message

from .helpers import as_format_1, fork_child, make_docs


def _error_line(err: str, prog: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # beside progress bars
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and "Traceback" not in err, err
    return lines[0].removeprefix(f"{prog}: error: ")


@pytest.fixture()
def no_run(monkeypatch):
    """Makes running eval fail the test (a run would load the model): what is under test is refused while parsing."""
    from pipelines.eval import cli

    def run(args):
        raise AssertionError("the command ran: its arguments were not refused while parsing")
    monkeypatch.setattr(cli, "run", run)


# ---- finding 5: an OSError whose filename is a descriptor or bytes ------------------------------------------------

@pytest.mark.parametrize("error, given, message", [
    (IsADirectoryError(errno.EISDIR, "Is a directory", 3), {"examples": Path("/data/ex")},
     "a folder where a file was expected: '/data/ex'; check the path"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", 3), {"graph_path": Path("g"), "examples": Path("ex")},
     "a folder where a file was expected (on one of 'g', 'ex'); check the path"),
    (PermissionError(errno.EACCES, "Permission denied", 7), {"prompt": ["x"]},
     "permission denied; check the permissions or choose another location"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", b"caf\xe9.csv"), {},
     "no such file or folder: 'caf\\udce9.csv'; check the path"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/a", None, 9), {},
     "read-only file system: '/ro/a'; choose a writable location"),
    (OSError(errno.EROFS, "Read-only file system", b"/ro/\xff", None, b"/ro/b"), {},
     "read-only file system: '/ro/\\udcff' → '/ro/b'; choose a writable location"),
], ids=["descriptor, one path given", "descriptor, two paths given", "descriptor, no path given", "bytes",
        "descriptor as filename2", "bytes both"])
def test_an_os_error_naming_a_descriptor_or_bytes_is_one_line(error, given, message):
    assert os_error_message(error, argparse.Namespace(**given)) == message


def test_generate_with_a_folder_as_examples_is_one_line_naming_it(home, tmp_path, capsys):
    folder = tmp_path / "examples"
    folder.mkdir()
    # read before the graph and the model: a folder that is no graph is never opened (a missing one is refused
    # while parsing)
    (tmp_path / "not-a-graph").mkdir()
    assert main(["generate", "--path", str(tmp_path / "not-a-graph"), "--prompt", "It was", "--examples",
                 str(folder)]) == 2
    assert _error_line(capsys.readouterr().err, "graphmax generate") == \
        f"--examples {folder} is a folder; write the examples to a file and pass that"


# ---- finding 12: an empty path, a name too long -------------------------------------------------------------------

@pytest.mark.parametrize("argv, prog", [
    (["graphs", "info", "--path", ""], "graphmax graphs info"),
    (["build", "{corpus}", "--tokenizer", "smollm2", "--path", ""], "graphmax build"),
    (["generate", "--path", "", "--prompt", "x"], "graphmax generate"),
    (["generate", "--graph", "g", "--prompt", "x", "--examples", ""], "graphmax generate"),
    (["eval", "--out", ""], "graphmax eval"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_an_empty_path_is_refused_while_parsing(argv, prog, csv_corpus, home, no_run, capsys):
    argv = [str(csv_corpus[0]) if a == "{corpus}" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    option = "--examples" if "--examples" in argv else "--out" if "--out" in argv else "--path"
    assert _error_line(capsys.readouterr().err, prog) == \
        f"argument {option}: must not be empty; give a path ('.' for this folder)"


def test_a_name_too_long_for_the_lock_file_says_so(csv_corpus, bpe_tokenizer_file, tmp_path, home, capsys):
    target = tmp_path / ("a" * 255)  # a name the file system takes; its lock file's name (.NAME.lock) it does not
    assert main(["build", str(csv_corpus[0]), "--tokenizer", str(bpe_tokenizer_file), "--path", str(target)]) == 2
    line = _error_line(capsys.readouterr().err, "graphmax build")
    assert line == (f"file name too long: '{tmp_path}/.{'a' * 255}.lock' (a name in it has 261 bytes; this file "
                    f"system allows 255); use a shorter path")
    assert not target.exists()


# ---- finding 9: a refused `eval --out DIR` leaves nothing behind --------------------------------------------------

def _corpus(folder: Path, docs: list[str], column: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    path = folder / f"corpus-{len(docs)}-{column}.csv"
    pacsv.write_csv(pa.table({column: docs}), path)
    return path


@pytest.fixture()
def no_eval_model(monkeypatch):
    """Makes loading the model fail the test: the refusals under test come before it."""
    from pipelines.eval import cli

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the corpus was checked")
    monkeypatch.setattr(cli, "load_model", fail)


@pytest.mark.parametrize("case, message", [
    ("missing corpus", "corpus file '{tmp}/missing.csv' does not exist; check the path"),
    ("blank corpus", "no documents"),
    ("one document", "the corpus is too small for --heldout-fraction 0.1: its split has "),
    ("all held out", "its split has 0 training and 60 held-out documents"),
    ("bad column", "no column 'text'"),
])
def test_eval_refused_for_its_corpus_makes_no_out_folder(case, message, tmp_path, home, no_eval_model, capsys):
    docs = make_docs(60, seed=7)
    corpus = {"missing corpus": lambda: tmp_path / "missing.csv",
              "blank corpus": lambda: _write(tmp_path / "blank.txt", "\n  \n\n"),
              "one document": lambda: _corpus(tmp_path, docs[:1]),
              "all held out": lambda: _corpus(tmp_path, docs),
              "bad column": lambda: _corpus(tmp_path, docs, column="body")}[case]()
    out = tmp_path / "new" / "report"  # its parent is made with it, and must go with it too
    argv = ["eval", "--corpus", str(corpus), "--out", str(out)]
    if case == "all held out":
        argv += ["--heldout-fraction", "0.999999"]
    assert main(argv) == 2
    line = _error_line(capsys.readouterr().err, "graphmax eval")
    assert message.format(tmp=tmp_path) in line, line
    assert not (tmp_path / "new").exists()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_eval_refused_for_its_model_makes_no_out_folder(tmp_path, home, capsys):
    out = tmp_path / "report"
    argv = ["eval", "--corpus", str(_corpus(tmp_path, make_docs(60, seed=7))), "--out", str(out),
            "--model", str(tmp_path / "no-model")]
    assert main(argv) == 2
    assert _error_line(capsys.readouterr().err, "graphmax eval").startswith("cannot load the model ")
    assert not out.exists()


@pytest.mark.parametrize("before", ["absent", "absent parents", "empty", "an earlier report"])
@pytest.mark.parametrize("failure", [GraphFormatError("a failure after the claim; fix it"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
def test_a_failure_after_the_claim_removes_only_what_eval_made(before, failure, tmp_path, home, monkeypatch,
                                                               capsys):
    from pipelines.eval import cli, experiment

    monkeypatch.setattr(cli, "load_model", lambda *args, **kwargs: (None, None))

    def prepare(args, tok, work):  # the split is written, then the run fails
        (work / "split").mkdir(parents=True)
        (work / "split" / "train.parquet").write_bytes(b"PAR1")
        raise failure
    monkeypatch.setattr(experiment, "prepare", prepare)
    out = tmp_path / "top" / "report" if before == "absent parents" else tmp_path / "report"
    if before == "empty":
        out.mkdir()
    elif before == "an earlier report":
        out.mkdir()
        (out / ".graphmax-report").write_text("{}\n")
        (out / "report.md").write_text("the earlier report\n")
    code = main(["eval", "--corpus", str(_corpus(tmp_path, make_docs(60, seed=7))), "--out", str(out)])
    assert code == (130 if isinstance(failure, KeyboardInterrupt) else 2)
    if before.startswith("absent"):
        assert not out.exists() and not (tmp_path / "top").exists()
    elif before == "empty":
        assert out.is_dir() and not list(out.iterdir())
    else:  # there before: never removed
        assert (out / "report.md").read_text() == "the earlier report\n" and (out / ".graphmax-report").exists()


def test_a_folder_that_is_not_graphmaxs_is_refused_and_kept(tmp_path, home, monkeypatch, capsys):
    from pipelines.eval import cli

    monkeypatch.setattr(cli, "load_model", lambda *args, **kwargs: (None, None))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert main(["eval", "--corpus", str(_corpus(tmp_path, make_docs(60, seed=7))), "--out", str(out)]) == 2
    assert "is a folder graphmax did not write" in _error_line(capsys.readouterr().err, "graphmax eval")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "x"])
def test_the_finetune_budget_is_checked_while_parsing(value, home, no_run, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", f"--finetune-budget-s={value}"])
    assert exit_.value.code == 2
    assert _error_line(capsys.readouterr().err, "graphmax eval").startswith(
        f"argument --finetune-budget-s: must be a finite number >= 0, got '{value}'")


# ---- findings 8, 11b, 12: the graph format's validator ------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory, bpe_tokenizer):
    """A graph with n-gram tables of orders 3 and 4 (trie levels 2, 3, 4)."""
    root = tmp_path_factory.mktemp("faults-cli")
    (root / "c.txt").write_text("\n".join(make_docs(150, seed=31)) + "\n")
    return build_graph(root / "c.txt", bpe_tokenizer, path=root / "g", ngrams=(3, 4), progress=False)


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _edit(folder: Path, change) -> None:
    m = _manifest(folder)
    change(m)
    (folder / "manifest.json").write_text(json.dumps(m))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("orders, message", [
    (lambda o: {}, "manifest field ngrams.orders should be orders like 3, 4, got []"),
    (lambda o: {"3": o["3"], "5": o["4"]}, "manifest field ngrams.orders should be consecutive orders, like 3, 4, "
                                           "got ['3', '5']"),
], ids=["no orders", "orders 3 and 5"])
def test_upgrade_refuses_up_front_a_format_1_graph_it_could_not_write_and_removes_nothing(small, tmp_path, orders,
                                                                                         message, capsys):
    old = tmp_path / "g"
    shutil.copytree(small.path, old)
    as_format_1(old)
    _edit(old, lambda m: m["ngrams"].update(orders=orders(m["ngrams"]["orders"])))
    before = _files(old)
    assert main(["graphs", "upgrade", "--path", str(old)]) == 2
    assert _error_line(capsys.readouterr().err, "graphmax graphs") == \
        f"graph {old}: {message}; rebuild the graph (graphmax build … --overwrite)"
    assert _files(old) == before  # the manifest and the format-1 tables, byte for byte


def test_upgrade_of_a_whole_format_1_graph_still_converts_it(small, tmp_path, capsys):
    old = tmp_path / "g"
    shutil.copytree(small.path, old)
    as_format_1(old)
    assert main(["graphs", "upgrade", "--path", str(old)]) == 0
    new = load_graph(old)
    for order in (3, 4):
        np.testing.assert_array_equal(new.ngrams[order].keys(), small.ngrams[order].keys())


def test_the_format_1_refusal_names_the_folder_given_quoted_never_the_manifests_name(small, tmp_path, home):
    folder = tmp_path / "copy of g; $(touch pwned)"  # a path that is shell text, quoted where it is suggested
    shutil.copytree(small.path, folder)
    as_format_1(folder)
    _edit(folder, lambda m: m.update(name="$(touch owned)"))
    with pytest.raises(GraphFormatError) as e:
        load_graph(folder)
    assert f"convert it in place with `graphmax graphs upgrade --path {shlex.quote(str(folder))}` " in str(e.value)
    assert "owned" not in str(e.value)
    stored = home / "graphs" / "copy"  # a stored graph: named as the user names it
    shutil.copytree(folder, stored)
    with pytest.raises(GraphFormatError, match=r"convert it in place with `graphmax graphs upgrade copy` "):
        load_graph("copy")


@pytest.mark.parametrize("field, message", [
    ("levels.3.nodes", "manifest field ngrams.levels.3.nodes should be {v} (the nodes of level 3, as "
                       "ngrams.levels.4.parents and ngrams.orders.3.entries say), got {w}"),
    ("levels.4.parents", "manifest field ngrams.levels.4.parents should be {v} (the nodes of level 3, as "
                         "ngrams.levels.3.nodes and ngrams.orders.3.entries say), got {w}"),
    ("orders.3.entries", "manifest field ngrams.orders.3.entries should be {v} (the nodes of level 3, as "
                         "ngrams.levels.3.nodes and ngrams.levels.4.parents say), got {w}"),
    ("levels.2.nodes", "manifest fields ngrams.levels.2.nodes ({w}) and ngrams.levels.3.parents ({v}) disagree, "
                       "and each is the nodes of level 2"),
    ("levels.4.nodes", "manifest fields ngrams.levels.4.nodes ({w}) and ngrams.orders.4.entries ({v}) disagree, "
                       "and each is the nodes of level 4"),
    ("levels.2.parents", "manifest field ngrams.levels.2.parents should be 300 (N: level 2's parents are the "
                         "tokens), got 301"),
])
def test_a_crafted_level_size_is_blamed_on_its_own_field(small, tmp_path, field, message):
    folder = tmp_path / "g"
    shutil.copytree(small.path, folder)
    *path, key = field.split(".")

    def craft(m):
        entry = m["ngrams"]
        for k in path:
            entry = entry[k]
        entry[key] += 1
        craft.values = entry[key] - 1, entry[key]
    _edit(folder, craft)
    with pytest.raises(GraphFormatError) as e:
        load_graph(folder)
    v, w = craft.values
    assert str(e.value) == f"graph {folder}: {message.format(v=v, w=w)}; rebuild the graph (graphmax build … " \
                           f"--overwrite)"


def test_two_entries_naming_one_file_are_refused(small, tmp_path):
    folder = tmp_path / "g"
    shutil.copytree(small.path, folder)
    levels = _manifest(folder)["ngrams"]["levels"]
    # both levels' side tables are empty arrays, byte for byte the same: one file would pass for both
    assert levels["2"]["files"]["indptr_wide_at"]["sha256"] == levels["3"]["files"]["indptr_wide_at"]["sha256"]
    _edit(folder, lambda m: m["ngrams"]["levels"]["3"]["files"].update(
        indptr_wide_at=m["ngrams"]["levels"]["2"]["files"]["indptr_wide_at"]))
    with pytest.raises(GraphFormatError) as e:
        load_graph(folder).validate()
    name = levels["2"]["files"]["indptr_wide_at"]["file"]
    assert str(e.value) == (f"graph {folder}: manifest fields ngrams.levels.2.files.indptr_wide_at.file and "
                            f"ngrams.levels.3.files.indptr_wide_at.file name one file {name!r}; each file has one "
                            f"entry; rebuild the graph (graphmax build … --overwrite)")


# ---- issue 57, item 1: a report folder's clean-up removes only what eval wrote ------------------------------------

USER_FILES = {"NOTES.md": "my notes\n", "my-notes/idea.txt": "an idea\n", "work/mine.txt": "mine too\n"}


def _add_user_files(out: Path) -> None:
    for name, text in USER_FILES.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)


def _assert_only_user_files_left(out: Path, err: str) -> None:
    from pipelines.eval.cli import REPORT_MARKER

    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert left == sorted([REPORT_MARKER, *USER_FILES]), left  # the marker kept: the folder stays a report folder
    assert all((out / name).read_text() == text for name, text in USER_FILES.items())
    assert sorted(p.name for p in (out / "work").iterdir()) == ["mine.txt"]  # eval's split, lock, temp: gone
    kept = [line for line in err.splitlines() if line.startswith("graphmax eval: kept ")]
    assert kept == [f"graphmax eval: kept NOTES.md, my-notes/, work/mine.txt in {out}, which eval did not write; the "
                    f"rest of this run's report was removed, and {out} stays a report folder (.graphmax-report)"], err


@pytest.mark.parametrize("before", ["absent", "empty"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_files_a_user_adds_while_eval_runs_survive_a_signal(signum, before, tmp_path, home, monkeypatch):
    from pipelines.eval import cli

    monkeypatch.setattr(cli, "load_model", lambda *args, **kwargs: (None, None))  # the split comes first
    corpus, out = _corpus(tmp_path, make_docs(60, seed=7)), tmp_path / "rep"
    if before == "empty":
        out.mkdir()
    log, err = tmp_path / "points", tmp_path / "stderr"

    def run():  # the console script's path: main's status is the process's
        code = main(["eval", "--corpus", str(corpus), "--out", str(out), "--device", "cpu"])
        sys.stderr.flush()
        os._exit(code)

    # paused inside the split's staged folder, as a run is after claiming --out
    pid = fork_child(run, {"GRAPHMAX_FAULT_LOG": str(log), "GRAPHMAX_FAULT": "stage.created:pause"}, err)
    try:
        deadline = time.monotonic() + 300  # a bound on a stuck child, not a timing assertion
        while time.monotonic() < deadline and "stage.created" not in (log.read_text() if log.exists() else "") \
                and os.waitpid(pid, os.WNOHANG) == (0, 0):
            time.sleep(0.02)
        assert (out / ".graphmax-report").is_file() and (out / "work").is_dir(), err.read_text()[-2000:]
        _add_user_files(out)
        os.kill(pid, signum)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    text = err.read_text()
    assert status == (130 if signum == signal.SIGINT else 143), text[-2000:]
    how = "interrupted" if signum == signal.SIGINT else "terminated"
    assert text.strip().splitlines()[-1] == \
        f"graphmax eval: {how}; {out} holds no complete report of this run (not committed)", text[-2000:]
    _assert_only_user_files_left(out, text)


@pytest.mark.parametrize("before", ["absent", "empty"])
@pytest.mark.parametrize("failure", [GraphFormatError("a failure after the claim; fix it"),
                                     OSError(errno.ENOSPC, "No space left on device")], ids=["error", "disk full"])
def test_files_a_user_adds_while_eval_runs_survive_an_error(failure, before, tmp_path, home, monkeypatch, capsys):
    from pipelines.eval import cli, experiment
    from pipelines.eval.cli import REPORT_FILES

    monkeypatch.setattr(cli, "load_model", lambda *args, **kwargs: (None, None))
    out = tmp_path / "top" / "rep" if before == "absent" else tmp_path / "rep"
    if before == "empty":
        out.mkdir()

    def prepare(args, tok, work):  # everything eval writes, the user's notes meanwhile, then the failure
        for name in ("split", "graph", "datastore", "datastore-fine-tuned"):
            (work / name).mkdir(parents=True)
            (work / name / "x.npy").write_bytes(b"\0")
        (work / ".graph.lock").write_bytes(b"")
        (work / ".datastore.tmp-0123456789ab").mkdir()
        for name in REPORT_FILES:
            (work.parent / name).write_bytes(b"eval's")
        _add_user_files(work.parent)
        raise failure
    monkeypatch.setattr(experiment, "prepare", prepare)
    assert main(["eval", "--corpus", str(_corpus(tmp_path, make_docs(60, seed=7))), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    _assert_only_user_files_left(out, err)
    assert err.strip().splitlines()[-1].startswith("graphmax eval: error: ")
    # still a report folder: a later run is let in, writes its report beside the notes and keeps them
    monkeypatch.setattr(experiment, "prepare", lambda args, tok, work: (_ for _ in ()).throw(failure))
    assert main(["eval", "--corpus", str(_corpus(tmp_path, make_docs(60, seed=7))), "--out", str(out)]) == 2
    assert "is a folder graphmax did not write" not in capsys.readouterr().err
    assert all((out / name).read_text() == text for name, text in USER_FILES.items())


def test_every_name_eval_writes_into_its_folder_is_one_the_clean_up_knows():
    from pipelines.eval.cli import REPORT_FILES, WORK, WORK_FOLDERS

    root = Path(__file__).resolve().parents[1] / "pipelines"
    sources = {p.name: p.read_text() for p in [*sorted((root / "eval").glob("*.py")), root / "figures.py"]}
    written = {m for text in sources.values() for m in re.findall(r"\bout / \"([^\"]+)\"", text)}
    in_work = {m for text in sources.values() for m in re.findall(r"\bwork / \"([^\"]+)\"", text)}
    assert written and in_work  # the patterns still find the writes
    assert written <= REPORT_FILES | {WORK}, written - REPORT_FILES
    assert in_work <= WORK_FOLDERS, in_work - WORK_FOLDERS


@pytest.mark.parametrize("target", ["an empty folder", "an earlier report", "nothing"])
def test_eval_out_given_a_symlink_is_refused_naming_it_and_what_it_points_to(target, tmp_path, home,
                                                                             no_eval_model, capsys):
    real, link = tmp_path / "real", tmp_path / "link"
    if target != "nothing":
        real.mkdir()
    if target == "an earlier report":
        (real / ".graphmax-report").write_text("{}\n")
        (real / "report.md").write_text("the earlier report\n")
    before = sorted(p.name for p in real.iterdir()) if real.exists() else None
    link.symlink_to(real)
    argv = ["eval", "--corpus", str(_corpus(tmp_path, make_docs(60, seed=7))), "--out", str(link)]
    assert main(argv) == 2
    assert _error_line(capsys.readouterr().err, "graphmax eval") == (
        f"--out {link} is a symlink (to {real}); graphmax writes a report only into a folder named by its own path, "
        f"never through a link: pass --out {real}")
    assert link.is_symlink() and (sorted(p.name for p in real.iterdir()) if real.exists() else None) == before
