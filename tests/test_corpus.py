"""Reading corpora: every format yields the same documents; bad input gets a clear error."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gm_graphs.corpus import read as corpus_read
from gm_graphs.corpus.read import ReadStats, clean_review_text, expand_corpus, iter_documents
from gm_graphs.corpus.readers import FORMATS, READERS, Reader, Registry
from gm_graphs.corpus.readers import jsonl as corpus_jsonl
from gm_graphs.corpus.readers.zip import ZipReader
from gm_graphs.errors import CorpusError

from .helpers import make_docs, write_jsonl

_line_text = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=40) \
    .filter(lambda s: not s.isspace())


def _write(tmp_path, fmt: str, docs: list[str]):
    if fmt == "csv":
        path = tmp_path / "c.csv"
        pacsv.write_csv(pa.table({"text": docs, "n": list(range(len(docs)))}), path)
    elif fmt == "tsv":
        path = tmp_path / "c.tsv"
        pacsv.write_csv(pa.table({"n": list(range(len(docs))), "text": docs}), path,
                        write_options=pacsv.WriteOptions(delimiter="\t", quoting_style="all_valid"))
    elif fmt == "parquet":
        path = tmp_path / "c.parquet"
        pq.write_table(pa.table({"text": docs}), path, row_group_size=7)
    elif fmt == "jsonl":
        path = tmp_path / "c.jsonl"
        write_jsonl(path, docs)
    elif fmt == "txt":
        path = tmp_path / "c.txt"
        path.write_text("\n".join(docs) + "\n")
    elif fmt == "csv.gz":
        path = tmp_path / "c.csv.gz"
        raw = tmp_path / "raw.csv"
        pacsv.write_csv(pa.table({"text": docs}), raw)
        path.write_bytes(gzip.compress(raw.read_bytes()))
    elif fmt == "zip":
        path = tmp_path / "c.zip"
        write_jsonl(tmp_path / "a.jsonl", docs[: len(docs) // 2])
        write_jsonl(tmp_path / "b.jsonl", docs[len(docs) // 2:])
        with zipfile.ZipFile(path, "w") as zf:
            zf.write(tmp_path / "a.jsonl", "a.jsonl")
            zf.write(tmp_path / "b.jsonl", "b.jsonl")
    return path


# a plain JSONL file goes to Polars; "json" reads it as a compressed or archived one is read, line by line
JSONL_READERS = ("polars", "json")


def jsonl_reader(name: str):
    """Read plain JSONL files with the reader ``name`` inside this context."""
    if name == "polars":
        return contextlib.nullcontext()
    return mock.patch.object(corpus_jsonl, "polars_jsonl_rows", corpus_jsonl.jsonl_rows)


def _read(path, jsonl_reader: str = "polars", **kw) -> list[str]:
    with globals()["jsonl_reader"](jsonl_reader):
        return [d for batch in iter_documents(expand_corpus(path), batch_docs=5, **kw) for d in batch]


@pytest.mark.parametrize("fmt,jsonl_reader", [("csv", "polars"), ("tsv", "polars"), ("parquet", "polars"),
                                               ("jsonl", "polars"), ("jsonl", "json"), ("txt", "polars"),
                                               ("csv.gz", "polars"), ("zip", "polars")])
@given(docs=st.lists(_line_text, min_size=1, max_size=15))
def test_every_format_reads_back_the_documents(tmp_path_factory, fmt, jsonl_reader, docs):
    path = _write(tmp_path_factory.mktemp(fmt.replace(".", "")), fmt, docs)
    assert _read(path, jsonl_reader=jsonl_reader) == docs


def test_globs_and_lists_expand_sorted_and_deduplicated(tmp_path):
    for name in ("b.txt", "a.txt"):
        (tmp_path / name).write_text("one doc\n")
    files = expand_corpus([str(tmp_path / "*.txt"), tmp_path / "a.txt"])
    assert [f.name for f in files] == ["a.txt", "b.txt"]


def test_empty_rows_are_skipped_and_counted(tmp_path):
    (tmp_path / "c.txt").write_text("first\n\n   \nsecond\n")
    stats = ReadStats()
    assert _read(tmp_path / "c.txt", stats=stats) == ["first", "second"]
    assert stats.empty_skipped == 2 and stats.documents == 2


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    (tmp_path / "c.txt").write_bytes(b"good line\nbad \xff\xfe line\n")
    stats = ReadStats()
    docs = _read(tmp_path / "c.txt", stats=stats)
    assert docs == ["good line", "bad \ufffd\ufffd line"]
    assert stats.undecodable_documents == 1 and stats.replaced_sequences == 2


def test_undecodable_bytes_in_csv(tmp_path):
    (tmp_path / "c.csv").write_bytes(b'text,n\n"ok",1\n"caf\xe9",2\n')
    stats = ReadStats()
    assert _read(tmp_path / "c.csv", stats=stats) == ["ok", "caf\ufffd"]
    assert stats.undecodable_documents == 1


def test_cleaning_unescapes_html_and_drops_br():
    assert clean_review_text("Great&amp;fun<br /><br/>I &quot;loved&quot; it") == 'Great&fun  I "loved" it'


@pytest.mark.parametrize("setup,message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text(""), r"empty \(0 bytes\)"),
])
def test_missing_and_empty_files(tmp_path, setup, message):
    path = tmp_path / "c.csv"
    setup(path)
    with pytest.raises(CorpusError, match=message):
        expand_corpus(path)


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(CorpusError, match="matches no file"):
        expand_corpus(str(tmp_path / "*.csv"))


def test_an_existing_path_is_read_as_that_file_whatever_glob_characters_its_name_holds(tmp_path):
    for name in ("reviews [2019].csv", "[a].csv", "a.csv", "*.csv", "b.csv"):
        pacsv.write_csv(pa.table({"text": [f"the text of {name}"]}), tmp_path / name)
    assert expand_corpus(str(tmp_path / "reviews [2019].csv")) == [tmp_path / "reviews [2019].csv"]
    with pytest.warns(UserWarning, match=r"read as the file of that name; as a glob it would also match 1 other"):
        assert expand_corpus(str(tmp_path / "[a].csv")) == [tmp_path / "[a].csv"]  # not a.csv
    with pytest.warns(UserWarning, match=r"would also match 4 other file\(s\)"):
        files = expand_corpus(str(tmp_path / "*.csv"))
    assert files == [tmp_path / "*.csv"]
    assert list(iter_documents(files, "text")) == [["the text of *.csv"]]
    (tmp_path / "*.csv").unlink()  # no such file now: the pattern is a glob again
    assert [f.name for f in expand_corpus(str(tmp_path / "*.csv"))] == ["[a].csv", "a.csv", "b.csv",
                                                                       "reviews [2019].csv"]
    with pytest.raises(CorpusError, match=r"no file is named '.*\[x\].csv', and the glob .* matches no file"):
        expand_corpus(str(tmp_path / "[x].csv"))


def test_a_glob_that_matches_only_folders_is_refused_naming_one(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text("the cat sat\n")
    with pytest.raises(CorpusError, match=r"the glob '.*pla\*' matches only folders, e.g. '.*plain'; pass the files"):
        expand_corpus(str(tmp_path / "pla*"))
    assert [f.name for f in expand_corpus(str(tmp_path / "pla*" / "*.txt"))] == ["a.txt"]


def test_unknown_suffix(tmp_path):
    (tmp_path / "c.docx").write_text("x")
    with pytest.raises(CorpusError, match="cannot tell the format"):
        expand_corpus(tmp_path / "c.docx")


class _ParagraphReader(Reader):
    """A format made up for the test: paragraphs separated by blank lines, a document each."""

    name = "paragraphs"
    suffixes = (".para",)

    def rows(self, source, column, batch_docs, stats):
        with source.open() as fh:
            yield [p.strip() for p in fh.read().decode().split("\n\n")]


def test_a_new_format_is_one_reader_class_and_one_registry_entry(tmp_path, monkeypatch):
    formats = Registry([*FORMATS.readers, _ParagraphReader()])
    monkeypatch.setattr(corpus_read, "READERS", Registry([*formats.readers, ZipReader(formats)]))
    (tmp_path / "a.para").write_text("great film\nwell acted\n\ndull\n")
    (tmp_path / "b.para.gz").write_bytes(gzip.compress(b"second file"))
    with zipfile.ZipFile(tmp_path / "c.zip", "w") as zf:
        zf.writestr("in/archive.para", "archived\n\n\n")
    got = _read([tmp_path / "a.para", tmp_path / "b.para.gz", tmp_path / "c.zip"])
    assert got == ["great film\nwell acted", "dull", "second file", "archived"]
    (tmp_path / "d.docx").write_text("x")
    with pytest.raises(CorpusError, match=r"use one of the suffixes .*\.para, .*\(optionally \.gz\), or \.zip"):
        expand_corpus(tmp_path / "d.docx")


def test_every_suffix_names_one_reader_and_the_messages_list_them_all():
    suffixes = [s for reader in READERS.readers for s in reader.suffixes]
    assert len(suffixes) == len(set(suffixes))
    assert all(READERS.reader_for(f"x{s.upper()}").suffixes == READERS.reader_for(f"x{s}.gz").suffixes
               for s in suffixes)
    assert READERS.described() == (".csv, .json, .jsonl, .ndjson, .parquet, .pq, .text, .tsv, .txt "
                                   "(optionally .gz), or .zip")
    with pytest.raises(ValueError, match="the suffix '.csv' is claimed by the CSV and paragraphs readers"):
        Registry([*FORMATS.readers, type("Clash", (_ParagraphReader,), {"suffixes": (".csv",)})()])


def test_missing_column_names_the_columns_and_the_fix(csv_corpus):
    path, _ = csv_corpus
    with pytest.raises(CorpusError, match=r"no column 'review'.*\['id', 'text'\].*--text-column"):
        _read(path, text_column="review")


def test_non_text_column(tmp_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "c.parquet")
    with pytest.raises(CorpusError, match="holds int64, not text"):
        _read(tmp_path / "c.parquet")


@pytest.mark.parametrize("jsonl_reader", JSONL_READERS)
def test_jsonl_field_missing_or_not_text(tmp_path, jsonl_reader):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(CorpusError, match="line 2 has no field 'text'"):
        _read(tmp_path / "a.jsonl", jsonl_reader=jsonl_reader)
    for value, kind in (("3", "int"), ("-1.5e3", "float"), ("true", "bool"), ('["x"]', "list"), ('{"a": 1}', "dict")):
        (tmp_path / "b.jsonl").write_text(f'{{"text": "ok"}}\n\n{{"text": {value}}}\n')
        with pytest.raises(CorpusError, match=f"line 3: field 'text' holds {kind}, not text"):
            _read(tmp_path / "b.jsonl", jsonl_reader=jsonl_reader)
    (tmp_path / "c.jsonl").write_text('{"text": "3"}\n{"text": "[x]"}\n{"text": "true"}\n{"text": null}\n')
    stats = ReadStats()
    assert _read(tmp_path / "c.jsonl", jsonl_reader=jsonl_reader, stats=stats) == ["3", "[x]", "true"]
    assert stats.empty_skipped == 1


def test_corpus_with_no_documents(tmp_path):
    (tmp_path / "c.txt").write_text("\n \n\n")
    with pytest.raises(CorpusError, match="no documents"):
        _read(tmp_path / "c.txt")


def test_real_drug_reviews_zip_reads_all_979_reviews():
    from gm_graphs import bundled

    stats = ReadStats()
    docs = _read(bundled.drug_reviews_zip(), text_column="review", clean=True, stats=stats)
    assert len(docs) == 979 and stats.undecodable_documents == 0
    assert not any("&#039;" in d or "<br" in d for d in docs)


def test_real_news_articles_zip_reads_the_3788_articles_with_text():
    from gm_graphs import bundled

    stats = ReadStats()
    docs = _read(bundled.news_articles_zip(), stats=stats)
    assert len(docs) == 3788 and stats.undecodable_documents == 0  # 36 of the 3,824 rows have no text
    assert sorted(len(d.split()) for d in docs)[len(docs) // 2] > 300  # whole articles, not titles


# ---- damaged, hostile and unusual inputs: each reads correctly or is one CorpusError naming the file and the fix

ROOT = Path(__file__).resolve().parents[1]


def _refused(path, match: str, **kw) -> str:
    with pytest.raises(CorpusError, match=match) as info:
        _read(path, **kw)
    message = str(info.value)
    assert "\n" not in message and Path(path).name in message
    return message


_READER = """
import json, sys
from gm_graphs.errors import CorpusError
from gm_graphs.corpus.read import expand_corpus, iter_documents
try:
    docs = [d for batch in iter_documents(expand_corpus(sys.argv[1]), sys.argv[2]) for d in batch]
    print(json.dumps({"documents": len(docs)}))
