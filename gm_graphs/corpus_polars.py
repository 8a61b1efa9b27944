"""The Polars reader of plain JSONL corpus files, the default: 5-7× faster than Python's ``json`` (RESULTS.md).

It reads what ``gm_graphs.corpus``'s line-by-line reader reads: the same documents in the same order, the same
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

from collections.abc import Iterator

import polars as pl

from .corpus import _UTF8_BOM, ReadStats, _check_encoding, _jsonl_rows, _jsonl_values, _Source

# What Polars raises on input it cannot read; a Rust panic is a BaseException, so it is named too.
_POLARS_ERRORS = (pl.exceptions.PolarsError, pl.exceptions.PanicException)
BLOCK_BYTES = 8 << 20  # read per Polars call; a line longer than this goes to the line-by-line reader
# The text Polars makes of a JSON number, boolean, list or object when the field's type is String.
_NOT_A_JSON_STRING = r"(?s)^(?:-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|\[.*\]|\{.*\})$"


def polars_jsonl_rows(source: _Source, column: str, batch_docs: int,
                      stats: ReadStats) -> Iterator[list[str | None]]:
    """The text field of each line of a plain JSONL file, in batches of at most ``batch_docs``."""
    path, where = source.path, source.where
    assert path is not None
    lineno, carry = 1, b""  # carry: the start of a line whose end is not read yet; lineno: its number
    with open(path, "rb") as fh:
        data = fh.read(BLOCK_BYTES)
        _check_encoding(data, where)
        data = data[len(_UTF8_BOM):] if data.startswith(_UTF8_BOM) else data
        while data:
            block = carry + data if carry else data
            cut = block.rfind(b"\n") + 1
            if cut == 0 and len(block) > BLOCK_BYTES:  # a line this long is rare: that reader bounds it
                yield from _jsonl_rows(source, column, batch_docs, stats, first_line=lineno)
                return
            if cut:
                yield from _block_rows(block[:cut], lineno, where, column, batch_docs, stats)
                lineno += block.count(b"\n", 0, cut)
            carry = block[cut:]
            data = fh.read(BLOCK_BYTES)
    if carry:  # the last line has no line break
        yield from _block_rows(carry, lineno, where, column, batch_docs, stats)


def _block_rows(block: bytes, first_line: int, where: str, column: str, batch_docs: int,
                stats: ReadStats) -> Iterator[list[str | None]]:
    values = _polars_values(block, column)
    if values is None:
        lines = _numbered_lines(block, first_line)
        rows: list[str | None] = list(_jsonl_values(lines, where, column, stats))
        for i in range(0, len(rows), batch_docs):
            yield rows[i:i + batch_docs]
    else:
        for i in range(0, values.len(), batch_docs):
            yield values.slice(i, batch_docs).to_list()


def _polars_values(block: bytes, column: str) -> pl.Series | None:
    """The field of each line as Polars reads it, or None where Python's ``json`` may read otherwise."""
    try:
        values = pl.read_ndjson(block, schema={column: pl.String}).get_column(column)
        if values.null_count() or values.str.contains("\x00", literal=True).any() \
                or values.str.contains(_NOT_A_JSON_STRING).any():
            return None
    except _POLARS_ERRORS:
        return None
    return values


def _numbered_lines(block: bytes, first_line: int) -> Iterator[tuple[int, bytes]]:
    """A block's lines as ``corpus._lines`` gives them: numbered, without their line breaks."""
    lines = block.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    for lineno, line in enumerate(lines, first_line):
        yield lineno, line.rstrip(b"\r")
