"""Hostile corpora (issue 49, the corpus side): no single document or word can exhaust memory, floods of empty
lines are skipped a block at a time, names that are not UTF-8 work, copies of a file are refused, and nothing that
is not a regular file is read (or waited on)."""

from __future__ import annotations

import gzip
import io
import os
import re
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gm_graphs import build_graph, load_graph, load_tokenizer
from gm_graphs.corpus.read import check_distinct, expand_corpus, fingerprint, iter_documents, text_bytes
from gm_graphs.corpus.readers import text as text_reader
from gm_graphs.corpus.source import MAX_DOCUMENT_BYTES, ReadStats
from gm_graphs.corpus.words import MAX_PIECE_CHARS, MAX_WORD_CHARS, split_long_words
from gm_graphs.errors import CorpusError
from gm_graphs.tokenize.encoder import BatchEncoder
from pipelines.cli import main

from .helpers import finishes_within, make_docs


def _read(files, **kw) -> list[str]:
    return [d for batch in iter_documents([Path(f) for f in files], **kw) for d in batch]


# ---- one document, one word -----------------------------------------------------------------------------------

def _parquet_bytes(values) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": values}), sink)
    return sink.getvalue()


@pytest.mark.parametrize("packing", ["plain", "gzip", "zip"])
def test_a_parquet_value_longer_than_a_document_is_refused_in_one_line(tmp_path, packing):
    blob = _parquet_bytes(["a short review", "a" * (MAX_DOCUMENT_BYTES + 1), "another"])
    if packing == "plain":
        path = tmp_path / "big.parquet"
        path.write_bytes(blob)
    elif packing == "gzip":
        path = tmp_path / "big.parquet.gz"
        path.write_bytes(gzip.compress(blob, compresslevel=1))
    else:
        path = tmp_path / "big.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
            zf.writestr("part/big.parquet", blob)
    with pytest.raises(CorpusError) as e:
        _read(expand_corpus(path))
    message = str(e.value)
    assert "\n" not in message and "row 2 " in message and "32 MB" in message and "split it into documents" in message


def test_a_parquet_row_group_too_large_for_its_rows_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "bomb.parquet"
    path.write_bytes(_parquet_bytes(["a" * (MAX_DOCUMENT_BYTES + (2 << 20))]))  # 34 MB in one row, 1.6 MB stored

    def never(*args, **kwargs):
        raise AssertionError("the row group was read")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", never)
    with pytest.raises(CorpusError, match=r"row group 0 holds 34 MB of text in 1 row\(s\), so a value is longer"):
        _read([path])


def test_a_parquet_value_of_exactly_the_limit_is_a_document(tmp_path):
    path = tmp_path / "edge.parquet"
    path.write_bytes(_parquet_bytes(["x" * MAX_DOCUMENT_BYTES]))
    assert [len(d) for d in _read([path])] == [MAX_DOCUMENT_BYTES]


class _Spy:
    """A Rust tokenizer's stand-in that records the longest run of one kind (white space or not) it is handed,
    and the most text in one call."""

    def __init__(self, backend):
        self.backend, self.longest, self.most = backend, 0, 0

    def encode_batch_fast(self, docs, add_special_tokens=False):
        self.longest = max([self.longest, *(len(run) for d in docs for run in re.findall(r"\S+|\s+", d))])
        self.most = max(self.most, sum(map(len, docs)))
        return self.backend.encode_batch_fast(docs, add_special_tokens=add_special_tokens)

    encode_batch = encode_batch_fast


