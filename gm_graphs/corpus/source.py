"""What every corpus reader shares: one stream of text (a file or an archive member), what reading saw
(``ReadStats``), and the bounded, numbered lines of a line-based format with their decoding and checks."""

from __future__ import annotations

import gzip
import itertools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from gm_graphs.errors import CorpusError

MAX_DOCUMENT_BYTES = 32 << 20  # a longer line is not a document but a damaged file or a decompression bomb
REPLACEMENT = "\ufffd"
SURROGATE = re.compile("[\ud800-\udfff]")
UTF8_BOM = b"\xef\xbb\xbf"
MB = 1 << 20


@dataclass
class ReadStats:
    """What reading a corpus saw, filled in by :func:`iter_documents` (a build records it in the manifest).

    Args:
        documents (``int``, defaults to 0): non-empty documents yielded.
        empty_skipped (``int``, defaults to 0): empty documents skipped.
        undecodable_documents (``int``, defaults to 0): documents with bytes that are not UTF-8.
        replaced_sequences (``int``, defaults to 0): undecodable byte sequences replaced by U+FFFD.
        per_file (``dict[str, int]``, defaults to ``{}``): documents yielded by each file.
        nul_replaced (``int``, defaults to 0): NUL characters replaced by U+FFFD.
        skipped_members (``list[str]``, defaults to ``[]``): ``"archive.zip!member"`` of archive members in no
            corpus format (README, LICENSE), not read.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> tmp = tempfile.TemporaryDirectory()
        >>> corpus = Path(tmp.name) / "reviews.txt"
        >>> _ = corpus.write_text("great film\\n\\ndull\\n")
        >>> from gm_graphs import iter_documents
        >>> stats = ReadStats()
        >>> batches = list(iter_documents([corpus], stats=stats))
        >>> stats.documents, stats.empty_skipped
        (2, 1)
    """

    documents: int = 0
    empty_skipped: int = 0
    undecodable_documents: int = 0
    replaced_sequences: int = 0
    per_file: dict[str, int] = field(default_factory=dict)
    nul_replaced: int = 0
    skipped_members: list[str] = field(default_factory=list)  # "archive.zip!member" of no corpus format


def check_encoding(head: bytes, where: str) -> None:
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise CorpusError(f"{where!r} is UTF-16 text; convert it to UTF-8 "
                          f"(e.g. iconv -f UTF-16 -t UTF-8 IN > OUT) and pass that")


@dataclass(frozen=True)
class Source:
    """One stream of corpus text, a file or an archive member, and how to (re)open it decompressed."""

    name: str  # its suffixes give the format
    where: str  # for messages: the path, or archive!member
    opener: Callable[[], IO[bytes]]
    path: Path | None = None  # an uncompressed file, which pyarrow opens itself

    @contextmanager
    def open(self) -> Iterator[IO[bytes]]:
        with self.opener() as raw:
            if self.name.lower().endswith(".gz"):
                with gzip.GzipFile(fileobj=raw) as fh:
                    yield fh
            else:
                yield raw


def brief(e: BaseException, limit: int = 160) -> str:
    """An exception's message as one short line (pyarrow's can quote whole rows of data)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "…"


def decode(values: list[bytes | None], stats: ReadStats) -> list[str | None]:
    out: list[str | None] = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        try:
            out.append(v.decode("utf-8"))
        except UnicodeDecodeError:
            s = v.decode("utf-8", errors="replace")
            stats.undecodable_documents += 1
            stats.replaced_sequences += s.count(REPLACEMENT) - v.count(b"\xef\xbf\xbd")
            out.append(s)
    return out


def read_first_line(fh: IO[bytes], where: str) -> bytes:
    line = fh.readline(MAX_DOCUMENT_BYTES + 2)
    if len(line.rstrip(b"\r\n")) > MAX_DOCUMENT_BYTES:
        raise too_long(where, 1)
    check_encoding(line, where)
    return line[len(UTF8_BOM):] if line.startswith(UTF8_BOM) else line


def too_long(where: str, lineno: int) -> CorpusError:
    return CorpusError(f"{where}: line {lineno} is longer than {MAX_DOCUMENT_BYTES // MB} MB, which is not a "
                       f"document but a damaged file or a decompression bomb; split it into documents")


def source_lines(source: Source) -> Iterator[tuple[int, bytes]]:
    """Numbered lines of a source without their line breaks; a leading BOM is dropped, each line is bounded."""
    with source.open() as fh:
        for lineno in itertools.count(1):
            line = read_first_line(fh, source.where) if lineno == 1 else fh.readline(MAX_DOCUMENT_BYTES + 2)
            if not line:
                return
            body = line.rstrip(b"\r\n")
            if len(body) > MAX_DOCUMENT_BYTES:
                raise too_long(source.where, lineno)
            yield lineno, body


def no_surrogates(text: str, stats: ReadStats) -> str:
    """JSON's ``\\ud800`` escapes give lone surrogates, which no tokenizer can encode: replace them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        fixed, n = SURROGATE.subn(REPLACEMENT, text)
        stats.undecodable_documents += 1
        stats.replaced_sequences += n
        return fixed
