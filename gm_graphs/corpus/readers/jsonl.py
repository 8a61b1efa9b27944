"""JSONL: Python's ``json`` line by line (compressed and archived files, and what Polars cannot vouch
for), and Polars in blocks of lines for a plain file: 5-7× faster (benchmarks/RESULTS.md).

The Polars reader reads what the line-by-line reader reads: the same documents in the same order, the same
``ReadStats``, the same one-line errors with the same line numbers. The file is read in blocks of whole lines,
each parsed by ``read_ndjson`` (``scan_ndjson`` would keep every page of the file it maps resident, so memory
would grow with the file). Polars is stricter than Python's ``json`` in some ways (invalid UTF-8, raw control
characters in strings, NaN, a byte-order mark: it fails) and laxer in others (a missing field is a null; a
number, boolean, list or object where text is expected becomes its text; the escape of a lone surrogate
becomes a NUL). So a block that Polars fails on, or whose values show one of those, is parsed line by line
by Python's ``json`` instead, with its real line numbers, and the next block goes to Polars again. One
difference is left: where a line names the field twice, Polars keeps the first value and ``json`` the last.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from gm_graphs.corpus.readers.base import Reader
from gm_graphs.corpus.source import (
    UTF8_BOM,
    Lines,
    ReadStats,
    Source,
    batches,
    brief,
    check_encoding,
    decode,
    no_surrogates,
    source_lines,
)
from gm_graphs.errors import CorpusError

if TYPE_CHECKING:
    import polars as pl

BLOCK_BYTES = 8 << 20  # read per Polars call; a line longer than this goes to the line-by-line reader
# The text Polars makes of a JSON number, boolean, list or object when the field's type is String.
_NOT_A_JSON_STRING = r"(?s)^(?:-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|\[.*\]|\{.*\})$"


class JsonlReader(Reader):
    """A JSONL file's text field: one JSON object a line; blank lines are skipped.

    A plain file is read by Polars in blocks of lines (``polars_jsonl_rows``); a gzip'd file or an archive
    member line by line by Python's ``json`` (``jsonl_rows``).

    Example::

        >>> from gm_graphs.corpus.source import ReadStats
        >>> reviews = source("reviews.jsonl", '{"text": "great film", "stars": 5}\\n\\n{"text": "dull"}\\n')
        >>> list(JsonlReader().rows(reviews, "text", 4096, ReadStats()))
        [['great film', 'dull']]
    """

    name = "JSONL"
    suffixes = (".jsonl", ".ndjson", ".json")

    def rows(self, source: Source, column: str, batch_docs: int,
             stats: ReadStats) -> Iterator[list[str | None]]:
        if source.path is not None:
            return polars_jsonl_rows(source, column, batch_docs, stats)
        return jsonl_rows(source, column, batch_docs, stats)


def jsonl_rows(source: Source, column: str, batch_docs: int, stats: ReadStats,
                first_line: int = 1) -> Iterator[list[str | None]]:
    """The text field of each JSON line from line ``first_line`` on."""
    lines = itertools.dropwhile(lambda numbered: numbered[0] < first_line, source_lines(source))
    yield from batches(jsonl_values(lines, source.where, column, stats), batch_docs)


def jsonl_values(lines: Iterable[tuple[int, bytes]], where: str, column: str,
                  stats: ReadStats) -> Iterator[str | None]:
    """The text field of each numbered line that is not blank; anything else is a CorpusError naming the line."""
    for lineno, line in lines:
        if not line.strip():
            continue
        text = decode([line], stats)[0]
        try:
            record = json.loads(text, strict=False)  # strict=False: raw tabs and control bytes inside strings
        except json.JSONDecodeError as e:
            raise CorpusError(f"{where}: line {lineno} is not JSON ({e.msg}); "
                              f"write one JSON object per line") from None
        except RecursionError:
            raise CorpusError(f"{where}: line {lineno} nests too deeply to be a record; "
                              f"write one flat JSON object per line") from None
        if not isinstance(record, dict) or column not in record:
            keys = brief(list(record), 120) if isinstance(record, dict) else type(record).__name__
            raise CorpusError(f"{where}: line {lineno} has no field {column!r} (it has {keys}); "
                              f"pass the text field with --text-column")
        value = record[column]
        if value is not None and not isinstance(value, str):
            raise CorpusError(f"{where}: line {lineno}: field {column!r} holds "
                              f"{type(value).__name__}, not text; pass the text field with --text-column")
        yield no_surrogates(value, stats) if value else value


def polars_jsonl_rows(source: Source, column: str, batch_docs: int,
                      stats: ReadStats) -> Iterator[list[str | None]]:
    """The text field of each line of a plain JSONL file, in batches of at most ``batch_docs``."""
    where = source.where
    lineno, carry = 1, b""  # carry: the start of a line whose end is not read yet; lineno: its number
    with source.open() as fh:
        data = fh.read(BLOCK_BYTES)
        check_encoding(data, where)
        data = data[len(UTF8_BOM):] if data.startswith(UTF8_BOM) else data
        while data:
            block = carry + data if carry else data
            cut = block.rfind(b"\n") + 1
            if cut == 0 and len(block) > BLOCK_BYTES:  # a line this long is rare: that reader bounds it
                yield from jsonl_rows(source, column, batch_docs, stats, first_line=lineno)
                return
            if cut:
                yield from _block_rows(source, block[:cut], lineno, column, batch_docs, stats)
                lineno += block.count(b"\n", 0, cut)
            carry = block[cut:]
            data = fh.read(BLOCK_BYTES)
    if carry:  # the last line has no line break
        yield from _block_rows(source, carry + b"\n", lineno, column, batch_docs, stats)


def _block_rows(source: Source, block: bytes, first_line: int, column: str, batch_docs: int,
                stats: ReadStats) -> Iterator[list[str | None]]:
    """The text field of each line of ``block`` (whole lines, the first numbered ``first_line``)."""
    values = _polars_values(block, column)
    if values is None:
        lines = Lines(source).lines_of(block, first_line)
        rows: list[str | None] = list(jsonl_values(lines, source.where, column, stats))
        for i in range(0, len(rows), batch_docs):
            yield rows[i:i + batch_docs]
    else:
        for i in range(0, values.len(), batch_docs):
            yield values.slice(i, batch_docs).to_list()


def _polars_values(block: bytes, column: str) -> pl.Series | None:
    """The field of each line as Polars reads it, or None where Python's ``json`` may read otherwise."""
    import polars as pl  # imported by the files that need it, not by every command that reads a corpus

    try:
        values = pl.read_ndjson(block, schema={column: pl.String}).get_column(column)
        if values.null_count() or values.str.contains("\x00", literal=True).any() \
                or values.str.contains(_NOT_A_JSON_STRING).any():
            return None
    except (pl.exceptions.PolarsError, pl.exceptions.PanicException):  # a Rust panic is a BaseException
        return None
    return values