@pytest.mark.parametrize("bos_eos", [False, True])
def test_no_run_longer_than_the_word_bound_reaches_the_tokenizer(bpe_tokenizer, bos_eos):
    encoder = BatchEncoder(bpe_tokenizer, add_bos_eos=bos_eos, word_cache=False)
    spy = encoder._backend = _Spy(encoder._backend)
    letters = "ab" * MAX_WORD_CHARS + "c"  # one word of 2·bound + 1 letters
    docs = ["the cat sat", f"before {letters} after", " " * (MAX_WORD_CHARS + 5) + "x", "the end"]
    ids, offsets = encoder.encode(docs)
    assert spy.longest == MAX_WORD_CHARS
    assert len(offsets) == len(docs) + 1
    plain = BatchEncoder(bpe_tokenizer, word_cache=False)
    for doc, got in zip(docs, np.split(ids, offsets[1:-1])):
        pieces, _ = split_long_words([doc])
        expected = [i for piece in pieces for i in plain.encode([piece])[0].tolist()]
        if bos_eos:
            expected = [bpe_tokenizer.bos_token_id, *expected, bpe_tokenizer.eos_token_id]
        assert got.tolist() == expected
    assert split_long_words(docs[:1] + docs[3:])[1] is None  # real documents are encoded as they are


@pytest.mark.parametrize("word_cache", [False, True])
def test_a_long_document_is_encoded_a_piece_at_a_time_to_the_same_ids(bpe_tokenizer, word_cache):
    doc = "\n".join(make_docs(int(2.5 * MAX_PIECE_CHARS / 60), seed=7)) + "  \t the end"
    assert len(doc) > 2 * MAX_PIECE_CHARS
    encoder = BatchEncoder(bpe_tokenizer, word_cache=word_cache)
    whole = encoder._backend.encode(doc, add_special_tokens=False).ids
    if not word_cache:
        spy = encoder._backend = _Spy(encoder._backend)
    ids, offsets = encoder.encode(["a review", doc])
    assert ids[offsets[1]:].tolist() == whole  # cut before a space that starts a word: GPT-2's split is kept
    if not word_cache:
        assert 0 < spy.most <= MAX_PIECE_CHARS


def test_the_word_bound_cuts_only_runs_longer_than_it():
    near = "x" * MAX_WORD_CHARS + " " + "y" * (MAX_WORD_CHARS - 1)
    assert split_long_words([near])[1] is None
    pieces, counts = split_long_words(["z" * (3 * MAX_WORD_CHARS + 1), near])
    assert [len(p) for p in pieces] == [MAX_WORD_CHARS] * 3 + [1, len(near)] and counts.tolist() == [4, 1]


# ---- floods of empty lines --------------------------------------------------------------------------------------

FLOOD = 24 << 20  # bytes of blank lines


@pytest.mark.parametrize("line", [b"\n", b"\r\n", b"  \t\n"])
def test_an_archive_of_blank_lines_is_skipped_a_block_at_a_time_with_progress(tmp_path, monkeypatch, line):
    path = tmp_path / "flood.zip"
    blank = FLOOD // len(line)
    text = line * blank + b"the only document\n" + line * 3
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("flood.txt", text)
    steps = {"decode": 0}
    decode = text_reader.decode

    def counted(values, stats):  # one call per batch of documents: the Python work the flood costs
        steps["decode"] += 1
        return decode(values, stats)

    monkeypatch.setattr(text_reader, "decode", counted)
    stats, read = ReadStats(), []
    assert _read([path], stats=stats, progress=read.append) == ["the only document"]
    assert steps["decode"] == 1
    assert stats.empty_skipped == blank + 3 and stats.documents == 1
    assert len(read) > 1 and sum(read) == len(text)  # told as the archive is inflated, not once at its end
    assert text_bytes([path]) == len(text)  # the bar's total, from the archive's directory


def test_blank_lines_of_jsonl_are_skipped_in_bulk_and_errors_keep_their_line_numbers(tmp_path):
    path = tmp_path / "flood.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n" * (4 << 20) + b'{"text": "kept"}\n' + b"\r\n" * 1000 + b"{oops\n"))
    with pytest.raises(CorpusError, match=rf"line {(4 << 20) + 1 + 1000 + 1} is not JSON"):
        _read([path])


