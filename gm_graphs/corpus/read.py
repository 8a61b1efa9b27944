"""Streaming corpus reading: files or globs of Parquet, CSV/TSV, JSONL or plain text.

Every reader yields batches of document strings and never holds a whole file:
Parquet and CSV go through pyarrow's batch readers; a plain JSONL file goes
through Polars in blocks of lines (``gm_graphs.corpus.jsonl``), which hands
Python's ``json`` every block it cannot vouch for; compressed or archived JSONL
and text are read in blocks of lines (``Lines``: runs of blank lines are skipped
a run at a time). No document is longer than ``MAX_DOCUMENT_BYTES`` (32 MB): a
longer line or Parquet/CSV value is refused in one line, whatever the reader; and
a batch holds about ``BATCH_BYTES`` (64 MB) of text at most, whatever its number
of documents.
Every file is opened by ``open_regular`` (never a FIFO or a device, which could
block forever) and handed to pyarrow open, never by name (a name need not be UTF-8).
Files may be gzip'd (``.gz``) or members of a ``.zip`` archive (members gzip'd
too); an archive's folders, macOS metadata (``__MACOSX/``, ``._x``), hidden
files and members of no corpus format (README, LICENSE) are skipped and listed
in ``ReadStats.skipped_members``.
Undecodable bytes and NUL characters are replaced by U+FFFD and counted; a
leading byte-order mark is dropped; empty documents are skipped and counted.
Anything unreadable (a truncated or corrupt file, a FIFO, a file without read
permission, a graph folder's own files) is a one-line ``CorpusError`` that
names the file and the fix.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import html
import io
import lzma
import os
import re
import stat
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from gm_graphs.corpus.source import (
    BATCH_BYTES,
    MAX_DOCUMENT_BYTES,
    MB,
    REPLACEMENT,
    Lines,
    Progress,
    ReadStats,
    Source,
    batches,
    brief,
    check_encoding,
    decode,
    not_regular,
    open_regular,
    read_first_line,
)
from gm_graphs.errors import CorpusError
from gm_graphs.store.folders import graphs_root, is_graph_folder

PathLike = str | os.PathLike
CorpusSpec = PathLike | Iterable[PathLike]

FORMATS = ("parquet", "csv", "tsv", "jsonl", "txt")
_SUFFIX_FORMAT = {
    ".parquet": "parquet", ".pq": "parquet",
    ".csv": "csv", ".tsv": "tsv",
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".txt": "txt", ".text": "txt",
}
# Compressions and archives people try, with what to do instead.
_UNSUPPORTED = {".bz2": "bzip2", ".xz": "xz", ".zst": "zstd", ".lz4": "lz4", ".tar": "tar", ".tgz": "tar",
                ".7z": "7-Zip", ".rar": "RAR"}
CSV_BLOCK_BYTES = 8 << 20  # pyarrow's block; a row must fit in one, so it grows (×4) up to a document's limit
_ZIP_METHODS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)
_COLUMN_COUNT = re.compile(r"Expected (\d+) columns, got (\d+): (.*)", re.DOTALL)


def clean_review_text(text: str) -> str:
    """Unescape HTML entities and turn ``<br />`` tags into spaces."""
    text = _BR.sub(" ", text)
    return html.unescape(text) if "&" in text else text


def expand_corpus(corpus: CorpusSpec) -> list[Path]:
    """Expand paths and globs into a de-duplicated list of readable corpus files (each glob's matches sorted).

    Each file is checked here, before anything is built: it exists, is a regular
    file that can be read, is not empty, has a known format whose header is
    intact, and is not inside a graph folder. A path that exists is that file, whatever characters its name
    holds (``reviews [2019].csv``, ``*.csv``); it is read as a glob only when no such file exists. Where an
    existing file's name, read as a glob, would match other files too, a ``UserWarning`` says so.

    Args:
        corpus (``str``, ``os.PathLike`` or an iterable of them): files or globs (``"data/*.csv.gz"``,
            ``"data/**/*.jsonl"``) of Parquet, CSV/TSV, JSONL or plain text, optionally gzip'd or in a ``.zip``.

    Returns:
        ``list[pathlib.Path]``: the files, in the order given, each once.

    Raises:
        CorpusError: no file given, a glob that matches nothing, or a file that cannot be read as a corpus (the
            message names the file and the fix).

    Example::

        >>> import tempfile; from pathlib import Path
        >>> tmp = tempfile.TemporaryDirectory()
        >>> for name in ("b.txt", "a.txt"):
        ...     _ = (Path(tmp.name) / name).write_text("the cat sat\\n")
        >>> [f.name for f in expand_corpus(Path(tmp.name) / "*.txt")]
        ['a.txt', 'b.txt']
    """
    specs = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    if not specs:
        raise CorpusError("no corpus files were given; pass one or more paths or globs")
    files: list[Path] = []
    for spec in specs:
        spec = os.fspath(spec)
        if glob.has_magic(spec) and not os.path.lexists(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise CorpusError(f"no file is named {spec!r}, and the glob {spec!r} matches no file; check the "
                                  f"path, the pattern and the folder")
            for m in matches:
                if os.path.isdir(m) and not _named_like_corpus(m):
                    continue  # `data/**` also matches folders
                files.append(Path(m))
        else:
            if glob.has_magic(spec):
                _warn_if_also_a_glob(spec)
            files.append(Path(spec))
    graphs = _GraphFolders()
    for f in files:
        _check_file(f, graphs)
    seen: set[Path] = set()
    return [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]


_WARNED_GLOBS: set[str] = set()


def _warn_if_also_a_glob(spec: str) -> None:
    """An existing file whose name reads as a glob is read alone; say so when the pattern names other files too.

    Said once per process and name: a command expands its corpus more than once (its arguments are checked before
    the work starts), and importing transformers resets the warnings' own once-only registry. The warning names
    no source line of graphmax's: it is about the user's file, not the code.
    """
    others = [m for m in glob.glob(spec, recursive=True) if os.path.realpath(m) != os.path.realpath(spec)]
    if others and spec not in _WARNED_GLOBS:
        _WARNED_GLOBS.add(spec)
        warnings.warn_explicit(f"{spec!r} is read as the file of that name; as a glob it would also match "
                               f"{len(others)} other file(s), e.g. {others[0]!r}: pass those by name to read them "
                               f"too", UserWarning, "graphmax", 0, module=__name__)


def detect_format(name: str) -> str:
    """The reader for a file name: its suffix after an optional ``.gz``."""
    lower = name.lower()
    if lower.endswith(".gz"):
        lower = lower[:-3]
    if lower.endswith(".zip"):
        return "zip"
    suffix = Path(lower).suffix
    fmt = _SUFFIX_FORMAT.get(suffix)
    if fmt is None:
        if suffix in _UNSUPPORTED:
            kind = _UNSUPPORTED[suffix]
            raise CorpusError(f"{name!r} is a {kind} file, which graphmax does not read; unpack it, "
                              f"or recompress the corpus files with gzip or zip")
        raise CorpusError(
            f"cannot tell the format of {name!r}; use one of the suffixes "
            f"{', '.join(sorted(_SUFFIX_FORMAT))} (optionally .gz), or .zip"
        )
    return fmt


def _named_like_corpus(path: str) -> bool:
    try:
        detect_format(os.path.basename(path.rstrip(os.sep)))
    except CorpusError:
        return False
    return True


class _GraphFolders:
    """Tells whether a file lies inside a graph folder: graphmax's own files are never corpus text."""

    def __init__(self) -> None:
        self.graphs_root = graphs_root().resolve()
        self._seen: dict[Path, Path | None] = {}

    def of(self, path: Path) -> Path | None:
        return self._folder(path.resolve().parent)

    def _folder(self, d: Path) -> Path | None:
        if d not in self._seen:  # each folder is looked at once, whatever the number of files in it
            if d == self.graphs_root or is_graph_folder(d):
                self._seen[d] = d
            else:
                self._seen[d] = None if d.parent == d else self._folder(d.parent)
        return self._seen[d]


def _check_file(f: Path, graphs: _GraphFolders) -> None:
    """Refuse, with the fix, a corpus path that cannot be read as one; never opens a FIFO or a device."""
    where = str(f)
    try:
        st = os.stat(f)
    except FileNotFoundError:
        if os.path.islink(f):
            raise CorpusError(f"corpus file {where!r} is a broken symbolic link; point it at the file or remove it") \
                from None
        raise CorpusError(f"corpus file {where!r} does not exist; check the path") from None
    except OSError as e:
        raise CorpusError(f"corpus file {where!r} cannot be reached ({e.strerror}); check the path") from None
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(where, st.st_mode)
    if st.st_size == 0:
        raise CorpusError(f"corpus file {where!r} is empty (0 bytes); remove it from the inputs")
    fmt = detect_format(f.name)
    graph = graphs.of(f)
    if graph is not None:
        raise CorpusError(f"{where!r} is inside the graph folder {str(graph)!r}, whose files are graphmax's own, "
                          f"not corpus text; narrow the glob or list the corpus files")
    try:
        with open_regular(f) as fh:
            _check_header(fh, f, fmt, st.st_size)
    except PermissionError:
        raise CorpusError(f"corpus file {where!r} cannot be read (permission denied); make it readable "
                          f"(chmod u+r) or remove it from the inputs") from None
    except OSError as e:
        raise CorpusError(f"corpus file {where!r} cannot be read ({e.strerror or e}); check the file") from None


def _check_header(fh: IO[bytes], f: Path, fmt: str, size: int) -> None:
    """Cheap checks of a file's first (and for Parquet last) bytes, so a wrong file fails before any work."""
    where = str(f)
    if fmt == "zip":
        if f.name.lower().endswith(".gz"):
            raise CorpusError(f"{where!r} is a gzip'd zip archive; gunzip it and pass the .zip")
        with _open_zip(fh, where) as zf:
            _zip_members(zf, where)
        return
    if f.name.lower().endswith(".gz"):
        if fh.read(2) != b"\x1f\x8b":
            raise CorpusError(f"{where!r} is not gzip-compressed (no gzip header); "
                              f"remove the .gz suffix if it is not compressed")
        fh.seek(0)
        with _decompression_errors(where):
            head = gzip.GzipFile(fileobj=fh).read(4)
    else:
        head = fh.read(4)
        if fmt == "parquet":
            fh.seek(max(size - 4, 0))
            if head != b"PAR1" or fh.read(4) != b"PAR1":
                raise CorpusError(f"{where!r} is not a whole Parquet file (no PAR1 marker at its start and end); "
                                  f"copy it again if it was truncated, or rename it to its real format")
            try:  # the footer: schema and row groups, a small read at the end
                fh.seek(0)
                _ = pq.ParquetFile(fh).schema_arrow
            except (pa.ArrowException, OSError) as e:
                raise CorpusError(f"{where!r} is not a readable Parquet file ({brief(e)}); copy it again if it "
                                  f"was truncated, or rename it to its real format") from None
    if fmt != "parquet":
        check_encoding(head, where)


@contextmanager
def _open_zip(fh: IO[bytes], where: str) -> Iterator[zipfile.ZipFile]:
    try:
        zf = zipfile.ZipFile(fh)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, struct.error) as e:
        raise CorpusError(f"{where!r} is not a readable zip archive ({brief(e)}); copy it again if it was "
                          f"truncated, or rename it to its real format") from None
    with zf:
        yield zf


