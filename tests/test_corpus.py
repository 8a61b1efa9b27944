"""Reading corpora: every format yields the same documents; bad input gets a clear error."""

from __future__ import annotations

import gzip
import zipfile

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gm_graphs import CorpusError
from gm_graphs.corpus import ReadStats, clean_review_text, expand_corpus, iter_documents

from .conftest import write_jsonl

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


def _read(path, **kw) -> list[str]:
    return [d for batch in iter_documents(expand_corpus(path), batch_docs=5, **kw) for d in batch]


@pytest.mark.parametrize("fmt", ["csv", "tsv", "parquet", "jsonl", "txt", "csv.gz", "zip"])
@given(docs=st.lists(_line_text, min_size=1, max_size=15))
def test_every_format_reads_back_the_documents(tmp_path_factory, fmt, docs):
    path = _write(tmp_path_factory.mktemp(fmt.replace(".", "")), fmt, docs)
    assert _read(path) == docs


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


def test_unknown_suffix(tmp_path):
    (tmp_path / "c.docx").write_text("x")
    with pytest.raises(CorpusError, match="cannot tell the format"):
        expand_corpus(tmp_path / "c.docx")


def test_missing_column_names_the_columns_and_the_fix(csv_corpus):
    path, _ = csv_corpus
    with pytest.raises(CorpusError, match=r"no column 'review'.*\['id', 'text'\].*--text-column"):
        _read(path, text_column="review")


def test_non_text_column(tmp_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "c.parquet")
    with pytest.raises(CorpusError, match="holds int64, not text"):
        _read(tmp_path / "c.parquet")


def test_jsonl_field_missing_or_not_text(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(CorpusError, match="line 2 has no field 'text'"):
        _read(tmp_path / "a.jsonl")
    (tmp_path / "b.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(CorpusError, match="holds int, not text"):
        _read(tmp_path / "b.jsonl")


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