@pytest.mark.parametrize("suffix", [".txt", ".txt.gz"])
def test_the_line_reader_reads_what_it_read_a_line_at_a_time(tmp_path, monkeypatch, suffix):
    lines = [b"\xef\xbb\xbffirst", b"", b"  ", b"second\r", b"\t", b"caf\xc3\xa9 au lait", b"x" * 70000, b"\r\r",
             b"third"]
    data = b"\n".join(lines) + b"\n\n"  # a block boundary falls inside the long line
    path = tmp_path / f"docs{suffix}"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    monkeypatch.setattr("gm_graphs.corpus.source.LINE_BLOCK_BYTES", 4096)
    stats = ReadStats()
    assert _read([path], stats=stats) == ["first", "second", "café au lait", "x" * 70000, "third"]
    assert stats.empty_skipped == 5


@pytest.mark.parametrize("name", ["long.txt", "long.jsonl.gz", "long.parquet"])
def test_a_batch_holds_about_batch_bytes_of_text_whatever_its_number_of_documents(tmp_path, monkeypatch, name):
    docs = [str(i) * (1 << 20) for i in range(6)]  # 1 MB each
    path = tmp_path / name
    if name.endswith(".parquet"):
        path.write_bytes(_parquet_bytes(docs))
    elif name.endswith(".gz"):
        path.write_bytes(gzip.compress("".join(f'{{"text": "{d}"}}\n' for d in docs).encode(), compresslevel=1))
    else:
        path.write_text("\n".join(docs) + "\n")
    for module in ("gm_graphs.corpus.source", "gm_graphs.corpus.readers.parquet"):
        monkeypatch.setattr(f"{module}.BATCH_BYTES", 2 << 20)
    batches = list(iter_documents([path]))
    assert [d for b in batches for d in b] == docs and max(map(len, batches)) <= 2 and len(batches) >= 3


def test_a_line_longer_than_a_document_is_refused_with_its_number(tmp_path):
    path = tmp_path / "long.txt.gz"
    path.write_bytes(gzip.compress(b"ok\n\n" + b"y" * (MAX_DOCUMENT_BYTES + 2) + b"\n", compresslevel=1))
    with pytest.raises(CorpusError, match="line 3 is longer than 32 MB"):
        _read([path])


# ---- names that are not UTF-8 -----------------------------------------------------------------------------------

def test_corpus_files_and_graph_folders_named_in_bytes_that_are_not_utf8(tmp_path, bpe_tokenizer):
    folder = os.fsencode(tmp_path)
    docs = make_docs(40, seed=3)
    writers = {
        b"caf\xe9.csv": lambda p: Path(p).write_text("text\n" + "\n".join(docs) + "\n"),
        b"caf\xe9.txt.gz": lambda p: Path(p).write_bytes(gzip.compress(("\n".join(docs) + "\n").encode())),
        b"caf\xe9.jsonl": lambda p: Path(p).write_text("".join(f'{{"text": "{d}"}}\n' for d in docs)),
        b"caf\xe9.parquet": lambda p: Path(p).write_bytes(_parquet_bytes(docs)),
    }
    paths = []
    for name, write in writers.items():
        write(os.fsdecode(folder + b"/" + name))
        paths.append(Path(os.fsdecode(folder + b"/" + name)))
    files = expand_corpus(paths)
    assert _read(files) == docs * 4
    assert fingerprint(files)[0]["path"].endswith("caf\\xe9.csv")
    out = Path(os.fsdecode(folder + b"/g\xff"))
    graph = build_graph(files, bpe_tokenizer, path=out, ngrams=(3,), progress=False)
    assert graph.manifest["corpus"]["documents"] == 4 * len(docs)
    assert load_graph(out).manifest["corpus"]["files"][3]["path"].endswith("caf\\xe9.parquet")


# ---- copies of one file -----------------------------------------------------------------------------------------