def _zip_members(zf: zipfile.ZipFile, where: str) -> tuple[list[zipfile.ZipInfo], list[str]]:
    """The members to read, in name order, and those skipped (metadata, hidden files, other formats)."""
    readable, skipped = [], []
    for info in sorted(zf.infolist(), key=lambda i: i.filename):
        if info.is_dir():
            continue
        name = info.filename
        parts = name.split("/")
        if any(p.startswith(".") or p == "__MACOSX" for p in parts):
            skipped.append(name)
            continue
        try:
            fmt = detect_format(parts[-1])
        except CorpusError:
            skipped.append(name)
            continue
        if fmt == "zip":
            raise CorpusError(f"{where}!{name}: nested archives are not supported; unpack the inner archive")
        if info.flag_bits & 0x1:
            raise CorpusError(f"{where}!{name} is encrypted; unpack it with its password and pass the files")
        if info.compress_type not in _ZIP_METHODS:
            raise CorpusError(f"{where}!{name} uses zip compression method {info.compress_type}, which Python "
                              f"cannot read; re-create the archive with the default (deflate)")
        readable.append(info)
    if not readable:
        shown = ", ".join(repr(s) for s in skipped[:5]) + (", …" if len(skipped) > 5 else "")
        raise CorpusError(f"the archive {where!r} holds no corpus file (skipped: {shown or 'nothing'}); "
                          f"add .parquet/.csv/.tsv/.jsonl/.txt members")
    return readable, skipped


