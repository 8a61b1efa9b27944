"""Parquet: the text column read a batch of rows at a time by pyarrow, never the whole file."""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

from gm_graphs.corpus.readers.base import Reader
from gm_graphs.corpus.readers.columns import check_column_type, longest_value, missing_column, text_values
from gm_graphs.corpus.source import BATCH_BYTES, MAX_DOCUMENT_BYTES, MB, ReadStats, Source, brief
from gm_graphs.errors import CorpusError


class ParquetReader(Reader):
    """A Parquet file's text column (any string, binary, view or dictionary type), in batches of rows that hold
    about ``BATCH_BYTES`` of text at most (a dictionary-encoded column's too: its longest dictionary value bounds
    its rows' size, where the footer counts that value once); a value longer than a document is refused from the
    footer where it can be, and before it becomes a Python string where not.

    Example::

        >>> import pyarrow as pa
        >>> from gm_graphs.corpus.source import ReadStats
        >>> reviews = source("reviews.parquet", pa.table({"text": ["great film", None]}))
        >>> list(ParquetReader().rows(reviews, "text", 4096, ReadStats()))
        [['great film']]
    """

    name = "Parquet"
    suffixes = (".parquet", ".pq")

    def check(self, fh: IO[bytes], where: str, size: int | None) -> None:
        head = fh.read(4)
        if size is None:
            return  # gzip'd: its footer cannot be reached without inflating the whole file
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

    def rows(self, source: Source, column: str, batch_docs: int,
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
                raise missing_column(where, column, names)
            check_column_type(pf.schema_arrow.field(column).type, where, column)
            try:
                with replace(source, progress=None).open() as again:  # its own reads, not the progress bar's
                    dictionaries = pq.ParquetFile(again, metadata=pf.metadata, read_dictionary=[column],
                                                  pre_buffer=False, buffer_size=MB)  # a page, not the chunk
                    rows = _rows_per_batch(pf.metadata, column, batch_docs, where,
                                           lambda group: _longest_dictionary_value(dictionaries, group, column))
                row = 1
                for batch in pf.iter_batches(batch_size=rows, columns=[column]):
                    yield text_values(batch.column(0), stats, where, row)
                    row += batch.num_rows
            except (pa.ArrowCapacityError, MemoryError) as e:  # an intact file too large for here, not damage
                raise CorpusError(f"{where}: Parquet data too large to read here ({brief(e)}); rewrite the file "
                                  f"with smaller row groups and pages, or free memory") from None
            except (pa.ArrowException, OSError) as e:
                if isinstance(e, gzip.BadGzipFile):
                    raise
                raise CorpusError(f"{where}: damaged Parquet data ({brief(e)}); copy the file again or "
                                  f"re-create it") from None


def _longest_dictionary_value(pf: pq.ParquetFile, group: int, column: str) -> int:
    """The bytes of the longest value in the dictionary page of ``column`` in row group ``group``: the footer
    counts a dictionary value once, however many rows refer to it. ``pf`` reads ``column`` as a dictionary; this
    costs the group's dictionary page and first data page."""
    first = next(pf.iter_batches(batch_size=1, row_groups=[group], columns=[column]), None)
    return longest_value(first.column(0)) if first is not None else 0


def _rows_per_batch(metadata: pq.FileMetaData, column: str, batch_docs: int, where: str,
                    longest: Callable[[int], int]) -> int:
    """Rows of text to read at a time: ``batch_docs``, or fewer where the footer says a row holds so much text that
    they would be more than ``BATCH_BYTES``, or where a row group's longest dictionary value (``longest(group)``,
    asked once the group passes the footer's check) times the rows would be. A row group whose text holds more bytes
    than its rows could as documents is refused from the footer alone: one of its values is longer than
    ``MAX_DOCUMENT_BYTES``, and reading it would cost several times its size. (A long value among many short ones
    passes this and is refused as it is read.)"""
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
            per_row = chunk.total_uncompressed_size / group.num_rows
            most = max(most, per_row, longest(i) if chunk.has_dictionary_page else 0)
    return max(1, min(batch_docs, int(BATCH_BYTES // most))) if most else batch_docs
