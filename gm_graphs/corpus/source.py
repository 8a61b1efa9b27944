"""What every corpus reader shares: one stream of text (a file or an archive member), what reading saw
(``ReadStats``), and the bounded, numbered lines of a line-based format with their decoding and checks."""

from __future__ import annotations

import gzip
import io
import lzma
import os
import re
import stat
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

from gm_graphs.errors import CorpusError

MAX_DOCUMENT_BYTES = 32 << 20  # a longer line is not a document but a damaged file or a decompression bomb
LINE_BLOCK_BYTES = 1 << 20  # what the line readers read at a time
BATCH_BYTES = 64 << 20  # about the most text in one batch of documents, whatever their number
# A block whose lines average fewer bytes than this is mostly blank: its lines with text are searched for, so that
# a run of blank lines costs C's time, not a Python step each.
_SPARSE_LINE_BYTES = 16
_TEXT_BYTE = re.compile(rb"[^ \t\n\r\x0b\x0c]")  # what bytes.isspace() is not
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


T = TypeVar("T")
Progress = Callable[[int], None]  # told the bytes of text each read hands a reader (decompressed)


def not_regular(where: str, mode: int) -> CorpusError:
    if stat.S_ISDIR(mode):
        return CorpusError(f"{where!r} is a folder; pass the files in it, e.g. {os.path.join(where, '*.csv')!r}")
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return CorpusError(f"{where!r} is {kind}, not a regular file; write the corpus to a file and pass that")