def fingerprint(files: list[Path]) -> list[dict]:
    """Path, size and SHA-256 of each input file, for the manifest.

    A name that is not UTF-8 (Linux allows any bytes but ``/``) is recorded with its odd bytes escaped as
    ``\\xe9``, so that the manifest stays UTF-8 text."""
    out = []
    for f in files:
        with _reading(f) as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
            size = os.fstat(fh.fileno()).st_size
        out.append({"path": printable_path(f), "bytes": size, "sha256": digest})
    return out


def text_bytes(files: list[Path]) -> int:
    """The bytes of text reading ``files`` hands the readers, as far as the files say before they are read (for a
    progress bar): a plain file's size, a gzip file's inflated size from its trailer (modulo 4 GiB), a zip's
    readable members' inflated sizes from its directory."""
    total = 0
    for f in files:
        with _reading(f) as fh:
            size = os.fstat(fh.fileno()).st_size
            if detect_format(f.name) == "zip":
                with _decompression_errors(str(f)), _open_zip(fh, str(f)) as zf:
                    total += sum(info.file_size for info in _zip_members(zf, str(f))[0])
            elif f.name.lower().endswith(".gz") and size >= 4:
                fh.seek(size - 4)
                total += int.from_bytes(fh.read(4), "little")
            else:
                total += size
    return total