except CorpusError as e:
    print(json.dumps({"error": str(e)}))
"""


def _read_in_subprocess(path, column: str = "text") -> dict:
    """Read in a child process: a crash (segfault, abort) or an exception other than CorpusError fails the test."""
    run = subprocess.run([sys.executable, "-c", _READER, str(path), column], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def _csv_bytes(docs: list[str]) -> bytes:
    sink = pa.BufferOutputStream()
    pacsv.write_csv(pa.table({"text": docs, "n": list(range(len(docs)))}), sink)
    return sink.getvalue().to_pybytes()


def test_truncated_gz_is_refused(tmp_path):
    for fmt in ("csv", "txt", "jsonl", "parquet"):
        data = gzip.compress(_write(tmp_path, fmt, make_docs(3000)).read_bytes())
        path = tmp_path / f"cut.{fmt}.gz"
        path.write_bytes(data[: len(data) // 2])
        _refused(path, r"compressed data ends early \(the file is truncated\); copy or download it again")


def test_corrupt_gz_is_refused(tmp_path):
    data = bytearray(gzip.compress(_csv_bytes(make_docs(3000)), mtime=0))
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    (tmp_path / "c.csv.gz").write_bytes(bytes(data))
    _refused(tmp_path / "c.csv.gz", r"corrupt compressed data|not valid gzip data")
    (tmp_path / "plain.csv.gz").write_bytes(_csv_bytes(["a", "b"]))  # named .gz, not compressed
    with pytest.raises(CorpusError, match=r"is not gzip-compressed .*remove the \.gz suffix"):
        expand_corpus(tmp_path / "plain.csv.gz")


def test_zip_that_is_not_a_zip(tmp_path):
    (tmp_path / "c.zip").write_bytes(b"PK\x03\x04 this is not really a zip archive")
    with pytest.raises(CorpusError, match=r"c\.zip' is not a readable zip archive .*copy it again"):
        expand_corpus(tmp_path / "c.zip")
    real = _write(tmp_path, "zip", make_docs(50))
    (tmp_path / "cut.zip").write_bytes(real.read_bytes()[:-30])
    with pytest.raises(CorpusError, match="not a readable zip archive"):
        expand_corpus(tmp_path / "cut.zip")


def test_zip_bomb_member_is_refused_without_inflating_it(tmp_path):
    """A member of 512 MB on one line (2 MB compressed) stops at the line limit; memory stays bounded."""
    path = tmp_path / "bomb.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("a.txt", "w", force_zip64=True) as member:
            for _ in range(512):
                member.write(b"a" * (1 << 20))
    code = _READER.replace("try:", "import resource\nbase = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\ntry:") \
        + "print(json.dumps({'grew_mb': (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))\n"
    run = subprocess.run([sys.executable, "-c", code, str(path), "text"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result, grew = (json.loads(line) for line in run.stdout.splitlines()[-2:])
    assert "bomb.zip!a.txt: line 1 is longer than 32 MB" in result["error"]
    assert grew["grew_mb"] < 300

    path.unlink()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("b.csv", "w", force_zip64=True) as member:
            member.write(b'text,n\nok,1\n"')
            for _ in range(512):
                member.write(b"a" * (1 << 20))
    run = subprocess.run([sys.executable, "-c", code, str(path), "text"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result, grew = (json.loads(line) for line in run.stdout.splitlines()[-2:])
    assert "bomb.zip!b.csv: a row is longer than 32 MB, most likely a quote that is never closed" in result["error"]
    assert grew["grew_mb"] < 400


@pytest.mark.parametrize("damage", ["truncated", "garbage", "no footer"])
def test_damaged_parquet_is_refused(tmp_path, damage):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": make_docs(2000)}), good, row_group_size=500)
    data = good.read_bytes()
    path = tmp_path / "c.parquet"
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"PAR1" + bytes(range(256)) * 40 + b"PAR1")
    else:
        path.write_bytes(data[:-8] + b"\0\0\0\0PAR1")
    result = _read_in_subprocess(path)
    assert "error" in result and "c.parquet" in result["error"] and "\n" not in result["error"]
    assert "Parquet" in result["error"]


def test_parquet_with_damaged_pages_is_refused_in_a_child(tmp_path):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": make_docs(2000)}), good, row_group_size=500, compression="none")
    data = bytearray(good.read_bytes())
    data[200:1200] = bytes(range(250)) * 4  # inside the first data page, footer intact
    (tmp_path / "c.parquet").write_bytes(bytes(data))
    result = _read_in_subprocess(tmp_path / "c.parquet")  # in a child: a crash there fails the test, not the run
    assert "documents" not in result, "a damaged page was read as documents"
    assert "c.parquet: damaged Parquet data" in result["error"] and "\n" not in result["error"]


@pytest.mark.parametrize("body,match", [
    (b'text,n\nok,1\n"never closed,2\nthird,3\n', r"a row has 1 field\(s\) where the header has 2 .*fix the quoting"),
    (b'n,text\n1,ok\n2,"never closed\n3,third\n', r"a quote opened in the last row is never closed"),
    (b'text\nok\n"never closed\nthird\n', r"a quote opened in the last row is never closed"),
])
def test_csv_with_unbalanced_quotes_is_refused(tmp_path, body, match):
    (tmp_path / "c.csv").write_bytes(body)
    _refused(tmp_path / "c.csv", match)
    (tmp_path / "c.csv.gz").write_bytes(gzip.compress(body))  # the same through a decompressed stream
    _refused(tmp_path / "c.csv.gz", match)


def test_csv_closed_multiline_quote_at_the_end_is_read(tmp_path):
    (tmp_path / "c.csv").write_bytes(b'n,text\n1,ok\n2,"two\nlines"\n')
    assert _read(tmp_path / "c.csv") == ["ok", "two\nlines"]


@pytest.mark.parametrize("fmt", ["csv", "tsv", "csv.gz", "zip"])
def test_a_20_mb_field_reads_and_nothing_is_counted_twice(tmp_path, fmt):
    big = "x" * (20 << 20)
    docs = [f"before {i}" for i in range(5000)] + [big] + [f"after {i}" for i in range(10)]
    sep = "\t" if fmt == "tsv" else ","
    data = ("text" + sep + "n\n" + "".join(f"{d}{sep}{i}\n" for i, d in enumerate(docs))).encode()
    if fmt == "csv.gz":
        data = gzip.compress(data, compresslevel=1)
    path = tmp_path / f"c.{fmt}"
    if fmt == "zip":
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("c.csv", data)
    else:
        path.write_bytes(data)
    stats = ReadStats()
    got = [d for batch in iter_documents(expand_corpus(path), stats=stats) for d in batch]
    assert len(got) == len(docs) and got == docs
    assert stats.documents == len(docs) and stats.empty_skipped == 0


def test_gz_members_inside_a_zip_are_decompressed(tmp_path):
    docs = make_docs(40)
    path = tmp_path / "c.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("part1.csv.gz", gzip.compress(_csv_bytes(docs[:20])))
        zf.writestr("part2.txt.gz", gzip.compress(("\n".join(docs[20:]) + "\n").encode()))
    assert _read(path) == docs


def test_zip_metadata_hidden_and_unknown_members_are_skipped_and_listed(tmp_path, bpe_tokenizer):
    from gm_graphs.build.counts import count_corpus

    docs = make_docs(30)
    path = tmp_path / "c.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("data/", b"")
        zf.writestr("data/reviews.csv", _csv_bytes(docs))
        zf.writestr("__MACOSX/data/._reviews.csv", b"\x00\x05\x16\x07 resource fork")
        zf.writestr("data/._reviews.csv", b"\x00\x05\x16\x07")
        zf.writestr(".DS_Store", b"\x00\x00\x00\x01Bud1")
        zf.writestr("README", b"About this data set.\n")
        zf.writestr("LICENSE.md", b"CC-BY\n")
    stats = ReadStats()
    assert _read(path, stats=stats) == docs
    skipped = sorted(m.split("!", 1)[1] for m in stats.skipped_members)
    assert skipped == [".DS_Store", "LICENSE.md", "README", "__MACOSX/data/._reviews.csv", "data/._reviews.csv"]
    assert all(m.startswith(f"{path}!") for m in stats.skipped_members)
    read = count_corpus(path, bpe_tokenizer, progress=False).read  # what the manifest's "corpus" records
    assert sorted(m.split("!", 1)[1] for m in read["skipped_members"]) == skipped


def test_zip_with_no_readable_member(tmp_path):
    path = tmp_path / "c.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("README", b"nothing here\n")
        zf.writestr("__MACOSX/._README", b"\x00")
    with pytest.raises(CorpusError, match=r"c\.zip' holds no corpus file \(skipped: 'README', '__MACOSX/\._README'\)"):
        expand_corpus(path)


def test_nested_and_encrypted_zip_members_are_refused(tmp_path):
    path = tmp_path / "c.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("inner.zip", b"PK")
    with pytest.raises(CorpusError, match="nested archives are not supported; unpack the inner archive"):
        expand_corpus(path)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("secret.csv", b"text\nx\n")
    data = bytearray(path.read_bytes())  # zipfile cannot encrypt: set the flag in both headers
    data[6] |= 0x1
    data[data.index(b"PK\x01\x02") + 8] |= 0x1
    path.write_bytes(bytes(data))
    with pytest.raises(CorpusError, match=r"c\.zip!secret\.csv is encrypted"):
        expand_corpus(path)


@pytest.mark.parametrize("column", [
    pa.array(["a b", "c d", "a b"]).dictionary_encode(),
    pa.array(["a b", "c d", "a b"], pa.large_string()),
    pa.array(["a b", "c d", "a b"], pa.string_view()),
    pa.array([b"a b", b"c d", b"a b"], pa.binary_view()),
    pa.array([b"a b", b"c d", b"a b"], pa.large_binary()),
    pa.array([b"a b", b"c d", b"a b"]).dictionary_encode(),
], ids=lambda a: str(a.type))
def test_parquet_text_column_types_are_read_as_text(tmp_path, column):
    pq.write_table(pa.table({"text": column}), tmp_path / "c.parquet")
    assert pq.read_schema(tmp_path / "c.parquet").field("text").type == column.type  # the type survived the file
    assert _read(tmp_path / "c.parquet") == ["a b", "c d", "a b"]


def test_parquet_string_column_with_invalid_utf8_is_replaced_and_counted(tmp_path):
    bad = pa.array([b"ok", b"caf\xe9"], pa.binary()).view(pa.string())  # pyarrow does not check string bytes
    pq.write_table(pa.table({"text": bad}), tmp_path / "c.parquet")
    stats = ReadStats()
    assert _read(tmp_path / "c.parquet", stats=stats) == ["ok", "caf\ufffd"]
    assert stats.undecodable_documents == 1 and stats.replaced_sequences == 1


@pytest.mark.parametrize("fmt,body", [
    ("jsonl", b'{"text": "first doc"}\n{"text": "second"}\n'),
    ("jsonl.gz", b'{"text": "first doc"}\n{"text": "second"}\n'),
    ("csv", b"text,n\nfirst doc,1\nsecond,2\n"),
    ("tsv", b"text\tn\nfirst doc\t1\nsecond\t2\n"),
    ("txt", b"first doc\nsecond\n"),
    ("txt.gz", b"first doc\nsecond\n"),
])
@pytest.mark.parametrize("jsonl_reader", JSONL_READERS)
def test_utf8_bom_is_not_part_of_the_first_field(tmp_path, fmt, body, jsonl_reader):
    data = b"\xef\xbb\xbf" + body
    path = tmp_path / f"c.{fmt}"
    path.write_bytes(gzip.compress(data) if fmt.endswith(".gz") else data)
    assert _read(path, jsonl_reader=jsonl_reader) == ["first doc", "second"]


def test_utf16_text_is_refused_with_the_conversion(tmp_path):
    (tmp_path / "c.txt").write_bytes("first doc\nsecond\n".encode("utf-16"))
    with pytest.raises(CorpusError, match=r"is UTF-16 text; convert it to UTF-8 \(e\.g\. iconv"):
        expand_corpus(tmp_path / "c.txt")


@pytest.mark.parametrize("fmt,body,expected", [
    ("txt", b"a\x00b\nplain\n", ["a\ufffdb", "plain"]),
    ("csv", b'text,n\n"a\x00b",1\nplain,2\n', ["a\ufffdb", "plain"]),
    ("jsonl", b'{"text": "a\x00b"}\n{"text": "plain"}\n', ["a\ufffdb", "plain"]),
    ("jsonl", b'{"text": "a\\u0000b"}\n{"text": "plain"}\n', ["a\ufffdb", "plain"]),
])
@pytest.mark.parametrize("jsonl_reader", JSONL_READERS)
def test_nul_characters_are_replaced_and_counted(tmp_path, fmt, body, expected, jsonl_reader):
    (tmp_path / f"c.{fmt}").write_bytes(body)
    stats = ReadStats()
    assert _read(tmp_path / f"c.{fmt}", stats=stats, jsonl_reader=jsonl_reader) == expected
    assert stats.nul_replaced == 1 and stats.documents == 2


@pytest.mark.parametrize("jsonl_reader", JSONL_READERS)
def test_undecodable_bytes_in_jsonl_and_lone_surrogates_are_replaced_and_counted(tmp_path, jsonl_reader):
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "caf\xe9"}\n{"text": "a\\ud800b"}\n{"text": "\\ud83d\\ude00"}\n')
    stats = ReadStats()
    got = _read(tmp_path / "c.jsonl", stats=stats, jsonl_reader=jsonl_reader)
    assert got == ["caf\ufffd", "a\ufffdb", "\U0001F600"]
    assert stats.undecodable_documents == 2 and stats.replaced_sequences == 2


def _outcome(path, jsonl_reader: str) -> tuple:
    """What reading gives: the documents and the stats, or the error."""
    stats = ReadStats()
    try:
        docs = _read(path, stats=stats, jsonl_reader=jsonl_reader)
    except CorpusError as e:
        return "refused", str(e)
    return "read", docs, stats


_text_value = st.text(st.characters(blacklist_categories=()), max_size=30) \
    | st.sampled_from(["a\ud800b", "\udfff", "x\x00y", "\ud83d\ude00", "", " ", "3", "[x]", "true", None])
_json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                      max_size=3), max_leaves=4)


@st.composite
def _jsonl_line(draw, readable: bool) -> bytes:
    """A line of a JSONL corpus. Readable: a record whose text may hold lone surrogates, NUL, text that looks like
    another JSON type, or null; or a blank line. Else a line that holds another type, misses the field, or is
    any bytes at all."""
    kind = draw(st.sampled_from(["text"] * 5 + ["blank"] if readable else ["value", "missing", "bytes"]))
    if kind == "blank":
        return draw(st.sampled_from([b"", b"  ", b"\t", b"\r", b"\x0c"]))
    if kind == "bytes":
        return draw(st.binary(max_size=24))
    if kind == "missing":
        record = draw(st.dictionaries(st.text(max_size=4).filter(lambda k: k != "text"), _json_value, max_size=3))
    else:
        record = draw(st.dictionaries(st.sampled_from(["id", "n"]), _json_value, max_size=2))
        record["text"] = draw(_text_value if kind == "text" else _json_value)
    return json.dumps(record, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")


@settings(max_examples=200)  # derandomized (conftest): the same 200 every run, enough to meet each case
@given(lines=st.lists(_jsonl_line(readable=True), min_size=1, max_size=25), bad=st.none() | _jsonl_line(readable=False),
       at=st.integers(0, 25), newline=st.sampled_from([b"\n", b"\r\n"]), bom=st.booleans(), last_break=st.booleans(),
       block=st.sampled_from([1, 24, 80, 8 << 20]))
def test_polars_jsonl_reader_reads_what_json_reads(tmp_path_factory, lines, bad, at, newline, bom, last_break, block):
    """Same documents and stats, or the same error (same line number), whatever the blocks Polars is given."""
    if bad is not None:
        lines.insert(at, bad)
    path = tmp_path_factory.mktemp("jsonl") / "c.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" * bom + newline.join(lines) + newline * last_break)
    saved, corpus_jsonl.BLOCK_BYTES = corpus_jsonl.BLOCK_BYTES, block
    try:
        assert _outcome(path, "polars") == _outcome(path, "json")
    finally:
        corpus_jsonl.BLOCK_BYTES = saved


def test_polars_jsonl_blocks_keep_line_numbers_and_hand_long_lines_over(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_jsonl, "BLOCK_BYTES", 64)
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(60)]
    lines[10] = json.dumps({"text": "long " * 100})  # longer than a block: from there on, read line by line
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert _read(path) == [json.loads(line)["text"] for line in lines]
    lines[10] = json.dumps({"text": "short"})
    lines[41] = '{"text": ["a list"]}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError, match=r"c\.jsonl: line 42: field 'text' holds list, not text"):
        _read(path)


def test_reading_csv_or_parquet_does_not_import_polars(csv_corpus):
    code = ("import sys; from gm_graphs.corpus.read import expand_corpus, iter_documents; "
            f"sum(map(len, iter_documents(expand_corpus({str(csv_corpus[0])!r})))); print('polars' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False"]


def test_files_of_a_graph_folder_are_refused(tmp_path, home):
    import json as _json

    graph = home / "graphs" / "g"
    graph.mkdir(parents=True)
    pq.write_table(pa.table({"text": ["x"]}), graph / "counts.parquet")
    with pytest.raises(CorpusError, match=r"counts\.parquet' is inside the graph folder .*narrow the glob"):
        expand_corpus(str(home / "**" / "*.parquet"))
    elsewhere = tmp_path / "mygraph"  # a graph folder given by path, outside $GRAPHMAX_HOME
    (elsewhere / "counts").mkdir(parents=True)
    (elsewhere / "manifest.json").write_text(_json.dumps({"format": "graphmax-graph"}))
    (elsewhere / "counts" / "edges.csv").write_text("text\nx\n")
    with pytest.raises(CorpusError, match=r"is inside the graph folder '.*mygraph'"):
        expand_corpus(elsewhere / "counts" / "edges.csv")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text('{"name": "a data set, not a graph"}')
    (tmp_path / "data" / "c.txt").write_text("a document\n")
    assert expand_corpus(tmp_path / "data" / "c.txt") == [tmp_path / "data" / "c.txt"]


def test_fifo_folder_named_like_a_file_and_broken_link_are_refused(tmp_path):
    # in a child process: opening a FIFO would block forever
    code = f"""
