"""Arrow columns of text (Parquet's, CSV's, Ray Data's blocks) as document strings: checked to be text, each
value at most ``MAX_DOCUMENT_BYTES`` before it becomes a Python string, empty values dropped by pyarrow."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from gm_graphs.corpus.source import MAX_DOCUMENT_BYTES, MB, ReadStats, decode
from gm_graphs.errors import CorpusError


def _unpacked(arr: pa.Array) -> pa.Array:
    """A text column as plain (large) strings or bytes: what pyarrow's length kernels take."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if pa.types.is_string_view(arr.type):
        return arr.cast(pa.large_string())
    if pa.types.is_binary_view(arr.type):
        return arr.cast(pa.large_binary())
    return arr


def longest_value(arr: pa.Array) -> int:
    """The bytes of the longest value of a text column (0 for none); of a dictionary array, its longest dictionary
    value, found without decoding the array (400 rows that refer to one 16 MB value would decode to 6.4 GB)."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary
    if pa.types.is_null(arr.type) or not len(arr):
        return 0
    return pc.max(pc.binary_length(_unpacked(arr))).as_py() or 0


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


def check_column_type(typ: pa.DataType, where: str, column: str) -> None:
    if not _is_text_type(typ):
        raise CorpusError(
            f"{where}: column {column!r} holds {typ}, not text; pass the text column with --text-column"
        )


def missing_column(where: str, column: str, names: list[str]) -> CorpusError:
    return CorpusError(
        f"{where}: no column {column!r}; the columns are {names}; pass the text column with --text-column"
    )


def text_values(arr: pa.Array, stats: ReadStats, where: str, first_row: int) -> list[str | None]:
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