def printable_path(path: PathLike) -> str:
    """``path`` as UTF-8 text: the bytes of a name that is not UTF-8 escaped as ``\\xe9``."""
    return os.fsencode(path).decode("utf-8", errors="backslashreplace")


@contextmanager
def _reading(f: Path) -> Iterator[IO[bytes]]:
    """A corpus file opened to be read (a regular file: anything else is refused without blocking)."""
    with _decompression_errors(str(f)):
        fh = open_regular(f)
    with fh:
        yield fh


def duplicate_files(files: list[Path]) -> list[list[Path]]:
    """The groups of ``files`` that hold the same bytes (by SHA-256), each in the order given: a copy of a file
    would have every document in it counted twice. Only files of one size are hashed."""
    by_size: dict[int, list[Path]] = {}
    for f in files:
        by_size.setdefault(os.stat(f).st_size, []).append(f)
    groups = []
    for same_size in by_size.values():
        if len(same_size) < 2:
            continue
        by_digest: dict[str, list[Path]] = {}
        for f in same_size:
            with _reading(f) as fh:
                by_digest.setdefault(hashlib.file_digest(fh, "sha256").hexdigest(), []).append(f)
        groups.extend(g for g in by_digest.values() if len(g) > 1)
    return sorted(groups, key=lambda g: files.index(g[0]))


def check_distinct(files: list[Path]) -> None:
    """Refuse corpus files that hold the same bytes, in one line that names them and the fix."""
    groups = duplicate_files(files)
    if groups:
        first = groups[0]
        more = f" (and {len(groups) - 1} more group(s) of copies)" if len(groups) > 1 else ""
        raise CorpusError(f"the corpus files {', '.join(repr(str(f)) for f in first)} hold the same bytes{more}, so "
                          f"every document in them would be counted {len(first)} times; pass each file once, or "
                          f"add --allow-duplicate-files (allow_duplicate_files=True in Python) to count the copies "
                          f"on purpose")