def test_corpus_files_that_hold_the_same_bytes_are_refused_unless_allowed(home, tmp_path, bpe_tokenizer_file,
                                                                          capsys):
    docs = make_docs(30, seed=4)
    first, copy, other = tmp_path / "a.csv", tmp_path / "copy-of-a.csv", tmp_path / "b.csv"
    first.write_text("text\n" + "\n".join(docs) + "\n")
    copy.write_bytes(first.read_bytes())
    other.write_text("text\n" + "\n".join(docs[::-1]) + "\n")  # the same size, other bytes
    check_distinct([first, other])
    with pytest.raises(CorpusError, match="hold the same bytes"):
        check_distinct([first, other, copy])
    build = ["build", str(first), str(other), str(copy), "--tokenizer", str(bpe_tokenizer_file), "--name", "g"]
    assert main(build) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and repr(str(first)) in err and repr(str(copy)) in err
    assert "--allow-duplicate-files" in err and not (home / "graphs" / "g").exists()
    assert main([*build, "--allow-duplicate-files"]) == 0, capsys.readouterr().err
    assert load_graph("g").manifest["corpus"]["documents"] == 3 * len(docs)
    # the Python API holds the same rule: refused before anything is written, counted on purpose when allowed
    tok = load_tokenizer(bpe_tokenizer_file)
    with pytest.raises(CorpusError, match="allow_duplicate_files=True"):
        build_graph([first, copy], tok, name="h", progress=False)
    assert not (home / "graphs" / "h").exists()
    g = build_graph([first, copy], tok, name="h", progress=False, allow_duplicate_files=True)
    assert g.manifest["corpus"]["documents"] == 2 * len(docs)


# ---- graphs upgrade, the glob warning -----------------------------------------------------------------------

def test_graphs_upgrade_refuses_a_folder_that_is_not_a_graph_before_walking_it(home, tmp_path, monkeypatch, capsys):
    import pipelines.build as build_cli

    (tmp_path / "tree" / "deep").mkdir(parents=True)
    walked = []
    monkeypatch.setattr(build_cli, "_folder_bytes", lambda folder: walked.append(folder) or 0)
    assert main(["graphs", "upgrade", "--path", str(tmp_path / "tree")]) == 2
    assert "is not a graph folder" in capsys.readouterr().err and walked == []


def test_the_glob_warning_is_printed_once_as_one_line(home, tmp_path, bpe_tokenizer_file, capfd):
    docs = make_docs(20, seed=6)
    for name in ("[a].csv", "a.csv"):
        (tmp_path / name).write_text("text\n" + "\n".join(docs) + "\n")

    def show(message, category, filename, lineno, file=None, line=None):  # Python's own display of a warning
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        assert main(["build", str(tmp_path / "[a].csv"), "--tokenizer", str(bpe_tokenizer_file), "--name", "g"]) == 0
    err = [line for line in capfd.readouterr().err.splitlines() if "tokenize+count" not in line]
    said = [line for line in err if "is read as the file of that name" in line]
    assert len(said) == 1 and "UserWarning" in said[0]
    assert not [line for line in err if "_warn_if_also_a_glob" in line or line.startswith(" ")]


# ---- nothing but regular files ------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["iter_documents", "replaced after the check", "fingerprint", "duplicates"])
@pytest.mark.parametrize("name", ["fifo.txt", "fifo.csv", "fifo.parquet", "fifo.jsonl", "fifo.zip"])
def test_a_fifo_in_place_of_a_corpus_file_is_refused_without_blocking(tmp_path, how, name):
    fifo = tmp_path / name
    if how == "replaced after the check":
        path = tmp_path / name
        if name.endswith(".parquet"):
            path.write_bytes(_parquet_bytes(["a document"]))
        elif name.endswith(".zip"):
            with zipfile.ZipFile(path, "w") as zf:
                zf.writestr("a.txt", "a document\n")
        else:
            path.write_text("text\na document\n" if name.endswith(".csv") else '{"text": "a document"}\n')
        files = expand_corpus(path)
        path.unlink()
        os.mkfifo(fifo)
        run = lambda: _read(files)  # noqa: E731
    else:
        os.mkfifo(fifo)
        run = {"iter_documents": lambda: _read([fifo]), "fingerprint": lambda: fingerprint([fifo]),
               "duplicates": lambda: check_distinct([fifo, fifo])}[how]
    with pytest.raises(CorpusError) as e:
        finishes_within(10, run, [fifo])
    assert "is a FIFO, not a regular file" in str(e.value) and "\n" not in str(e.value)
