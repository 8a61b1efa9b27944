"""Streaming corpus reading: files or globs of Parquet, CSV/TSV, JSONL or plain text.

Every reader yields batches of document strings and never holds a whole file:
Parquet and CSV go through pyarrow's batch readers, JSONL and text line by line.
Files may be gzip'd (``.gz``) or members of a ``.zip`` archive. Undecodable bytes
are replaced by U+FFFD and counted; empty documents are skipped and counted.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import html
import io
import json
import os
import re
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from .errors import CorpusError

PathLike = str | os.PathLike
CorpusSpec = PathLike | Iterable[PathLike]

FORMATS = ("parquet", "csv", "tsv", "jsonl", "txt")
_SUFFIX_FORMAT = {
    ".parquet": "parquet", ".pq": "parquet",
    ".csv": "csv", ".tsv": "tsv",
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".txt": "txt", ".text": "txt",
}
_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)
_FFFD = "\ufffd"


@dataclass
class ReadStats:
    """What reading saw; recorded in the manifest."""

    documents: int = 0
    empty_skipped: int = 0
    undecodable_documents: int = 0
    replaced_sequences: int = 0
    per_file: dict[str, int] = field(default_factory=dict)


def clean_review_text(text: str) -> str:
    """Unescape HTML entities and turn ``<br />`` tags into spaces."""
    text = _BR.sub(" ", text)
    return html.unescape(text) if "&" in text else text


def expand_corpus(corpus: CorpusSpec) -> list[Path]:
    """Expand paths and globs into a sorted, de-duplicated list of existing files."""
    specs = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    if not specs:
        raise CorpusError("no corpus files were given; pass one or more paths or globs")
    files: list[Path] = []
    for spec in specs:
        spec = os.fspath(spec)
        if glob.has_magic(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise CorpusError(f"the glob {spec!r} matches no file; check the pattern and the folder")
            files.extend(Path(m) for m in matches if os.path.isfile(m))
        elif os.path.isdir(spec):
            raise CorpusError(f"{spec!r} is a folder; pass the files in it, e.g. {os.path.join(spec, '*.csv')!r}")
        elif not os.path.exists(spec):
            raise CorpusError(f"corpus file {spec!r} does not exist; check the path")
        else:
            files.append(Path(spec))
    seen: set[Path] = set()
    unique = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]
    for f in unique:
        if f.stat().st_size == 0:
            raise CorpusError(f"corpus file {str(f)!r} is empty (0 bytes); remove it from the inputs")
        detect_format(f.name)
    return unique


def detect_format(name: str) -> str:
    """The reader for a file name: its suffix after an optional ``.gz``."""
    lower = name.lower()
    if lower.endswith(".gz"):
        lower = lower[:-3]
    if lower.endswith(".zip"):
        return "zip"
    fmt = _SUFFIX_FORMAT.get(Path(lower).suffix)
    if fmt is None:
        raise CorpusError(
            f"cannot tell the format of {name!r}; use one of the suffixes "
            f"{', '.join(sorted(_SUFFIX_FORMAT))} (optionally .gz), or .zip"
        )
    return fmt


def fingerprint(files: list[Path]) -> list[dict]:
    """Path, size and SHA-256 of each input file, for the manifest."""
    out = []
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        out.append({"path": str(f), "bytes": f.stat().st_size, "sha256": h.hexdigest()})
    return out


def iter_documents(
    files: list[Path],
    text_column: str = "text",
    *,
    clean: bool = False,
    batch_docs: int = 4096,
    stats: ReadStats | None = None,
) -> Iterator[list[str]]:
    """Yield batches of non-empty documents from ``files``, in order."""
    stats = stats if stats is not None else ReadStats()
    for f in files:
        before = stats.documents
        if detect_format(f.name) == "zip":
            with zipfile.ZipFile(f) as zf:
                members = [m for m in sorted(zf.namelist()) if not m.endswith("/")]
                for member in members:
                    with zf.open(member) as fh:
                        yield from _batches(fh, member, f"{f}!{member}", text_column, clean, batch_docs, stats)
        else:
            with open(f, "rb") as raw:
                fh = gzip.GzipFile(fileobj=raw) if f.name.lower().endswith(".gz") else raw
                yield from _batches(fh, f.name, str(f), text_column, clean, batch_docs, stats)
        stats.per_file[str(f)] = stats.documents - before
    if stats.documents == 0:
        raise CorpusError(
            f"the corpus has no documents: every row of {[str(f) for f in files]} was empty "
            f"(text column {text_column!r}); check the files and --text-column"
        )


def _batches(fh: IO[bytes], name: str, where: str, column: str, clean: bool,
             batch_docs: int, stats: ReadStats) -> Iterator[list[str]]:
    fmt = detect_format(name)
    if fmt == "zip":
        raise CorpusError(f"{where}: nested archives are not supported; unpack the inner archive")
    raw: Iterator[list[str | None]]
    if fmt == "parquet":
        raw = _parquet_rows(fh, where, column, batch_docs, stats)
    elif fmt in ("csv", "tsv"):
        raw = _csv_rows(fh, where, column, "\t" if fmt == "tsv" else ",", stats)
    elif fmt == "jsonl":
        raw = _jsonl_rows(fh, where, column, batch_docs, stats)
    else:
        raw = _text_rows(fh, batch_docs, stats)
    for rows in raw:
        docs = [d for d in rows if d and not d.isspace()]
        stats.empty_skipped += len(rows) - len(docs)
        if clean:
            docs = [clean_review_text(d) for d in docs]
        stats.documents += len(docs)
        for i in range(0, len(docs), batch_docs):
            yield docs[i:i + batch_docs]


def _decode(values: list[bytes | None], stats: ReadStats) -> list[str | None]:
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
            stats.replaced_sequences += s.count(_FFFD) - v.count(b"\xef\xbf\xbd")
            out.append(s)
    return out


def _arrow_text(arr: pa.Array, stats: ReadStats) -> list[str | None]:
    # Fast path: a valid UTF-8 column converts in C; only a bad batch is decoded row by row.
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return arr.to_pylist()
    try:
        return arr.cast(pa.large_string()).to_pylist()
    except pa.ArrowInvalid:
        return _decode(arr.to_pylist(), stats)


def _check_column_type(typ: pa.DataType, where: str, column: str) -> None:
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)
            or pa.types.is_binary(typ) or pa.types.is_large_binary(typ) or pa.types.is_null(typ)):
        raise CorpusError(
            f"{where}: column {column!r} holds {typ}, not text; pass the text column with --text-column"
        )


def _missing_column(where: str, column: str, names: list[str]) -> CorpusError:
    return CorpusError(
        f"{where}: no column {column!r}; the columns are {names}; pass the text column with --text-column"
    )


def _parquet_rows(fh: IO[bytes], where: str, column: str, batch_docs: int,
                  stats: ReadStats) -> Iterator[list[str | None]]:
    try:
        pf = pq.ParquetFile(fh)
    except (pa.ArrowInvalid, OSError) as e:
        raise CorpusError(f"{where}: not a readable Parquet file ({e})") from e
    names = pf.schema_arrow.names
    if column not in names:
        raise _missing_column(where, column, names)
    _check_column_type(pf.schema_arrow.field(column).type, where, column)
    for batch in pf.iter_batches(batch_size=batch_docs, columns=[column]):
        yield _arrow_text(batch.column(0), stats)


def _csv_rows(fh: IO[bytes], where: str, column: str, delimiter: str,
              stats: ReadStats) -> Iterator[list[str | None]]:
    parse = pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    read = pacsv.ReadOptions(block_size=8 << 20)
    # The header is read once to check the column; the text is then read as
    # binary so that undecodable bytes can be replaced instead of failing the batch.
    header = fh.readline()
    names = next(iter(pacsv.read_csv(io.BytesIO(header), parse_options=parse,
                                     read_options=pacsv.ReadOptions(autogenerate_column_names=True))
                      .to_pylist()), {})
    names = [str(v) for v in names.values()]
    if column not in names:
        raise _missing_column(where, column, names)
    convert = pacsv.ConvertOptions(include_columns=[column], column_types={column: pa.binary()})
    body = io.BufferedReader(_Prepend(header, fh), buffer_size=1 << 20)
    try:
        reader = pacsv.open_csv(body, read_options=read, parse_options=parse, convert_options=convert)
        for batch in reader:
            yield _arrow_text(batch.column(0), stats)
    except pa.ArrowInvalid as e:
        raise CorpusError(f"{where}: malformed {'TSV' if delimiter == chr(9) else 'CSV'} ({e})") from e


class _Prepend(io.RawIOBase):
    """A raw stream that replays an already-read header before the rest of ``fh``."""

    def __init__(self, head: bytes, fh: IO[bytes]):
        self._head, self._fh = head, fh

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self._head:
            n = min(len(buf), len(self._head))
            buf[:n], self._head = self._head[:n], self._head[n:]
            return n
        data = self._fh.read(len(buf))
        buf[:len(data)] = data
        return len(data)


def _jsonl_rows(fh: IO[bytes], where: str, column: str, batch_docs: int,
                stats: ReadStats) -> Iterator[list[str | None]]:
    rows: list[str | None] = []
    for lineno, line in enumerate(fh, 1):
        if not line.strip():
            continue
        text = _decode([line], stats)[0]
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{where}: line {lineno} is not JSON ({e.msg})") from e
        if not isinstance(record, dict) or column not in record:
            keys = list(record) if isinstance(record, dict) else type(record).__name__
            raise CorpusError(f"{where}: line {lineno} has no field {column!r} (it has {keys}); "
                              f"pass the text field with --text-column")
        value = record[column]
        if value is not None and not isinstance(value, str):
            raise CorpusError(f"{where}: line {lineno}: field {column!r} holds "
                              f"{type(value).__name__}, not text; pass the text field with --text-column")
        rows.append(value)
        if len(rows) >= batch_docs:
            yield rows
            rows = []
    if rows:
        yield rows


def _text_rows(fh: IO[bytes], batch_docs: int, stats: ReadStats) -> Iterator[list[str | None]]:
    rows: list[bytes | None] = []
    for line in fh:
        rows.append(line.rstrip(b"\r\n"))
        if len(rows) >= batch_docs:
            yield _decode(rows, stats)
            rows = []
    if rows:
        yield _decode(rows, stats)