def iter_documents(
    files: list[Path],
    text_column: str = "text",
    *,
    clean: bool = False,
    batch_docs: int = 4096,
    stats: ReadStats | None = None,
    progress: Progress | None = None,
) -> Iterator[list[str]]:
    """Yield batches of non-empty documents from ``files``, in order, never holding a whole file.

    Args:
        files (``list[pathlib.Path]``): corpus files, as :func:`expand_corpus` returns them (checked).
        text_column (``str``, defaults to ``"text"``): the column (Parquet, CSV/TSV) or key (JSONL) holding the
            text; plain text files are one document per line.
        clean (``bool``, defaults to ``False``): unescape HTML entities and turn ``<br />`` tags into spaces.
        batch_docs (``int``, defaults to 4096): documents per batch (a Parquet batch may differ).
        stats (``ReadStats`` or ``None``, defaults to ``None``): filled in with what reading saw.
        progress (callable or ``None``, defaults to ``None``): told the bytes of text each read takes from a file
            (decompressed: an archive's inflated bytes), from the thread that reads, so that a caller can show
            progress within a file, and while a file yields no document (a flood of empty lines).

    Returns:
        ``Iterator[list[str]]``: batches of documents; empty documents are skipped and counted.

    Raises:
        CorpusError: a file that cannot be read (or is not a regular file), a missing text column, a document
            longer than ``MAX_DOCUMENT_BYTES`` (32 MB), or a corpus with no documents at all.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> tmp = tempfile.TemporaryDirectory()
        >>> corpus = Path(tmp.name) / "reviews.csv"
        >>> _ = corpus.write_text("text,label\\ngreat film,1\\ndull &amp; long<br />,0\\n")
        >>> list(iter_documents(expand_corpus(corpus), "text", clean=True))
        [['great film', 'dull & long ']]
    """
    stats = stats if stats is not None else ReadStats()
    for f in files:
        before = stats.documents
        if detect_format(f.name) == "zip":
            with _reading(f) as fh, _decompression_errors(str(f)), _open_zip(fh, str(f)) as zf:
                members, skipped = _zip_members(zf, str(f))
                stats.skipped_members.extend(f"{printable_path(f)}!{m}" for m in skipped)
                for info in members:
                    source = Source(info.filename, f"{f}!{info.filename}", lambda info=info: zf.open(info),
                                    progress=progress)
                    yield from _read(source, text_column, clean, batch_docs, stats)
        else:
            plain = f if not f.name.lower().endswith(".gz") else None
            source = Source(f.name, str(f), lambda f=f: open_regular(f), path=plain, progress=progress)
            yield from _read(source, text_column, clean, batch_docs, stats)
        stats.per_file[printable_path(f)] = stats.documents - before
    if stats.documents == 0:
        raise CorpusError(
            f"the corpus has no documents: every row of {[str(f) for f in files]} was empty "
            f"(text column {text_column!r}); check the files and --text-column"
        )


@contextmanager
def _decompression_errors(where: str) -> Iterator[None]:
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


def _read(source: Source, column: str, clean: bool, batch_docs: int, stats: ReadStats) -> Iterator[list[str]]:
    fmt = detect_format(source.name)
    where = source.where
    raw: Iterator[list[str | None]]
    with _decompression_errors(where):
        if fmt == "parquet":
            raw = _parquet_rows(source, column, batch_docs, stats)
        elif fmt in ("csv", "tsv"):
            raw = _csv_rows(source, column, "\t" if fmt == "tsv" else ",", stats)
        elif fmt == "jsonl" and source.path is not None:
            from gm_graphs.corpus.jsonl import polars_jsonl_rows  # imports polars, which only these files need

            raw = polars_jsonl_rows(source, column, batch_docs, stats)
        elif fmt == "jsonl":
            from gm_graphs.corpus.jsonl import jsonl_rows

            raw = jsonl_rows(source, column, batch_docs, stats)
        else:
            raw = _text_rows(source, batch_docs, stats)
        for rows in raw:
            docs = []
            for d in rows:
                if not d or d.isspace():
                    stats.empty_skipped += 1
                    continue
                if "\x00" in d:  # not text, and C code downstream may stop at it
                    stats.nul_replaced += d.count("\x00")
                    d = d.replace("\x00", REPLACEMENT)
                docs.append(clean_review_text(d) if clean else d)
            stats.documents += len(docs)
            for i in range(0, len(docs), batch_docs):
                yield docs[i:i + batch_docs]


