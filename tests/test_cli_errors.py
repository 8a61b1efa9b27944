"""Every user error of the CLI is one line on stderr, `graphmax <command>: error: …`, with exit status 2.

Bad arguments fail while parsing (so no corpus, tokenizer or model is loaded and no graph folder is
made); bad corpus files, graphmax's own errors and the file system's errors are one line too; any
other exception keeps its traceback. The whole table of bad arguments runs in-process; every bad
input file, and one bad argument per command, also runs as `python -m pipelines.cli` in a child.
"""

from __future__ import annotations

import argparse
import errno
import gzip
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gm_graphs.errors import CorpusError
from pipelines.cli import main, one_line

ROOT = Path(__file__).resolve().parents[1]
CORPUS = "{corpus}"  # replaced by a valid corpus file

BUILD = ["build", CORPUS, "--tokenizer", "smollm2", "--name", "g"]
MERGE = ["merge", "a", "b", "--name", "m"]
GENERATE = ["generate", "--graph", "g", "--prompt", "It was"]
TUNE = ["tune", "g", "--corpus", CORPUS]
HUGE = str(10**20)  # past int64: each such number is refused while parsing, never a traceback or a hang later

BAD_ARGUMENTS = [  # argv, what the message says
    (BUILD + ["--orders", "0"], "argument --orders: must be integers >= 1 separated by commas, like 1,2, got '0'"),
    (BUILD + ["--orders", "1,-2"], "argument --orders: must be integers >= 1"),
    (BUILD + ["--orders", "two"], "argument --orders: must be integers >= 1"),
    (BUILD + ["--orders", ","], "argument --orders: must be integers >= 1"),
    (BUILD + ["--mixture", "1"], "argument --mixture: must be an integer >= 2, got '1'"),
    (BUILD + ["--eps", "-1"], "argument --eps: must be a finite number >= 0, got '-1'"),
    (BUILD + ["--eps", "nan"], "argument --eps: must be a finite number >= 0, got 'nan'"),
    (BUILD + ["--eps", "inf"], "argument --eps: must be a finite number >= 0, got 'inf'"),
    (BUILD + ["--prune-top-k", "-3"], "argument --prune-top-k: must be an integer >= 0, got '-3'"),
    (BUILD + ["--prune-top-k", "1.5"], "argument --prune-top-k: must be an integer >= 0, got '1.5'"),
    (BUILD + ["--prune-min", "-0.1"], "argument --prune-min: must be a finite number >= 0, got '-0.1'"),
    (BUILD + ["--prune-min", "nan"], "argument --prune-min: must be a finite number >= 0"),
    (BUILD + ["--ngrams", "2"], "argument --ngrams: must be integers >= 3 separated by commas, like 3,4, got '2'"),
    (BUILD + ["--ngrams", "3,2"], "argument --ngrams: must be integers >= 3"),
    (BUILD + ["--ngram-run-entries", "0"], "argument --ngram-run-entries: must be an integer >= 1, got '0'"),
    (BUILD + ["--ngram-run-entries", HUGE], "argument --ngram-run-entries: must be an integer from 1 to "),
    (BUILD + ["--prune-top-k", HUGE], "argument --prune-top-k: must be an integer from 0 to 2,147,483,647 (0 keeps "
                                      "all)"),
    (BUILD + ["--ngrams", f"3,{HUGE}"], "argument --ngrams: must be integers from 3 to 63 separated by commas"),
    (BUILD + ["--orders", f"1,{HUGE}"], "argument --orders: must be integers from 1 to 999 separated by commas"),
    (BUILD + ["--mixture", HUGE], "argument --mixture: must be an integer from 2 to 999"),
    (BUILD + ["--bogus"], "unrecognized arguments: --bogus"),
    (["build", CORPUS, "--name", "g"], "the following arguments are required: --tokenizer"),
    (MERGE + ["--orders", "0"], "argument --orders: must be integers >= 1"),
    (MERGE + ["--eps", "-1"], "argument --eps: must be a finite number >= 0"),
    (MERGE + ["--mixture", "0"], "argument --mixture: must be an integer >= 2"),
    (["merge", "a", "b"], "one of the arguments --name --path is required"),
    (["merge", "a", "b", "--name", "m", "--path", "m"], "argument --path: not allowed with argument --name"),
    (["graphs"], "the following arguments are required: {list,info,upgrade}"),
    (["graphs", "info"], "one of the arguments NAME --path is required"),
    (GENERATE + ["--lam", "-1"], "argument --lam: must be a finite float >= 0 (0 gives softmax), got -1.0"),
    (GENERATE + ["--lam", "nan"], "argument --lam: must be a finite number, got 'nan'"),
    (GENERATE + ["--lam", "inf"], "argument --lam: must be a finite number, got 'inf'"),
    (GENERATE + ["--tol", "0"], "argument --tol: must be a finite float > 0, got 0.0"),
    (GENERATE + ["--tol=-1e-6"], "argument --tol: must be a finite float > 0, got -1e-06"),
    (GENERATE + ["--tol", "nan"], "argument --tol: must be a finite number, got 'nan'"),
    (GENERATE + ["--kl-share", "1.5"], "argument --kl-share: must be a float in [0, 1] (the share of λ on KL(x‖q)), "
                                       "got 1.5"),
    (GENERATE + ["--order-weights", "0.8,x"], "argument --order-weights: must be finite numbers separated by commas"),
    (GENERATE + ["--divergence", "js"], "argument --divergence: must be one of ('kl', 'rkl', 'l2'), got 'js'"),
    (GENERATE + ["--knn-weight", "1.5"], "argument --knn-weight: must be a float in [0, 1]"),
    (GENERATE + ["--marginal-weight", "1e39"], "argument --marginal-weight: must be a float in [0, 10]"),
    (GENERATE + ["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got '0'"),
    (GENERATE + ["--order", "0"], "argument --order: must be an int from 1 to 999, got 0"),
    (GENERATE + ["--mixture", "1"], "argument --mixture: must be an int from 2 to 999 or None, got 1"),
    (GENERATE + ["--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
    (GENERATE + ["--seed", HUGE], "argument --seed: must be an integer from 0 to 4,294,967,295"),
    (GENERATE + ["--decoder", "paper", "--order", HUGE], "argument --order: must be an int from 1 to 999"),
    (GENERATE + ["--decoder", "paper", "--mixture", HUGE], "argument --mixture: must be an int from 2 to 999"),
    (GENERATE + ["--prompt", "  "], "argument --prompt: must not be empty or only spaces"),
    (GENERATE + ["--solver", "fast"], "argument --solver: must be one of ('mirror', 'paper'), got 'fast'"),
    (["generate", "--prompt", "x"], "one of the arguments --graph --path is required"),
    (TUNE + ["--docs", "0"], "argument --docs: must be an integer >= 1, got '0'"),
    (TUNE + ["--positions", "-4"], "argument --positions: must be an integer >= 1, got '-4'"),
    (["tune", "g", "--corpus", "missing.csv"], "argument --corpus: corpus file 'missing.csv' does not exist"),
    (["eval", "--heldout-fraction", "0"], "argument --heldout-fraction: must be a number strictly between 0 and 1"),
    (["eval", "--heldout-fraction", "1"], "argument --heldout-fraction: must be a number strictly between 0 and 1"),
    (["eval", "--heldout-fraction", "nan"], "argument --heldout-fraction: must be a number strictly between"),
    (["eval", "--lams", "0,-1"], "argument --lams: must be finite numbers >= 0 separated by commas, like 0,0.1,1"),
    (["eval", "--lams", "0,inf"], "argument --lams: must be finite numbers >= 0"),
    (["eval", "--lams", ""], "argument --lams: must be finite numbers >= 0"),
    (["eval", "--mixture-lams", "x"], "argument --mixture-lams: must be finite numbers >= 0"),
    (["eval", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["eval", "--seed", HUGE], "argument --seed: must be an integer from 0 to 4,294,967,295"),
    (["demo", "--seed", HUGE], "argument --seed: must be an integer from 0 to 4,294,967,295"),
    (["eval", "--shots", "-1"], "argument --shots: must be an integer >= 0"),
    *((["eval", f"--{size}", "0"], f"argument --{size}: must be an integer >= 1, got '0'")
      for size in ("ppl-docs", "positions", "tune-docs", "prompts", "new-tokens", "references")),
    (["demo", "--lam", "-1"], "argument --lam: must be a finite number >= 0, got '-1'"),
    (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
    (["demo", "--seed", "x"], "argument --seed: must be an integer >= 0, got 'x'"),
    (["bild"], "argument command: invalid choice: 'bild'"),
    ([], "the following arguments are required: command"),
]


def _command(argv: list[str]) -> str:
    """The `graphmax …` prefix of the error line: the sub-command path argparse gives the failing parser."""
    if argv[:2] == ["graphs", "info"]:
        return "graphmax graphs info"
    return f"graphmax {argv[0]}" if argv and argv[0] in {"build", "merge", "graphs", "generate", "demo", "tune",
                                                       "eval"} else "graphmax"


def _one_error_line(stderr: str, prog: str) -> str:
    # tqdm's progress bar (a line of carriage returns) may precede an error found while reading
    lines = [line for line in stderr.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"{prog}: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize("argv,message", BAD_ARGUMENTS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_argument_is_one_line_at_parse_time(argv, message, csv_corpus, home, capsys):
    argv = [str(csv_corpus[0]) if a == CORPUS else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)  # a run() would need a tokenizer, a graph or a model: failing here proves none was loaded
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err, _command(argv))
    assert message in line
    assert captured.out == "" and not (home / "graphs").exists()


def test_help_still_works(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["build", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: graphmax build") and "--prune-top-k" in out


# ---- errors raised while running: graphmax's own and the file system's are one line; anything else is a bug


def _run_list_raising(monkeypatch, error: BaseException) -> None:
    import pipelines.build

    def run_list(args):
        raise error

    monkeypatch.setattr(pipelines.build, "run_list", run_list)


@pytest.mark.parametrize("error,message", [
    (CorpusError("c.csv: no column 'text'\n(second line)"), "c.csv: no column 'text' (second line)"),
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device (writing under '{home}'); "
                                                       "free space and run again"),
    (OSError(errno.ENOSPC, "No space left on device", "/data/g/counts.parquet"),
     "no space left on device: '/data/g/counts.parquet'; free space and run again"),
    (PermissionError(errno.EACCES, "Permission denied", "/data/g"),
     "permission denied: '/data/g'; check the permissions or choose another location"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x", None),
     "no such file or folder: '/data/x'; check the path"),
    (OSError(errno.EXDEV, "Invalid cross-device link", "/a", "/b"), None),
    (OSError(errno.EROFS, "Read-only file system", "/ro/tmp", None, "/ro/g"),
     "read-only file system: '/ro/tmp' → '/ro/g'; choose a writable location"),
])
def test_errors_while_running_are_one_line(monkeypatch, home, capsys, error, message):
    _run_list_raising(monkeypatch, error)
    if message is None:  # not one of the user's to fix: a bug, with its traceback
        with pytest.raises(OSError):
            main(["graphs", "list"])
        return
    assert main(["graphs", "list"]) == 2
    line = _one_error_line(capsys.readouterr().err, "graphmax graphs")
    assert line == f"graphmax graphs: error: {message.format(home=home)}"


def test_unexpected_exceptions_keep_their_traceback(monkeypatch, home):
    _run_list_raising(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["graphs", "list"])


def test_interrupt_is_one_line(monkeypatch, home, capsys):
    _run_list_raising(monkeypatch, KeyboardInterrupt())
    assert main(["graphs", "list"]) == 130
    assert capsys.readouterr().err == "graphmax graphs: interrupted\n"


def test_sigterm_is_one_line_and_the_handler_is_put_back(monkeypatch, home, capsys):
    import pipelines.build

    before = signal.getsignal(signal.SIGTERM)

    def run_list(args):  # the handler main installed, called as the signal would call it
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler), handler
        handler(signal.SIGTERM, None)

    monkeypatch.setattr(pipelines.build, "run_list", run_list)
    assert main(["graphs", "list"]) == 143
    assert capsys.readouterr().err == "graphmax graphs: terminated\n"
    assert signal.getsignal(signal.SIGTERM) is before

def test_one_line_escapes_control_characters():
    assert one_line("a\nb\r\n  c\x1b[31m\x00") == "a b c\\x1b[31m\\x00"


# ---- the same through `python -m pipelines.cli` in a child process, with real files


def _cli(args: list[str], home: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRAPHMAX_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def _graph_entries(home: Path) -> set[str]:
    graphs = home / "graphs"
    return {p.name for p in graphs.iterdir() if not p.name.startswith(".")} if graphs.is_dir() else set()


def _refused_in_child(args: list[str], home: Path, message: str) -> str:
    before = _graph_entries(home)
    run = _cli(args, home)
    assert run.returncode == 2, run.stderr[-3000:]
    line = _one_error_line(run.stderr, _command(args))
    assert message in line, line
    assert _graph_entries(home) == before  # no graph folder was made
    return line


def _bad_files(folder: Path) -> dict[str, tuple[Path | str, str]]:
    """Each bad corpus input: the path (or glob) to pass, and what the error says."""
    folder.mkdir()
    (folder / "empty.csv").write_bytes(b"")
    (folder / "dir.csv").mkdir()
    os.mkfifo(folder / "pipe.txt")
    (folder / "link.csv").symlink_to(folder / "gone.csv")
    text = ("\n".join(f"document number {i} with some words" for i in range(20000)) + "\n").encode()
    cut = gzip.compress(text)
    (folder / "cut.txt.gz").write_bytes(cut[: len(cut) // 2])
    (folder / "plain.txt.gz").write_bytes(text[:1000])
    (folder / "fake.zip").write_bytes(b"not a zip archive at all")
    with zipfile.ZipFile(folder / "readme.zip", "w") as zf:
        zf.writestr("README.md", b"# about\n")
        zf.writestr("__MACOSX/._README.md", b"\0")
    (folder / "garbage.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 8 + b"PAR1")
    pq.write_table(pa.table({"text": ["a b c"] * 1000}), folder / "whole.parquet")
    (folder / "cut.parquet").write_bytes((folder / "whole.parquet").read_bytes()[:-100])
    (folder / "quote.csv").write_bytes(b'text,n\nfine,1\n"never closed,2\nlast,3\n')
    (folder / "utf16.txt").write_bytes("a document\n".encode("utf-16"))
    (folder / "c.docx").write_bytes(b"PK")
    (folder / "c.csv.bz2").write_bytes(b"BZh9")
    (folder / "c.jsonl").write_text('{"body": "the text is under another key"}\n')
    graph = folder / "home" / "graphs" / "old"
    graph.mkdir(parents=True)
    (graph / "manifest.json").write_text('{"format": "graphmax-graph"}')
    (graph / "counts.parquet").write_bytes((folder / "whole.parquet").read_bytes())
    return {
        "missing": (folder / "missing.csv", "corpus file '{f}/missing.csv' does not exist; check the path"),
        "empty": (folder / "empty.csv", "is empty (0 bytes); remove it from the inputs"),
        "folder": (folder / "dir.csv", "dir.csv' is a folder; pass the files in it"),
        "glob matching a folder": (f"{folder}/dir*.csv", "dir.csv' is a folder; pass the files in it"),
        "fifo": (folder / "pipe.txt", "pipe.txt' is a FIFO, not a regular file"),
        "broken link": (folder / "link.csv", "link.csv' is a broken symbolic link"),
        "gz not gzip": (folder / "plain.txt.gz", "is not gzip-compressed (no gzip header); remove the .gz suffix"),
        "zip not a zip": (folder / "fake.zip", "fake.zip' is not a readable zip archive"),
        "zip without corpus": (folder / "readme.zip", "holds no corpus file (skipped: 'README.md', '__MACOSX/"),
        "garbage parquet": (folder / "garbage.parquet", "garbage.parquet' is not a readable Parquet file"),
        "truncated parquet": (folder / "cut.parquet", "cut.parquet' is not a whole Parquet file"),
        "utf-16": (folder / "utf16.txt", "is UTF-16 text; convert it to UTF-8"),
        "unknown suffix": (folder / "c.docx", "cannot tell the format of 'c.docx'"),
        "bzip2": (folder / "c.csv.bz2", "is a bzip2 file, which graphmax does not read"),
        "graph folder files": (f"{folder}/home/**/*.parquet", "is inside the graph folder"),
        # found while reading, after the tokenizer is loaded
        "truncated gz": (folder / "cut.txt.gz", "cut.txt.gz: the compressed data ends early (the file is truncated)"),
        "unclosed quote": (folder / "quote.csv", "malformed CSV {f}/quote.csv: a row has 1 field(s) where the "
                                                 "header has 2"),
        "missing field": (folder / "c.jsonl", "c.jsonl: line 1 has no field 'text' (it has ['body'])"),
    }


BAD_FILES = ["missing", "empty", "folder", "glob matching a folder", "fifo", "broken link", "gz not gzip",
             "zip not a zip", "zip without corpus", "garbage parquet", "truncated parquet", "utf-16",
             "unknown suffix", "bzip2", "graph folder files", "truncated gz", "unclosed quote", "missing field"]
FOUND_WHILE_READING = {"truncated gz", "unclosed quote", "missing field"}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("bad") / "files"
    cases = _bad_files(folder)
    assert sorted(cases) == sorted(BAD_FILES)
    return folder, cases


def _build_args(case: str, bad_files, tokenizer: Path, tmp_path: Path) -> tuple[list[str], Path, str]:
    folder, cases = bad_files
    path, message = cases[case]
    home = folder / "home" if case == "graph folder files" else tmp_path / "home"
    return ["build", str(path), "--tokenizer", str(tokenizer), "--name", "g"], home, message.format(f=folder)


@pytest.mark.parametrize("case", [c for c in BAD_FILES if c not in FOUND_WHILE_READING] + ["truncated gz"])
def test_bad_corpus_file_is_one_line_in_a_child(case, bad_files, bpe_tokenizer_file, tmp_path):
    args, home, message = _build_args(case, bad_files, bpe_tokenizer_file, tmp_path)
    _refused_in_child(args, home, message)


@pytest.mark.parametrize("case", [c for c in BAD_FILES if c != "fifo"])  # a FIFO only in a child: it could block
def test_bad_corpus_file_is_one_line(case, bad_files, bpe_tokenizer_file, tmp_path, monkeypatch, capsys):
    args, home, message = _build_args(case, bad_files, bpe_tokenizer_file, tmp_path)
    monkeypatch.setenv("GRAPHMAX_HOME", str(home))
    before = _graph_entries(home)
    if case in FOUND_WHILE_READING:
        assert main(args) == 2
    else:  # refused while parsing
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 2
    assert message in _one_error_line(capsys.readouterr().err, "graphmax build")
    assert _graph_entries(home) == before


@pytest.mark.parametrize("argv,message", [
    (BUILD + ["--ngrams", "2"], "argument --ngrams: must be integers >= 3"),
    (["merge", "a", "b"], "one of the arguments --name --path is required"),
    (["graphs", "info"], "one of the arguments NAME --path is required"),
    (GENERATE + ["--tol", "0"], "argument --tol: must be a finite float > 0, got 0.0"),
    (["eval", "--heldout-fraction", "1.5"], "argument --heldout-fraction: must be a number strictly between 0 and 1"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_argument_of_each_command_in_a_child(argv, message, csv_corpus, tmp_path):
    argv = [str(csv_corpus[0]) if a == CORPUS else a for a in argv]
    _refused_in_child(argv, tmp_path / "home", message)


def test_file_system_error_names_the_path_in_a_child(csv_corpus, bpe_tokenizer_file, tmp_path):
    not_a_folder = tmp_path / "home-is-a-file"
    not_a_folder.write_text("")
    run = _cli(["build", str(csv_corpus[0]), "--tokenizer", str(bpe_tokenizer_file), "--name", "g"], not_a_folder)
    assert run.returncode == 2, run.stderr[-3000:]
    line = _one_error_line(run.stderr, "graphmax build")
    assert "home-is-a-file" in line and "check the path" in line


# ---- issue 57: paths that are not UTF-8, a model folder with no tokenizer, what an interrupt says ----------------

def _strict_cli(args: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRAPHMAX_HOME": str(home), "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8:strict",
           "LC_ALL": "C.UTF-8"}
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, env=env, cwd=ROOT,
                          timeout=300)


def test_a_folder_whose_name_is_not_utf8_prints_on_a_strict_utf8_stdout(tmp_path, csv_corpus, bpe_tokenizer_file):
    home, corpus = tmp_path / "home", str(csv_corpus[0])
    graph = os.fsdecode(os.fsencode(tmp_path) + b"/g2\xff")  # a name with a byte that is not UTF-8
    shown = os.fsencode(tmp_path) + b"/g2\\udcff"  # how it prints: escaped, never UnicodeEncodeError
    built = _strict_cli(["build", corpus, "--tokenizer", str(bpe_tokenizer_file), "--path", graph], home)
    assert built.returncode == 0 and b"Traceback" not in built.stderr, built.stderr[-3000:]
    assert b"at " + shown in built.stdout and os.path.isdir(graph)
    info = _strict_cli(["graphs", "info", "--path", graph], home)
    assert info.returncode == 0 and b"at " + shown in info.stdout, info.stderr[-3000:]
    again = _strict_cli(["build", corpus, "--tokenizer", str(bpe_tokenizer_file), "--path", graph], home)
    assert again.returncode == 2 and again.stderr.count(b"\n") == 1 and shown in again.stderr, again.stderr[-3000:]
    missing = _strict_cli(["graphs", "info", "--path", graph + "-missing"], home)
    assert missing.returncode == 2 and missing.stderr.startswith(b"graphmax graphs: error: no graph folder ") \
        and missing.stderr.count(b"\n") == 1 and shown + b"-missing" in missing.stderr, missing.stderr[-3000:]


def test_the_streams_are_put_back_after_an_in_process_run(home, capsys):
    errors = (sys.stdout.errors, sys.stderr.errors)
    assert main(["graphs", "list"]) == 0
    assert (sys.stdout.errors, sys.stderr.errors) == errors


def _model_folder(folder: Path, *names: str) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"")
    for name in names:
        (folder / name).write_text("{}")
    return folder


@pytest.mark.parametrize("argv", [
    ["generate", "--graph", "g", "--prompt", "x"], ["tune", "g", "--corpus", CORPUS],
    ["eval", "--corpus", CORPUS], ["datastore", "--corpus", CORPUS, "--out", "ds"]], ids=lambda a: a[0])
def test_a_model_folder_without_a_tokenizer_is_refused_in_one_line_before_it_loads(argv, tmp_path, home,
                                                                                   csv_corpus, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    folder = _model_folder(tmp_path / "m", "tokenizer_config.json")  # save_pretrained's, less tokenizer.json
    argv = [str(csv_corpus[0]) if a == CORPUS else a for a in argv] + ["--model", str(folder)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert _one_error_line(capsys.readouterr().err, f"graphmax {argv[0]}") == (
        f"graphmax {argv[0]}: error: argument --model: the model folder {folder} has no tokenizer (no "
        f"tokenizer.json, nor the vocabulary of one: tokenizer.model, spiece.model, sentencepiece.bpe.model, "
        f"vocab.json, vocab.txt); save the model's tokenizer into it with tokenizer.save_pretrained(folder)")
    assert not (tmp_path / "ds").exists() and not (tmp_path / "eval-report").exists()


@pytest.mark.parametrize("names", [("tokenizer.json",), ("tokenizer_config.json", "tokenizer.model"),
                                   ("vocab.json", "merges.txt"), ("qwen.tiktoken",)])
def test_a_model_folder_with_a_tokenizer_passes_the_check(names, tmp_path):
    from pipelines.args import model_error

    assert model_error(argparse.Namespace(model=str(_model_folder(tmp_path / "m", *names)))) is None
    assert model_error(argparse.Namespace(model="smollm2")) is None


def _interrupt_at(monkeypatch, point: str, signal_error: type[BaseException]) -> None:
    """Raise ``signal_error`` (as Ctrl-C or SIGTERM would) when a write reaches the fault point ``point``."""
    from gm_graphs.store import folders

    def fault_point(name):
        if name == point:
            raise signal_error()
    monkeypatch.setattr(folders, "fault_point", fault_point)


@pytest.mark.parametrize("point, committed", [("stage.filled", False), ("stage.unmarked", False),
                                              ("commit.renamed", True), ("commit.exchanged", True)])
@pytest.mark.parametrize("how", ["interrupted", "terminated"])
def test_an_interrupted_build_says_whether_its_graph_was_committed(how, point, committed, home, csv_corpus,
                                                                   bpe_tokenizer_file, monkeypatch, capsys):
    from gm_graphs import load_graph
    from pipelines.cli import Terminated

    argv = ["build", str(csv_corpus[0]), "--tokenizer", str(bpe_tokenizer_file), "--name", "g"]
    if point == "commit.exchanged":  # an old graph, replaced in one step
        assert main(argv) == 0
        argv.append("--overwrite")
    before = sorted(os.listdir(home / "graphs")) if (home / "graphs").is_dir() else []
    old = (home / "graphs" / "g" / "manifest.json").read_bytes() if "--overwrite" in argv else None
    capsys.readouterr()
    _interrupt_at(monkeypatch, point, KeyboardInterrupt if how == "interrupted" else Terminated)
    assert main(argv) == (130 if how == "interrupted" else 143)
    target = home / "graphs" / "g"
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    if committed:
        assert last == f"graphmax build: {how}; {target} was written whole before it stopped (committed)"
        assert load_graph("g").manifest["corpus"]["documents"] > 0
    else:
        assert last == f"graphmax build: {how}; nothing was written: {target} is as it was"
        assert (sorted(os.listdir(home / "graphs")) if (home / "graphs").is_dir() else []) == before
    if old is not None and not committed:
        assert (target / "manifest.json").read_bytes() == old


_ENTRY = """
import os, signal, sys, time
from pipelines import build, cli
how, when = sys.argv[1:3]
signum = signal.SIGINT if how == "interrupted" else signal.SIGTERM
if when == "while reporting":  # the command is interrupted, then the signal comes again as the line is made
    def run_list(args):
        raise KeyboardInterrupt
    build.run_list = run_list
    outcome = cli._Run.outcome
    def late(self):
        os.kill(os.getpid(), signum)
        time.sleep(30)
        return outcome(self)
    cli._Run.outcome = late
sys.argv = ["graphmax", "graphs", "list"]
code = cli.main()
os.kill(os.getpid(), signum)  # as the process exits
time.sleep(30)
sys.exit(code)
"""


@pytest.mark.parametrize("when", ["after the command ended", "while reporting"])
@pytest.mark.parametrize("how", ["interrupted", "terminated"])
def test_a_late_signal_prints_one_line_and_never_ends_the_process_by_itself(how, when, home):
    env = {**os.environ, "GRAPHMAX_HOME": str(home), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _ENTRY, how, when], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    lines = run.stderr.strip().splitlines()
    if when == "after the command ended":
        assert run.returncode == (130 if how == "interrupted" else 143), run.stderr[-3000:]
        assert lines == [f"graphmax graphs: {how} as it exited, after the command had ended with status 0"]
    else:  # the first interrupt's line, said once the second came, and its status
        assert run.returncode == 130 and lines == ["graphmax graphs: interrupted"], run.stderr[-3000:]


def test_ctrl_c_after_a_build_committed_says_so_in_a_child(tmp_path, csv_corpus, bpe_tokenizer_file):
    home, log = tmp_path / "home", tmp_path / "points"
    env = {**os.environ, "GRAPHMAX_HOME": str(home), "PYTHONPATH": str(ROOT), "GRAPHMAX_FAULT": "commit.renamed:pause",
           "GRAPHMAX_FAULT_LOG": str(log)}
    child = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "build", str(csv_corpus[0]), "--tokenizer",
                              str(bpe_tokenizer_file), "--name", "g"], env=env, cwd=ROOT, stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 300  # a bound on a stuck child, not a timing assertion
        while time.monotonic() < deadline and "commit.renamed" not in (log.read_text() if log.exists() else "") \
                and child.poll() is None:
            time.sleep(0.02)
        child.send_signal(signal.SIGINT)
        err = child.communicate(timeout=120)[1]
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, err[-3000:]
    assert err.replace("\r", "\n").strip().splitlines()[-1] == \
        f"graphmax build: interrupted; {home / 'graphs' / 'g'} was written whole before it stopped (committed)"
    assert (home / "graphs" / "g" / "manifest.json").is_file()