def open_regular(path: Path) -> IO[bytes]:
    """``path`` opened for reading, if it is a regular file; anything else is a one-line ``CorpusError``.

    It is opened without blocking and checked on the descriptor: opening a FIFO for reading waits for a writer,
    forever, and a file checked before may have been replaced since. ``OSError`` (missing, no permission) is left
    to the caller, which knows what the file is for.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(os.fsdecode(path), mode)
        os.set_blocking(fd, True)
        raw = io.FileIO(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    return io.BufferedReader(raw)


class _Tally:
    """A stream that tells ``progress`` the bytes each read hands over, and is otherwise the stream itself."""

    def __init__(self, stream: IO[bytes], progress: Progress):
        self._stream, self._progress = stream, progress

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._progress(len(data))
        return data

    def readline(self, size: int = -1) -> bytes:
        data = self._stream.readline(size)
        self._progress(len(data))
        return data

    def readinto(self, buffer) -> int:
        n = self._stream.readinto(buffer)
        self._progress(n or 0)
        return n

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


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
    path: Path | None = None  # an uncompressed file (a plain JSONL file is read by Polars, in blocks)
    progress: Progress | None = None  # told the decompressed bytes of each read

    @contextmanager
    def open(self) -> Iterator[IO[bytes]]:
        with self.opener() as raw:
            if self.name.lower().endswith(".gz"):
                with gzip.GzipFile(fileobj=raw) as fh:
                    yield fh if self.progress is None else _Tally(fh, self.progress)
            else:
                yield raw if self.progress is None else _Tally(raw, self.progress)


@contextmanager
def decompression_errors(where: str) -> Iterator[None]:
    """Turn what a damaged file raises while it is read into one CorpusError naming the file and the fix."""
    try:
        yield
    except CorpusError:
        raise
    except EOFError:
        raise CorpusError(f"{where}: the compressed data ends early (the file is truncated); "
                          f"copy or download it again") from None
    except gzip.BadGzipFile as e:
        raise CorpusError(f"{where}: not valid gzip data ({brief(e)}); copy or download it again, "
                          f"or remove the .gz suffix if it is not compressed") from None
    except (zlib.error, zipfile.BadZipFile, lzma.LZMAError, struct.error, UnicodeDecodeError) as e:
        raise CorpusError(f"{where}: corrupt compressed data ({brief(e)}); copy or download it again") from None
    except PermissionError:
        raise CorpusError(f"{where}: cannot be read (permission denied); make it readable (chmod u+r)") from None
    except FileNotFoundError:
        raise CorpusError(f"{where}: no longer exists (moved or removed while graphmax read the corpus); put it "
                          f"back, or leave it out") from None
    except OSError as e:
        raise CorpusError(f"{where}: cannot be read ({brief(e)}); check the file") from None


def printable_path(path: str | os.PathLike) -> str:
    """``path`` as UTF-8 text: the bytes of a name that is not UTF-8 escaped as ``\\xe9``."""
    return os.fsencode(path).decode("utf-8", errors="backslashreplace")


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


class Lines:
    """The numbered lines of a source that hold more than ASCII white space, without their line breaks, as
    ``(line number, bytes)``; a leading byte-order mark is dropped and each line is bounded.

    The source is read in blocks of ``LINE_BLOCK_BYTES``, and the blank lines between two lines with text are
    skipped and counted (``blank``) in C, a run at a time: a flood of empty lines (an archive of newlines
    inflates to hundreds of MB) is read in seconds, not a Python step a line.
    """

    def __init__(self, source: Source):
        self.source = source
        self.blank = 0  # blank lines skipped so far

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        where = self.source.where
        with self.source.open() as fh:
            data = fh.read(LINE_BLOCK_BYTES)
            check_encoding(data, where)
            data = data[len(UTF8_BOM):] if data.startswith(UTF8_BOM) else data
            lineno, partial, size = 1, [], 0  # partial: the pieces of a line whose end is not read yet, size bytes
            while data:
                cut = data.rfind(b"\n") + 1
                if cut:
                    block = b"".join([*partial, data[:cut]]) if partial else data[:cut]
                    yield from self.lines_of(block, lineno)
                    lineno += block.count(b"\n")
                    partial, size = [], 0
                if cut < len(data):
                    partial.append(data[cut:])
                    size += len(data) - cut
                    if size > MAX_DOCUMENT_BYTES + 1:  # + a \r before the line break
                        raise too_long(where, lineno)
                data = fh.read(LINE_BLOCK_BYTES)
            if partial:  # the last line has no line break
                yield from self.lines_of(b"".join(partial) + b"\n", lineno)

    def lines_of(self, block: bytes, first: int) -> Iterator[tuple[int, bytes]]:
        """The lines with text of ``block``, whole lines read from this source, the first numbered ``first``."""
        where = self.source.where
        if block.count(b"\n") * _SPARSE_LINE_BYTES > len(block):
            pos, lineno, search = 0, first, _TEXT_BYTE.search
            while (m := search(block, pos)) is not None:
                start = block.rfind(b"\n", pos, m.start()) + 1 or pos
                skipped = block.count(b"\n", pos, start)
                self.blank += skipped
                lineno += skipped
                end = block.index(b"\n", m.start())
                body = block[start:end].rstrip(b"\r")
                if len(body) > MAX_DOCUMENT_BYTES:
                    raise too_long(where, lineno)
                yield lineno, body
                lineno, pos = lineno + 1, end + 1
            self.blank += block.count(b"\n", pos)
            return
        lines = block.split(b"\n")
        lines.pop()  # the block ends with a line break
        for lineno, line in enumerate(lines, first):
            body = line.rstrip(b"\r")
            if not body or body.isspace():
                self.blank += 1
                continue
            if len(body) > MAX_DOCUMENT_BYTES:
                raise too_long(where, lineno)
            yield lineno, body


def batches(items: Iterable[T], batch_docs: int) -> Iterator[list[T]]:
    """``items`` in lists of at most ``batch_docs`` items and about ``BATCH_BYTES`` of text: a batch of 4,096 lines
    of 32 MB each would be 128 GB."""
    batch: list[T] = []
    size = 0
    for item in items:
        batch.append(item)
        size += len(item) if item is not None else 0
        if len(batch) >= batch_docs or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def source_lines(source: Source) -> Iterator[tuple[int, bytes]]:
    """The numbered lines of ``source`` that hold text (``Lines``), for a reader that counts no blank line."""
    return iter(Lines(source))


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