def _unpacked(arr: pa.Array) -> pa.Array:
    """A text column as plain (large) strings or bytes: what pyarrow's length kernels take."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if pa.types.is_string_view(arr.type):
        return arr.cast(pa.large_string())
    if pa.types.is_binary_view(arr.type):
        return arr.cast(pa.large_binary())
    return arr


def _refuse_longer(sizes: pa.Array, where: str, first_row: int | None) -> None:
    """Refuse a value longer than ``MAX_DOCUMENT_BYTES``, as the line and CSV readers refuse such a line, before
    it becomes a Python string (and many times its size in the tokenizer). ``sizes``: the values' bytes."""
    largest = pc.max(sizes).as_py()
    if largest is not None and largest > MAX_DOCUMENT_BYTES:
        row = "" if first_row is None else f"row {first_row + pc.index(sizes, largest).as_py():,} "
        raise CorpusError(f"{where}: {row}holds a value of {largest / MB:,.0f} MB, longer than a document's "
                          f"{MAX_DOCUMENT_BYTES // MB} MB, which is not a document but a damaged file or a "
                          f"decompression bomb; split it into documents")


def arrow_text(arr: pa.Array, stats: ReadStats, where: str = "the corpus") -> list[str | None]:
    """The values of a text column as strings, each at most ``MAX_DOCUMENT_BYTES`` (a longer one is refused)."""
    if not pa.types.is_null(arr.type):
        _refuse_longer(pc.binary_length(_unpacked(arr)), where, None)
    return _strings(arr, stats)


def _strings(arr: pa.Array, stats: ReadStats) -> list[str | None]:
    # Fast path: a valid UTF-8 column converts in C; only a bad batch is decoded row by row.
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    try:
        if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
            arr = arr.cast(pa.large_string())  # binary and views; validates UTF-8
        return arr.to_pylist()
    except (pa.ArrowInvalid, UnicodeDecodeError):  # a string column's bytes are not checked by pyarrow
        return decode(arr.cast(pa.large_binary()).to_pylist(), stats)


def _is_text_type(typ: pa.DataType) -> bool:
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    return (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ)
            or pa.types.is_binary(typ) or pa.types.is_large_binary(typ) or pa.types.is_binary_view(typ)
            or pa.types.is_null(typ))


def _check_column_type(typ: pa.DataType, where: str, column: str) -> None:
    if not _is_text_type(typ):
        raise CorpusError(
            f"{where}: column {column!r} holds {typ}, not text; pass the text column with --text-column"
        )


def _missing_column(where: str, column: str, names: list[str]) -> CorpusError:
    return CorpusError(
        f"{where}: no column {column!r}; the columns are {names}; pass the text column with --text-column"
    )


def _text_values(arr: pa.Array, stats: ReadStats, where: str, first_row: int) -> list[str | None]:
    """A batch of a text column's values as strings, each at most ``MAX_DOCUMENT_BYTES`` (``first_row``: the
    file's row number of the first); empty and null values are counted and dropped by pyarrow, so that a file of
    millions of empty values costs no Python step each."""
    if pa.types.is_null(arr.type):
        stats.empty_skipped += len(arr)
        return []
    arr = _unpacked(arr)
    sizes = pc.binary_length(arr)
    _refuse_longer(sizes, where, first_row)
    filled = pc.fill_null(pc.greater(sizes, 0), False)
    kept = pc.sum(filled).as_py() or 0
    if kept < len(arr):
        stats.empty_skipped += len(arr) - kept
        arr = arr.filter(filled)
    return _strings(arr, stats)