import os, sys
from gm_graphs.errors import CorpusError
from gm_graphs.corpus.read import expand_corpus
t = {str(tmp_path)!r}
os.mkfifo(os.path.join(t, "pipe.csv"))
os.mkdir(os.path.join(t, "folder.csv"))
os.symlink(os.path.join(t, "gone.csv"), os.path.join(t, "link.csv"))
open(os.path.join(t, "ok.csv"), "w").write("text\\nx\\n")
for spec in ("pipe.csv", "folder.csv", "link.csv", "*.csv"):
    try:
        expand_corpus(os.path.join(t, spec))
        print("accepted", spec)
    except CorpusError as e:
        print(str(e))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 4
    assert "pipe.csv' is a FIFO, not a regular file" in lines[0]
    assert "folder.csv' is a folder; pass the files in it" in lines[1]
    assert "link.csv' is a broken symbolic link" in lines[2]
    assert "folder.csv' is a folder" in lines[3]  # the glob matched the folder and the FIFO: refused, not skipped


def test_unreadable_file_is_refused():
    """chmod 000: as root (who reads anything) the check runs in a forked child that became `nobody`."""
    folder = Path(tempfile.mkdtemp(prefix="graphmax-perm-"))  # not under pytest's tmp, which only root may enter
    try:
        folder.chmod(0o755)
        path = folder / "c.csv"
        path.write_text("text\nx\n")
        path.chmod(0)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop root, check, report through the pipe, never return into pytest
            try:
                if os.geteuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                expand_corpus(path)
                os.write(write, b"accepted")
            except CorpusError as e:
                os.write(write, str(e).encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as fh:
            message = fh.read().decode()
        assert "c.csv' cannot be read (permission denied); make it readable (chmod u+r)" in message
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("name,match", [
    ("c.csv.bz2", "is a bzip2 file, which graphmax does not read; unpack it"),
    ("c.tar.gz", "is a tar file"),
    ("c.zip.gz", "is a gzip'd zip archive; gunzip it"),
])
def test_unsupported_compressions_name_the_fix(tmp_path, name, match):
    (tmp_path / name).write_bytes(gzip.compress(b"x"))
    with pytest.raises(CorpusError, match=match):
        expand_corpus(tmp_path / name)


_FUZZ = """
import gzip, io, json, random, sys, zipfile
from pathlib import Path
from gm_graphs.errors import CorpusError
from unittest import mock
from gm_graphs.corpus.readers import jsonl
from gm_graphs.corpus.read import ReadStats, expand_corpus, iter_documents
JSONL_READERS = ("polars", "json")
folder = Path(sys.argv[1])
rng = random.Random(int(sys.argv[2]))
outcomes, unexpected = {}, []
for good in sorted(folder.iterdir()):
    data = good.read_bytes()
    for trial in range(int(sys.argv[3])):
        bad = bytearray(data)
        kind = rng.choice(["truncate", "flip", "span", "insert"])
        at = rng.randrange(len(bad))
        if kind == "truncate":
            del bad[at:]
        elif kind == "flip":
            for _ in range(rng.randint(1, 8)):
                bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        elif kind == "span":
            bad[at:at + 64] = bytes(rng.randrange(256) for _ in range(64))
        else:
            bad[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        path = folder.parent / "mutant" / good.name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(bytes(bad))
        seen = {}
        for reader in (JSONL_READERS if good.suffix == ".jsonl" else JSONL_READERS[:1]):
            stats = ReadStats()
            try:
                with mock.patch.object(jsonl, "polars_jsonl_rows", jsonl.jsonl_rows if reader == "json" else
                                       jsonl.polars_jsonl_rows):
                    docs = [d for b in iter_documents(expand_corpus(path), stats=stats) for d in b]
                outcome, seen[reader] = "read", (docs, stats)
            except CorpusError as e:
                outcome, seen[reader] = "refused", str(e)
                if "\\n" in str(e):
                    unexpected.append(f"{good.name} {kind}: multi-line message {str(e)[:200]!r}")
            except Exception as e:
                outcome = seen[reader] = type(e).__name__
                unexpected.append(f"{good.name} {kind}@{at} ({reader}): {type(e).__name__}: {str(e)[:200]}")
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if len(set(map(repr, seen.values()))) > 1:
            unexpected.append(f"{good.name} {kind}@{at}: the JSONL readers disagree: {str(seen)[:300]}")
print(json.dumps({"outcomes": outcomes, "unexpected": unexpected}))
"""


def test_damaged_files_of_every_format_never_crash_or_raise_another_type(tmp_path):
    """Seeded random damage (truncation, flipped bits, overwritten or inserted bytes) to a file of each format;
    a damaged JSONL file is read by both JSONL readers, which must agree."""
    good = tmp_path / "good"
    good.mkdir()
    docs = make_docs(60)
    for fmt in ("csv", "tsv", "parquet", "jsonl", "txt", "csv.gz", "zip"):
        _write(good, fmt, docs).rename(good / f"c.{fmt}")
    for leftover in ("raw.csv", "a.jsonl", "b.jsonl"):
        (good / leftover).unlink(missing_ok=True)
    with zipfile.ZipFile(good / "members.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a.csv.gz", gzip.compress(_csv_bytes(docs)))
        zf.writestr("b.parquet", (good / "c.parquet").read_bytes())
    run = subprocess.run([sys.executable, "-c", _FUZZ, str(good), "0", "40"], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["unexpected"] == []
    assert result["outcomes"].get("refused", 0) > 0 and sum(result["outcomes"].values()) == 9 * 40
