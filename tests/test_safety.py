"""Nothing a user owns is lost, and no input crashes the process (issue 13).

A kill or a failure at every named fault point of build, overwrite, merge, add_ngrams and set_decoder (old graph or
new graph, whole); the lock; crafted graph folders loaded and decoded in child processes (a one-line
GraphFormatError, never a signal); and the smaller refusals. Names vs folders and what graphmax may replace are in
test_folders.py.

The jobs that may die run in children forked by a runner subprocess (``python -m tests.test_safety``), which
imports graphmax once: a child per fault point or crafted folder, so that a kill or a segfault is the child's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gm_graphs import build_graph, load_graph, merge_graphs
from gm_graphs.errors import CorpusError, GraphBusyError, GraphFormatError, MergeError, NotOwnedError, OptionError
from gm_graphs.store import pagecache
from pipelines.cli import main

from .helpers import as_format_1, fork_child, forked, make_docs

REPO = Path(__file__).resolve().parents[1]


# ---- the runner: python -m tests.test_safety faults|crafted|hold SPEC ---------------------------------------------

def _tree(folder: Path, referenced_only: bool) -> dict[str, str] | None:
    """Path → SHA-256 of a graph folder (n-gram folder names normalised); None when absent."""
    import hashlib

    if not folder.exists():
        return None

    def norm(text: str) -> str:
        return re.sub(r"ngrams-[0-9a-f]{12}", "ngrams-*", text)

    keep = None
    if referenced_only:
        from gm_graphs.format.graph_files import referenced_folders

        try:
            keep = referenced_folders(json.loads((folder / "manifest.json").read_text())) | {"manifest.json"}
        except (OSError, ValueError):
            keep = {"manifest.json"}
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_dir() or (keep is not None and rel.split("/", 1)[0] not in keep):
            continue
        out[norm(rel)] = hashlib.sha256(norm(p.read_text()).encode() if p.name == "manifest.json"
                                        else p.read_bytes()).hexdigest()
    return out


def _state(home: Path) -> dict:
    target = home / "graphs" / "g"
    state = {"referenced": _tree(target, True), "full": _tree(target, False),
             "siblings": sorted(p.name for p in (home / "graphs").iterdir()) if (home / "graphs").exists() else [],
             "valid": None}
    if state["full"] is not None:
        try:
            load_graph("g").validate()
            state["valid"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the test
            state["valid"] = f"{type(e).__name__}: {e}"
    return state


def _jobs(tok, corpora: dict[str, str]):
    from gm_graphs import add_ngrams, graph_path, upgrade_graph

    def build(a: str, name: str = "g", **kw):
        return lambda: build_graph(corpora[a], tok, name=name, orders=(1, 2), ngrams=(3,), overwrite=True,
                                   progress=False, **kw)

    setups = {"build": [], "overwrite": [build("a")], "add_ngrams": [build("a")], "set_decoder": [build("a")],
              "merge": [build("a"), build("b1", "p1"), build("b2", "p2")],
              "upgrade": [build("a"), lambda: as_format_1(graph_path("g"))]}
    jobs = {"build": build("b"), "overwrite": build("b"),
            "merge": lambda: merge_graphs(["p1", "p2"], name="g", orders=(1, 2), overwrite=True, progress=False),
            "add_ngrams": lambda: add_ngrams("g", corpora["b"], tok, (3, 4), progress=False),
            "set_decoder": lambda: load_graph("g").set_decoder({"mode": "context", "lam": 2.0}),
            "upgrade": lambda: upgrade_graph("g")}
    return setups, jobs


def _run_faults(spec: dict) -> dict:
    """Every fault point of one job: fail there, record what is on disk, then run the job again cleanly."""
    from gm_graphs import load_tokenizer

    home, work = Path(spec["home"]), Path(spec["work"])
    work.mkdir(parents=True)
    os.environ["GRAPHMAX_HOME"] = str(home)
    pagecache.CHUNK = 4096  # files of a few KB written back and dropped chunk by chunk, as a big build's are
    tok = load_tokenizer(spec["tokenizer"])
    setups, jobs = _jobs(tok, spec["corpora"])
    # the job once elsewhere first: the forked children inherit its compiled kernels, so none of them compiles one
    # and writes it to the kernel cache (a fault point the clean run would reach and the failing runs not)
    os.environ["GRAPHMAX_HOME"] = str(work / "warm")
    for step in [*setups[spec["job"]], jobs[spec["job"]]]:
        step()
    os.environ["GRAPHMAX_HOME"] = str(home)
    for step in setups[spec["job"]]:
        step()
    pristine = work / "pristine"
    shutil.copytree(home / "graphs", pristine, symlinks=True) if (home / "graphs").exists() else None

    def restore() -> None:
        shutil.rmtree(home / "graphs", ignore_errors=True)
        if pristine.exists():
            shutil.copytree(pristine, home / "graphs", symlinks=True)

    job = jobs[spec["job"]]
    log = work / "points.log"

    def run() -> int:
        job()
        return 0

    old = _state(home)
    code = forked(run, {"GRAPHMAX_FAULT_LOG": str(log)}, work / "stderr")
    new = _state(home)
    points = list(dict.fromkeys(log.read_text().split()))
    results = {"old": old, "new": new, "clean_exit": code, "points": {}}
    for point in points:
        if spec["mode"] == "enospc" and point != "write.array":
            continue
        restore()
        action = point if spec["mode"] == "kill" else f"{point}:{spec['mode']}"
        code = forked(run, {"GRAPHMAX_FAULT": action}, work / "stderr")
        after = _state(home)
        after["exit"], after["stderr"] = code, (work / "stderr").read_text()
        code = forked(run, {}, work / "stderr")  # the next writer of the same graph
        recovered = _state(home)
        recovered["exit"], recovered["stderr"] = code, (work / "stderr").read_text()
        results["points"][point] = {"after": after, "recovered": recovered}
    return results


def _run_crafted(spec: dict) -> dict:
    """Load and decode each folder in a child: exit 0 (fine), 1 (GraphmaxError, printed), 3 (anything else)."""
    import torch

    from gm_solver import ContextGraphmaxLogitsProcessor, graphmax

    def decode(folder: str):
        def run() -> int:
            g = load_graph(Path(folder))
            z = torch.randn(2, g.vocab_size, generator=torch.Generator().manual_seed(0))
            graphmax(z, g, 1.0)
            proc = ContextGraphmaxLogitsProcessor(g, ngram_order=4)
            proc(torch.tensor([spec["context"]]), z[:1])
            g.stats  # noqa: B018 - what context decoding reads at start-up (gm_solver reads them from here on)
            return 0
        return run

    # numba sets up its typing and lowering registries on a process's first kernel (about 0.35 s), which every
    # child would pay again: a kernel of no threads pays it here once. Not a decoder's kernel: those are parallel,
    # and a child may not run a parallel kernel once its parent has started OpenMP's threads
    import numba

    numba.njit(lambda: 0)()
    out = {}
    for i, (name, folder) in enumerate(spec["folders"].items()):
        err = Path(spec["work"]) / f"case{i}.err"
        out[name] = {"exit": forked(decode(folder), {}, err), "stderr": err.read_text()}
    return out


def _hold(target: str) -> None:
    from gm_graphs.store.folders import locked

    with locked(Path(target)):
        print("held", flush=True)
        sys.stdin.read()


def _runner(argv: list[str]) -> int:
    command, arg = argv
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # children are forked
    if command == "hold":
        _hold(arg)
        return 0
    spec = json.loads(Path(arg).read_text())
    if command == "faults":
        from gm_graphs.store import folders

        exchange = folders._renameat2
        result = {}
        for key, case in spec["cases"].items():  # one process for all: its imports and kernels are paid once
            folders._renameat2 = None if case["fallback"] else exchange  # None: a kernel without RENAME_EXCHANGE
            result[key] = _run_faults(case)
    else:
        result = _run_crafted(spec)
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


def _run_runner(command: str, spec: dict, tmp_path: Path) -> dict:
    spec = {**spec, "out": str(tmp_path / f"{command}-result.json"), "work": str(tmp_path / f"{command}-work")}
    Path(spec["work"]).mkdir()
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("GRAPHMAX_FAULT", None)
    proc = subprocess.run([sys.executable, "-m", "tests.test_safety", command, str(tmp_path / "spec.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(Path(spec["out"]).read_text())


# ---- fixtures -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("corpora")
    docs = {"a": make_docs(60, seed=21), "b": make_docs(90, seed=22)}
    docs["b1"], docs["b2"] = docs["b"][:45], docs["b"][45:]
    for key, texts in docs.items():
        (root / f"{key}.txt").write_text("\n".join(texts) + "\n")
    return {key: str(root / f"{key}.txt") for key in docs}


FAULT_CASES = {**{f"kill {job}": ("kill", job, False) for job in ("build", "overwrite", "merge", "add_ngrams",
                                                                   "set_decoder", "upgrade")},
               **{f"raise {job}": ("raise", job, False) for job in ("overwrite", "add_ngrams", "upgrade")},
               "kill overwrite without exchange": ("kill", "overwrite", True),
               **{f"enospc {job}": ("enospc", job, False) for job in ("build", "overwrite", "add_ngrams")}}


@pytest.fixture(scope="module")
def faults(corpora, bpe_tokenizer_file, tmp_path_factory) -> dict[str, dict]:
    """Every job of FAULT_CASES failed at each fault point it reaches, in one runner process."""
    root = tmp_path_factory.mktemp("faults")
    cases = {key: {"job": job, "mode": mode, "fallback": fallback, "home": str(root / f"{i}" / "home"),
                   "work": str(root / f"{i}" / "work"), "tokenizer": str(bpe_tokenizer_file), "corpora": corpora}
             for i, (key, (mode, job, fallback)) in enumerate(FAULT_CASES.items())}
    return _run_runner("faults", {"cases": cases}, root)


def _one_line_error(stderr: str, kind: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{kind}: "), stderr
    return lines[0]


# ---- crash safety -------------------------------------------------------------------------------------------------

# a chunk written back and dropped from the page cache (where the kernel has sync_file_range)
SYNCED = {"write.synced"} if pagecache._sync_range is not None else set()
STAGED = {"stage.created", "build.counts_written", "build.operators_written", "write.array", "manifest.written",
          "manifest.replaced", "stage.filled", "stage.unmarked"} | SYNCED
POINTS = {  # at least these; a job passes whatever points it reaches
    "build": STAGED | {"build.started", "build.counted", "build.ngrams_counted", "build.ngrams_written",
                       "commit.renamed"},
    "overwrite": STAGED | {"build.started", "build.counted", "build.ngrams_counted", "build.ngrams_written",
                           "commit.exchanged", "remove.emptied"},
    "merge": STAGED | {"build.ngrams_written", "commit.exchanged", "remove.emptied"},
    "add_ngrams": {"write.array", "ngrams.counted", "ngrams.written", "manifest.written", "manifest.replaced",
                   "ngrams.committed", "remove.emptied"} | SYNCED,
    "set_decoder": {"manifest.written", "manifest.replaced"},
    "upgrade": {"write.array", "upgrade.written", "manifest.written", "manifest.replaced", "upgrade.committed",
                "remove.emptied"},
}

@pytest.mark.parametrize("job", ["build", "overwrite", "merge", "add_ngrams", "set_decoder", "upgrade"])
def test_a_kill_at_any_fault_point_leaves_the_old_graph_or_the_new_one(job, faults):
    r = faults[f"kill {job}"]
    old, new = r["old"], r["new"]
    assert r["clean_exit"] == 0 and new["valid"] == "ok" and new["referenced"] != old["referenced"]
    assert POINTS[job] <= set(r["points"]), sorted(r["points"])
    for point, res in r["points"].items():
        after, recovered = res["after"], res["recovered"]
        assert after["exit"] == 137, (point, after["stderr"])
        assert after["referenced"] in (old["referenced"], new["referenced"]), point
        if after["referenced"] is not None:  # the old graph as it was (a format-1 graph: refused as before)
            assert after["valid"] == ("ok" if after["referenced"] == new["referenced"] else old["valid"]), point
        # the next writer of the same graph succeeds and leaves nothing of the dead one behind
        assert recovered["exit"] == 0, (point, recovered["stderr"])
        assert recovered["full"] == new["full"] and recovered["siblings"] == new["siblings"], point


@pytest.mark.parametrize("job", ["overwrite", "add_ngrams", "upgrade"])
def test_a_failure_at_any_fault_point_leaves_the_old_graph_or_the_new_one_and_no_debris(job, faults):
    r = faults[f"raise {job}"]
    old, new = r["old"], r["new"]
    for point, res in r["points"].items():
        after = res["after"]
        assert after["referenced"] in (old["referenced"], new["referenced"]), point
        # the old graph as it was (a format-1 graph: refused as before), or the new one whole
        assert after["valid"] == ("ok" if after["referenced"] == new["referenced"] else old["valid"]), point
        if after["referenced"] == old["referenced"]:  # failed before the commit: reported, and nothing left over
            assert after["exit"] == 3 and "InjectedFault" in after["stderr"], (point, after["stderr"])
            assert after["full"] == old["full"] and after["siblings"] == old["siblings"], point
        else:  # after it: removing what was replaced is best effort, finished by the next writer
            assert after["exit"] in (0, 3), (point, after["stderr"])
        assert res["recovered"]["full"] == new["full"] and res["recovered"]["siblings"] == new["siblings"], point


def test_without_rename_exchange_a_kill_between_the_two_renames_is_repaired(faults):
    r = faults["kill overwrite without exchange"]
    old, new = r["old"], r["new"]
    assert {"commit.moved_aside", "commit.replaced"} <= set(r["points"])
    for point, res in r["points"].items():
        after = res["after"]
        if point == "commit.moved_aside":  # the fallback's window: the name is missing, the old graph is aside
            assert after["referenced"] is None and any(s.startswith(".g.old-") for s in after["siblings"])
        else:
            assert after["referenced"] in (old["referenced"], new["referenced"]), point
        assert res["recovered"]["full"] == new["full"] and res["recovered"]["siblings"] == new["siblings"], point


@pytest.mark.parametrize("job", ["build", "overwrite", "add_ngrams"])
def test_a_full_disk_leaves_nothing_half_written(job, faults):
    r = faults[f"enospc {job}"]
    after = r["points"]["write.array"]["after"]
    line = _one_line_error(after["stderr"], "StorageError")
    assert "No space left on device" in line and "nothing was written" in line
    assert after["full"] == r["old"]["full"] and after["siblings"] == r["old"]["siblings"]


def test_disk_full_in_the_cli_is_one_line(home, csv_corpus, bpe_tokenizer_file, monkeypatch, capsys):
    path, _ = csv_corpus
    monkeypatch.setenv("GRAPHMAX_FAULT", "write.array:enospc")
    assert main(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "g"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # after the progress bars
    assert len(err) == 1 and err[0].startswith("graphmax build: error: cannot write") and "free space" in err[0]
    assert list((home / "graphs").iterdir()) == []


def test_sigterm_during_a_build_removes_its_staged_folder_and_lock_and_keeps_the_old_graph(
        home, tmp_path, csv_corpus, bpe_tokenizer, bpe_tokenizer_file):
    path, _ = csv_corpus
    build_graph(path, bpe_tokenizer, name="g", progress=False)
    graphs, before = home / "graphs", _tree(home / "graphs" / "g", False)
    log, err = tmp_path / "points", tmp_path / "stderr"

    def run():  # the console script's path: main's status is the process's
        code = main(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "g", "--overwrite"])
        sys.stderr.flush()
        os._exit(code)

    pid = fork_child(run, {"GRAPHMAX_FAULT_LOG": str(log), "GRAPHMAX_FAULT": "build.started:pause"}, err)
    try:
        deadline = time.monotonic() + 300  # a bound on a stuck child, not a timing assertion
        while time.monotonic() < deadline and "build.started" not in (log.read_text() if log.exists() else "") \
                and os.waitpid(pid, os.WNOHANG) == (0, 0):
            time.sleep(0.02)
        left = sorted(p.name for p in graphs.iterdir())
        assert ".g.lock" in left and any(n.startswith(".g.tmp-") for n in left), left  # what a kill would leave
        os.kill(pid, signal.SIGTERM)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    text = err.read_text()
    assert status == 143, text[-2000:]
    assert text.replace("\r", "\n").strip().splitlines()[-1] == \
        f"graphmax build: terminated; nothing was written: {graphs / 'g'} is as it was", text[-2000:]
    assert sorted(p.name for p in graphs.iterdir()) == ["g"]
    assert _tree(graphs / "g", False) == before


# ---- the lock -----------------------------------------------------------------------------------------------------

def test_a_second_writer_of_the_same_graph_fails_at_once(home, csv_corpus, bpe_tokenizer, tmp_path):
    path, _ = csv_corpus
    build_graph(path, bpe_tokenizer, name="g", progress=False)
    before = sorted(p.relative_to(home).as_posix() for p in (home / "graphs").rglob("*"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRAPHMAX_HOME": str(home)}
    holder = subprocess.Popen([sys.executable, "-m", "tests.test_safety", "hold", str(home / "graphs" / "g")],
                              cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for write in (lambda: build_graph(path, bpe_tokenizer, name="g", overwrite=True, progress=False),
                      lambda: merge_graphs(["x", "y"], name="g", overwrite=True),
                      lambda: load_graph("g").set_decoder({"mode": "paper", "lam": 1.0})):
            t0 = time.perf_counter()
            with pytest.raises(GraphBusyError, match="being written by another graphmax process"):
                write()
            assert time.perf_counter() - t0 < 30  # refused before the corpus is read, not after a wait
        from gm_graphs import add_ngrams

        with pytest.raises(GraphBusyError):
            add_ngrams(load_graph("g"), path, bpe_tokenizer, (3,), progress=False)
        during = sorted(p.relative_to(home).as_posix() for p in (home / "graphs").rglob("*"))
        assert during == sorted([*before, "graphs/.g.lock"])  # the holder's lock file, and nothing else new
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    build_graph(path, bpe_tokenizer, name="g", overwrite=True, progress=False)  # released with its process
    assert sorted(p.name for p in (home / "graphs").iterdir()) == ["g"]


# ---- what graphmax may replace ---------------------------------------------------------------------------------------

def test_demo_uses_the_graph_in_home_and_leaves_a_local_imdb_alone(home, tmp_path, csv_corpus, bpe_tokenizer,
                                                                   monkeypatch):
    from pipelines.demo import ensure_imdb_graph

    monkeypatch.chdir(tmp_path)
    (tmp_path / "imdb").mkdir()
    (tmp_path / "imdb" / "reviews.txt").write_text("mine\n")
    built = build_graph(csv_corpus[0], bpe_tokenizer, name="imdb", ngrams=(3,), progress=False)
    assert ensure_imdb_graph(tokenizer=bpe_tokenizer).path == built.path == home / "graphs" / "imdb"
    assert sorted(p.name for p in (tmp_path / "imdb").iterdir()) == ["reviews.txt"]
    shutil.rmtree(home / "graphs" / "imdb")
    (home / "graphs" / "imdb").mkdir()
    (home / "graphs" / "imdb" / "manifest.json").write_text("{}")  # a folder in home that is not a graph
    with pytest.raises(NotOwnedError):
        ensure_imdb_graph(tokenizer=bpe_tokenizer)
    assert (home / "graphs" / "imdb" / "manifest.json").read_text() == "{}"


# ---- the smaller refusals -----------------------------------------------------------------------------------------

def test_merge_refuses_one_graph_the_same_graph_twice_and_other_tokenizers(home, tmp_path, csv_corpus,
                                                                          bpe_tokenizer, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path, docs = csv_corpus
    build_graph(path, bpe_tokenizer, name="g", progress=False)
    with pytest.raises(MergeError, match="at least two"):
        merge_graphs(["g"], name="m")
    with pytest.raises(MergeError, match="given twice"):
        merge_graphs(["g", home / "graphs" / "g"], name="m")
    shutil.copytree(home / "graphs" / "g", tmp_path / "copy")
    with pytest.raises(MergeError, match="count it twice"):
        merge_graphs(["g", tmp_path / "copy"], name="m")
    other = Tokenizer(models.BPE(unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=280, special_tokens=["[UNK]"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "other.txt").write_text("\n".join(make_docs(30, seed=9)) + "\n")
    build_graph(tmp_path / "other.txt", PreTrainedTokenizerFast(tokenizer_object=other), name="o", progress=False)
    with pytest.raises(MergeError, match="different tokenizers"):
        merge_graphs(["g", "o"], name="m")
    assert main(["merge", "g", "g", "--name", "m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("graphmax merge: error: the graph") and "\n" not in err
    assert not (home / "graphs" / "m").exists()


def test_a_decoder_choice_is_stored_only_into_the_graph_it_was_made_on(home, tmp_path, csv_corpus, bpe_tokenizer):
    build_graph(csv_corpus[0], bpe_tokenizer, name="g", progress=False)
    opened = load_graph("g")
    (tmp_path / "other.txt").write_text("\n".join(make_docs(40, seed=11)) + "\n")
    build_graph(tmp_path / "other.txt", bpe_tokenizer, name="g", overwrite=True, progress=False)
    with pytest.raises(GraphBusyError, match=r"graph 'g' \(.*\) was replaced or changed .* was not stored; "
                                             r"choose again on the graph as it is now"):
        opened.set_decoder({"mode": "context", "lam": 2.0})
    with pytest.raises(GraphBusyError, match="was replaced or changed"):  # an identity kept from before, likewise
        load_graph("g").set_decoder({"mode": "context", "lam": 2.0}, expected=opened.identity)
    assert load_graph("g").decoder is None
    current = load_graph("g")
    current.set_decoder({"mode": "context", "lam": 2.0})
    current.set_decoder({"mode": "paper", "lam": 1.0})  # a stored choice does not change the graph's identity
    assert load_graph("g").decoder == {"mode": "paper", "lam": 1.0}


def test_a_graph_replaced_after_it_was_opened_is_called_replaced_not_corrupted(home, tmp_path, csv_corpus,
                                                                                bpe_tokenizer):
    from gm_graphs import add_ngrams

    build_graph(csv_corpus[0], bpe_tokenizer, name="g", ngrams=(3,), progress=False)
    opened = [load_graph("g"), load_graph("g", verify=False)]
    tuned = load_graph("g")
    counts = tuned.counts.toarray()
    load_graph("g").set_decoder({"mode": "context", "lam": 2.0})  # a new manifest that records the same files
    assert (load_graph("g", verify=False).counts.toarray() == counts).all()
    tuned.__dict__.pop("counts")
    assert (tuned.counts.toarray() == counts).all() and sorted(tuned.ngrams) == [3]  # read as before
    (tmp_path / "other.txt").write_text("\n".join(make_docs(40, seed=11)) + "\n")
    extended = load_graph("g")
    add_ngrams("g", tmp_path / "other.txt", bpe_tokenizer, (3,), progress=False)  # new tables, the same counts
    assert (extended.counts.toarray() == counts).all()
    with pytest.raises(GraphBusyError, match="was replaced"):
        extended.ngrams  # noqa: B018 - its tables were removed
    build_graph(tmp_path / "other.txt", bpe_tokenizer, name="g", overwrite=True, progress=False)
    replaced = (r"graph .*/graphs/g was replaced \(a build --overwrite or merge\), changed \(add_ngrams\) or removed "
                r"after it was opened: its files are not those of the manifest read then; load it again \(load_graph, "
                r"or graph.refresh\(\)\)$")
    for graph in opened:
        for read in (lambda g: g.validate(), lambda g: g.stats, lambda g: g.counts, lambda g: g.matrix,
                     lambda g: g.ngrams):
            with pytest.raises(GraphBusyError, match=replaced):
                read(graph)
        graph.refresh()
        assert graph.validate().manifest["corpus"]["documents"] == 40  # the new graph, whole


def test_graphs_list_shows_a_broken_graph_and_the_others(home, csv_corpus, bpe_tokenizer, capsys):
    build_graph(csv_corpus[0], bpe_tokenizer, name="good", progress=False)
    shutil.copytree(home / "graphs" / "good", home / "graphs" / "bad")
    (home / "graphs" / "bad" / "manifest.json").write_bytes(b"\xff\xfe junk")
    assert main(["graphs", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("bad ") and "broken:" in lines[0] and "not UTF-8" in lines[0]
    assert lines[1].startswith("good ") and "120 docs" in lines[1]


def test_a_corpus_of_one_token_documents_is_refused_naming_the_text_column(home, tmp_path, bpe_tokenizer):
    rows = (f"{'ab'[i % 2]},{d}\n" for i, d in enumerate(make_docs(20)))  # labels of one character: one token
    (tmp_path / "c.csv").write_text("label,text\n" + "".join(rows))
    with pytest.raises(CorpusError, match="--text-column"):
        build_graph(tmp_path / "c.csv", bpe_tokenizer, name="g", text_column="label", progress=False)
    assert list((home / "graphs").iterdir()) == []


@pytest.mark.parametrize("option", [["--orders", "0"], ["--orders", "1,x"], ["--eps", "-1"], ["--eps", "nan"],
                                    ["--prune-top-k", "-3"], ["--prune-min", "-0.5"], ["--mixture", "0"],
                                    ["--ngrams", "2"], ["--ngrams", "3,2"], ["--ngram-run-entries", "0"]])
def test_out_of_range_options_are_refused_before_any_work(home, tmp_path, bpe_tokenizer_file, capsys, option):
    with pytest.raises(SystemExit) as e:  # the corpus does not even exist: nothing was read
        main(["build", str(tmp_path / "missing.csv"), "--tokenizer", str(bpe_tokenizer_file), "--name", "g", *option])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith(f"graphmax build: error: argument {option[0]}")
    assert not home.exists()


def test_out_of_range_options_in_python_are_option_errors(home, tmp_path, bpe_tokenizer, smollm2_tokenizer):
    from gm_graphs import PruneRule

    for kw in ({"orders": (0,)}, {"orders": 2}, {"eps": -1.0}, {"eps": float("inf")}, {"mixture": 0},
               {"ngrams": (2,)}, {"ngrams": (3,), "ngram_run_entries": 0}, {"shard_nnz": 0},
               {"prune": PruneRule(min_value=float("inf"))}):
        with pytest.raises(OptionError):
            build_graph(tmp_path / "missing.csv", bpe_tokenizer, name="g", progress=False, **kw)
    with pytest.raises(OptionError, match="overflows int64"):
        build_graph(tmp_path / "missing.csv", smollm2_tokenizer, name="g", ngrams=(5,), progress=False)
    assert not (home / "graphs").exists()


# ---- crafted graph folders ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def decodable(tmp_path_factory, bpe_tokenizer):
    """A small graph with n-gram tables of orders 3 and 4, and a 4-token context its tables hold."""
    root = tmp_path_factory.mktemp("decodable")
    (root / "c.txt").write_text("\n".join(make_docs(150, seed=31)) + "\n")
    g = build_graph(root / "c.txt", bpe_tokenizer, path=root / "g", ngrams=(3, 4), progress=False)
    table = g.ngrams[4]
    ctx, n = int(table.dense()[0][0]), g.vocab_size
    return g, [ctx // n // n, ctx // n % n, ctx % n]


def _rehash(folder: Path) -> None:
    """Recompute every listed file's size and SHA-256, as a crafted folder's author would."""
    from gm_graphs.format.graph_files import file_entries, sha256_file

    m = json.loads((folder / "manifest.json").read_text())
    for entry in file_entries(m):
        p = folder / entry["file"] if not entry["file"].startswith("/") else Path(entry["file"])
        if p.is_file():
            entry["bytes"], entry["sha256"] = p.stat().st_size, sha256_file(p)
    (folder / "manifest.json").write_text(json.dumps(m))


def _edit_array(rel: str, edit):
    def craft(folder: Path) -> None:
        a = np.load(folder / rel)
        np.save(folder / rel, edit(a.copy()))
    return craft


def _set(i: int, value):
    def edit(a):
        a[i] = value
        return a
    return edit


def _edit_manifest(edit):
    def craft(folder: Path) -> None:
        m = json.loads((folder / "manifest.json").read_text())
        edit(m, folder)
        (folder / "manifest.json").write_text(json.dumps(m))
    return craft


def _entry(m: dict, *keys):
    for k in keys:
        m = m[k]
    return m


def _outside(m, folder: Path, absolute: bool) -> None:
    e = m["operators"]["order1"]["shards"][0]["files"]["indices"]
    shutil.copy(folder / e["file"], folder.parent / "x.npy")
    e["file"] = str(folder.parent / "x.npy") if absolute else "../x.npy"


def _symlink_file(folder: Path) -> None:
    f = folder / "order1" / "shard-00000" / "data.npy"
    shutil.move(f, folder.parent / "data.npy")
    f.symlink_to(folder.parent / "data.npy")


def _symlink_dir(folder: Path) -> None:
    shutil.move(folder / "counts", folder.parent / "counts")
    (folder / "counts").symlink_to(folder.parent / "counts")


def _fifo(folder: Path) -> None:
    f = folder / "stats" / "successors.npy"
    f.unlink()
    os.mkfifo(f)


def _header(rel: str, header: bytes):
    """``rel`` with a crafted .npy header: numpy's own parser raises TokenError, MemoryError or a 4300-digit
    ValueError on these, and reads a declared 4 GiB header before it checks the size."""
    def craft(folder: Path) -> None:
        h = header + b"\n"
        (folder / rel).write_bytes(b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h)
    return craft


N_ = 300  # the bpe fixture's vocabulary
IDX = "order1/shard-00000/indices.npy"
PTR = "order1/shard-00000/indptr.npy"
CRAFTS = {
    "index >= N": _edit_array(IDX, _set(5, N_)),
    "negative index": _edit_array(IDX, _set(0, -1)),
    "indptr not monotone": _edit_array(PTR, lambda a: _set(10, a[-1])(a)),  # within nnz, above indptr[11]
    "indptr beyond nnz": _edit_array(PTR, _set(-1, 10**7)),
    "indptr not from 0": _edit_array(PTR, lambda a: a + 1),
    "indices of another dtype": _edit_array(IDX, lambda a: a.astype(np.float64)),
    "counts of another dtype": _edit_array("counts/shard-00000/data.npy", lambda a: a.astype(np.int32)),
    "two-dimensional data": _edit_array("order1/shard-00000/data.npy", lambda a: a[:, None]),
    "big-endian indices": _edit_array(IDX, lambda a: a.astype(">i4")),
    "NaN weight": _edit_array("order1/shard-00000/data.npy", _set(0, np.nan)),
    "zero count": _edit_array("counts/shard-00000/data.npy", _set(0, 0)),
    "counts index >= N": _edit_array("counts/shard-00000/indices.npy", _set(7, 10**6)),
    "file ../x.npy": _edit_manifest(lambda m, f: _outside(m, f, absolute=False)),
    "absolute path": _edit_manifest(lambda m, f: _outside(m, f, absolute=True)),
    "symlinked file": _symlink_file,
    "symlinked folder": _symlink_dir,
    "a FIFO for a file": _fifo,
    "non-UTF-8 manifest": lambda f: (f / "manifest.json").write_bytes(b'{"format_version": 1, "name": "\xff\xfe\x00"}'),
    "non-ASCII junk manifest": lambda f: (f / "manifest.json").write_text("ñ☃ {{ graph ]]"),
    "deeply nested manifest": lambda f: (f / "manifest.json").write_text("[" * 100000 + "]" * 100000),
    "vocab_size a string": _edit_manifest(lambda m, f: _entry(m, "tokenizer").update(vocab_size="300")),
    "vocab_size huge": _edit_manifest(lambda m, f: _entry(m, "tokenizer").update(vocab_size=2**31 - 1)),
    "vocab_size smaller than the indices": _edit_manifest(lambda m, f: _entry(m, "tokenizer").update(vocab_size=50)),
    "nnz negative": _edit_manifest(lambda m, f: _entry(m, "operators", "order1").update(nnz=-1)),
    "rows as strings": _edit_manifest(lambda m, f: _entry(m, "counts", "shards", 0).update(rows=["0", "300"])),
    "rows not covering N": _edit_manifest(lambda m, f: _entry(m, "counts", "shards", 0).update(rows=[0, 200])),
    "eps NaN": _edit_manifest(lambda m, f: m.update(eps=float("nan"))),
    "shards not a list": _edit_manifest(lambda m, f: _entry(m, "operators", "order1").update(shards={"a": 1})),
    "decoder not an object": _edit_manifest(lambda m, f: m.update(decoder=["context"])),
    "decoder over its cap": _edit_manifest(lambda m, f: m.update(decoder={"note": "x" * (64 << 10)})),
    "n-gram next >= N": _edit_array("ngrams/3/next.npy", _set(0, N_)),
    "n-gram next not ascending": _edit_array("ngrams/2/next.npy", lambda a: a[::-1].copy()),
    "n-gram indptr past the nodes": _edit_array("ngrams/4/indptr.npy", _set(1, 60000)),
    "n-gram indptr escaped without a side entry": _edit_array("ngrams/3/indptr.npy", _set(1, 0xFFFF)),
    "n-gram side table of another length": _edit_array("ngrams/3/counts_wide_at.npy", lambda a: np.append(a, 5)),
    "n-gram base negative": _edit_array("ngrams/3/indptr_base.npy", _set(-1, -5)),
    "n-gram count zero": _edit_array("ngrams/3/counts.npy", _set(0, 0)),
    "n-gram counts of another dtype": _edit_array("ngrams/4/counts.npy", lambda a: a.astype(np.int32)),
    "n-gram indptr of floats": _edit_array("ngrams/4/indptr.npy", lambda a: a.astype(np.float32)),
    "n-gram order 2": _edit_manifest(lambda m, f: m["ngrams"]["orders"].update({"2": m["ngrams"]["orders"]["3"]})),
    "n-gram level missing": _edit_manifest(lambda m, f: m["ngrams"]["levels"].pop("2")),
    "n-gram parents wrong": _edit_manifest(lambda m, f: m["ngrams"]["levels"]["3"].update(parents=7)),
    "npy header unclosed": _header(IDX, b"{"),
    "npy header nested": _header(IDX, b"-" * 9000 + b"1"),
    "npy header huge shape": _header(PTR, b"{'descr': '<i8', 'fortran_order': False, 'shape': (0x" + b"f" * 3600
                                     + b",), }"),
    "npy header of 4 GiB": lambda f: (f / IDX).write_bytes(b"\x93NUMPY\x02\x00\xff\xff\xff\xff"),
    "stats negative": _edit_array("stats/row_counts.npy", _set(0, -1)),
    "stats short": _edit_array("stats/successors.npy", lambda a: a[:-1]),
}


def test_crafted_graph_folders_end_in_a_one_line_graph_format_error(decodable, tmp_path):
    graph, context = decodable
    assert graph.vocab_size == N_
    folders = {}
    for i, (name, craft) in enumerate(CRAFTS.items()):
        folder = tmp_path / f"case{i}" / "g"
        shutil.copytree(graph.path, folder)
        craft(folder)
        if "manifest" not in name:
            _rehash(folder)  # checksums match: only the structure checks stand between the file and a kernel
        folders[name] = str(folder)
    folders["untouched"] = str(graph.path)
    results = _run_runner("crafted", {"folders": folders, "context": context}, tmp_path)
    assert results.pop("untouched") == {"exit": 0, "stderr": ""}
    wrong = {name: r for name, r in results.items() if r["exit"] != 1}  # a signal is negative, another error 3
    assert not wrong
    for r in results.values():
        _one_line_error(r["stderr"], "GraphFormatError")


def test_a_format_1_graph_is_refused_in_one_line_and_upgraded_in_place_decoding_the_same(decodable, tmp_path, capsys):
    """A graph built before format 2 is refused naming the command that converts it; converted, it holds the same
    n-grams and its reference rows are the same to the bit."""
    from gm_solver import ContextConfig, ContextReference

    graph, context = decodable
    old = tmp_path / "g"
    shutil.copytree(graph.path, old)
    as_format_1(old)
    with pytest.raises(GraphFormatError, match=r"format 1; convert it in place with `graphmax graphs upgrade "):
        load_graph(old)
    assert main(["graphs", "upgrade", "--path", str(old)]) == 0
    assert "converted to this graphmax's format" in capsys.readouterr().out
    new = load_graph(old)
    assert new.manifest["format_version"] == 2 and not list(old.glob("ngrams-00000000000f"))
    for order in (3, 4):
        np.testing.assert_array_equal(new.ngrams[order].keys(), graph.ngrams[order].keys())
        np.testing.assert_array_equal(new.ngrams[order].count_values(), graph.ngrams[order].count_values())
    rng = np.random.default_rng(5)
    ids = torch.tensor([[0, *context], *rng.integers(0, graph.vocab_size, (7, 4)).tolist()])
    rows = [ContextReference(g, ContextConfig())(ids, graph.vocab_size) for g in (graph, new)]
    assert torch.equal(rows[0], rows[1])
    assert main(["graphs", "upgrade", "--path", str(old)]) == 0
    assert "already in this graphmax's format" in capsys.readouterr().out


if __name__ == "__main__":
    sys.exit(_runner(sys.argv[1:]))