def _rows_per_batch(metadata: pq.FileMetaData, column: str, batch_docs: int, where: str) -> int:
    """Rows of text to read at a time: ``batch_docs``, or fewer where the footer says a row holds so much text that
    they would be more than ``BATCH_BYTES``. A row group whose text holds more bytes than its rows could as
    documents is refused from the footer alone: one of its values is longer than ``MAX_DOCUMENT_BYTES``, and
    reading it would cost several times its size. (A long value among many short ones passes this and is refused
    as it is read.)"""
    most = 0.0  # bytes of text per row, in the row group that holds the most
    for i in range(metadata.num_row_groups):
        group = metadata.row_group(i)
        for k in range(group.num_columns):
            chunk = group.column(k)
            if chunk.path_in_schema != column or not group.num_rows:
                continue
            if chunk.total_uncompressed_size > group.num_rows * MAX_DOCUMENT_BYTES + MB:  # + page headers
                raise CorpusError(f"{where}: row group {i} holds {chunk.total_uncompressed_size / MB:,.0f} MB of "
                                  f"text in {group.num_rows:,} row(s), so a value is longer than a document's "
                                  f"{MAX_DOCUMENT_BYTES // MB} MB, which is not a document but a damaged file or a "
                                  f"decompression bomb; split it into documents")
            most = max(most, chunk.total_uncompressed_size / group.num_rows)
    return max(1, min(batch_docs, int(BATCH_BYTES // most))) if most else batch_docs


def _parquet_rows(source: Source, column: str, batch_docs: int,
                  stats: ReadStats) -> Iterator[list[str | None]]:
    where = source.where
    with source.open() as fh:
        try:
            pf = pq.ParquetFile(fh)
            names = pf.schema_arrow.names
        except (pa.ArrowException, OSError) as e:
            if isinstance(e, gzip.BadGzipFile):
                raise
            raise CorpusError(f"{where}: not a readable Parquet file ({brief(e)}); copy it again if it was "
                              f"truncated, or rename it to its real format") from None
        if column not in names:
            raise _missing_column(where, column, names)
        _check_column_type(pf.schema_arrow.field(column).type, where, column)
        rows = _rows_per_batch(pf.metadata, column, batch_docs, where)
        try:
            row = 1
            for batch in pf.iter_batches(batch_size=rows, columns=[column]):
                yield _text_values(batch.column(0), stats, where, row)
                row += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            if isinstance(e, gzip.BadGzipFile):
                raise
            raise CorpusError(f"{where}: damaged Parquet data ({brief(e)}); copy the file again or "
                              f"re-create it") from None


def _csv_rows(source: Source, column: str, delimiter: str, stats: ReadStats) -> Iterator[list[str | None]]:
    """The text column of a CSV/TSV; a row larger than pyarrow's block reopens the file with a larger one.

    Rows already yielded are skipped after a reopen, so nothing is counted twice. pyarrow reads the file through
    ``_Replay`` (the header line, read here first, then the rest), never by its name: a name need not be UTF-8.
    """
    kind = "TSV" if delimiter == "\t" else "CSV"
    block, done = CSV_BLOCK_BYTES, 0
    while True:
        with source.open() as fh:
            header = read_first_line(fh, source.where)
            names = _header_names(header, delimiter, source.where, kind)
            if column not in names:
                raise _missing_column(source.where, column, names)
            last = names[-1]
            parse = pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
            # The text is read as binary so that undecodable bytes are replaced instead of failing the batch;
            # the last column too, to tell a quote left open at the end of the file.
            wanted = list(dict.fromkeys([column, last]))
            convert = pacsv.ConvertOptions(include_columns=wanted, column_types={c: pa.binary() for c in wanted})
            body = _Replay(header, fh)
            rows, tail_value, reader = 0, None, None
            try:
                reader = pacsv.open_csv(body, read_options=pacsv.ReadOptions(block_size=block),
                                        parse_options=parse, convert_options=convert)
                for batch in reader:
                    n = batch.num_rows
                    skip = min(max(done - rows, 0), n)
                    rows += n
                    if n:
                        tail_value = batch.column(last)[n - 1].as_py()
                    if skip < n:
                        yield _text_values(batch.column(column).slice(skip), stats, source.where, rows - n + skip + 1)
                        done = rows
            except pa.ArrowException as e:
                if "straddl" in str(e) and block < MAX_DOCUMENT_BYTES:
                    block = min(4 * block, MAX_DOCUMENT_BYTES)
                    continue
                if isinstance(e, OSError):
                    raise  # reading failed, not parsing: the caller names it
                raise _csv_error(source.where, kind, e) from None
            finally:
                # pyarrow reads ahead from a Python stream in its own threads: a reader left for the interpreter's
                # exit to free (an error's traceback holds this frame) aborts the process, so drop it here.
                reader = None
            tail = body.tail
            if tail_value and (b"\n" in tail_value or b"\r" in tail_value) and not tail.rstrip(b"\r\n").endswith(b'"'):
                raise CorpusError(f"{source.where}: a quote opened in the last row is never closed, so its field "
                                  f"runs to the end of the file; close the quote, or double it (\"\") inside a field")
            return


def _csv_error(where: str, kind: str, e: pa.ArrowException) -> CorpusError:
    if "straddl" in str(e):
        return CorpusError(f"{where}: a row is longer than {MAX_DOCUMENT_BYTES // MB} MB, most likely a quote "
                           f"that is never closed; close the quote, or split the documents")
    columns = _COLUMN_COUNT.search(str(e))
    if columns:
        expected, got, start = columns.groups()
        return CorpusError(f"malformed {kind} {where}: a row has {got} field(s) where the header has {expected} "
                           f"(it starts {brief(start, 40)!r}); a quote that is never closed or an unquoted "
                           f"delimiter: fix the quoting of that row")
    return CorpusError(f"malformed {kind} {where} ({brief(e)}); fix the file or convert it to JSONL or Parquet")


def _header_names(header: bytes, delimiter: str, where: str, kind: str) -> list[str]:
    parse = pacsv.ParseOptions(delimiter=delimiter)
    try:
        table = pacsv.read_csv(io.BytesIO(header), parse_options=parse,
                               read_options=pacsv.ReadOptions(autogenerate_column_names=True))
    except pa.ArrowInvalid as e:
        raise CorpusError(f"malformed {kind} {where}: its header line cannot be parsed ({brief(e)}); "
                          f"fix the first line") from None
    names = ["" if n is None else n for n in next(iter(table.to_pylist()), {}).values()]  # None: an empty name
    if not all(isinstance(n, str) for n in names):  # pyarrow reads a header that is not UTF-8 as binary
        raise CorpusError(f"{where}: the header line is not UTF-8 text; save the file as UTF-8")
    return names


class _Replay(io.RawIOBase):
    """A stream that replays an already-read header before the rest of ``fh``, and keeps its last bytes.

    pyarrow reads it a block at a time with ``read(n)``, which hands over the
    underlying stream's bytes without another copy.
    """

    def __init__(self, head: bytes, fh: IO[bytes]):
        self._head, self._fh = head, fh
        self.tail = head[-256:]

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self._head:
            data = self._head if n < 0 else self._head[:n]
            self._head = self._head[len(data):]
            return data
        data = self._fh.read(n)
        if data:
            self.tail = (self.tail + data[-256:])[-256:]
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)


def _text_rows(source: Source, batch_docs: int, stats: ReadStats) -> Iterator[list[str | None]]:
    """A document a line; blank lines are counted as empty documents, a run at a time (``Lines``)."""
    lines = Lines(source)
    for rows in batches((line for _, line in lines), batch_docs):
        yield decode(rows, stats)
    stats.empty_skipped += lines.blank
