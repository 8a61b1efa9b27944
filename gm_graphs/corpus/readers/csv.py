"""CSV and TSV: the text column read by pyarrow's streaming CSV reader, a block of rows at a time."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from typing import IO

import pyarrow as pa
import pyarrow.csv as pacsv

from gm_graphs.corpus.readers.base import Reader
from gm_graphs.corpus.readers.columns import missing_column, text_values
from gm_graphs.corpus.source import MAX_DOCUMENT_BYTES, MB, ReadStats, Source, brief, read_first_line
from gm_graphs.errors import CorpusError

BLOCK_BYTES = 8 << 20  # pyarrow's block; a row must fit in one, so it grows (×4) up to a document's limit
_COLUMN_COUNT = re.compile(r"Expected (\d+) columns, got (\d+): (.*)", re.DOTALL)


class CsvReader(Reader):
    """A CSV file's text column: a header line names the columns; quoted fields may hold line breaks.

    A row larger than pyarrow's block reopens the file with a larger one; rows already yielded are skipped after
    a reopen, so nothing is counted twice. pyarrow reads the file through ``_Replay`` (the header line, read here
    first, then the rest), never by its name: a name need not be UTF-8.

    Example::

        >>> from gm_graphs.corpus.source import ReadStats
        >>> reviews = source("reviews.csv", 'label,text\\n1,"great, long film"\\n0,dull\\n')
        >>> list(CsvReader().rows(reviews, "text", 4096, ReadStats()))
        [['great, long film', 'dull']]
    """

    name = "CSV"
    suffixes = (".csv",)
    delimiter = ","

    def rows(self, source: Source, column: str, batch_docs: int,
             stats: ReadStats) -> Iterator[list[str | None]]:
        block, done = BLOCK_BYTES, 0
        while True:
            with source.open() as fh:
                header = read_first_line(fh, source.where)
                names = _header_names(header, self.delimiter, source.where, self.name)
                if column not in names:
                    raise missing_column(source.where, column, names)
                last = names[-1]
                parse = pacsv.ParseOptions(delimiter=self.delimiter, newlines_in_values=True)
                # The text is read as binary so that undecodable bytes are replaced instead of failing the batch;
                # the last column too, to tell a quote left open at the end of the file.
                wanted = list(dict.fromkeys([column, last]))
                convert = pacsv.ConvertOptions(include_columns=wanted, column_types={c: pa.binary() for c in wanted})
                body = _Replay(header, fh)
                seen, tail_value, reader = 0, None, None
                try:
                    reader = pacsv.open_csv(body, read_options=pacsv.ReadOptions(block_size=block),
                                            parse_options=parse, convert_options=convert)
                    for batch in reader:
                        n = batch.num_rows
                        skip = min(max(done - seen, 0), n)
                        seen += n
                        if n:
                            tail_value = batch.column(last)[n - 1].as_py()
                        if skip < n:
                            first = seen - n + skip + 1
                            yield text_values(batch.column(column).slice(skip), stats, source.where, first)
                            done = seen
                except pa.ArrowException as e:
                    if "straddl" in str(e) and block < MAX_DOCUMENT_BYTES:
                        block = min(4 * block, MAX_DOCUMENT_BYTES)
                        continue
                    if isinstance(e, OSError):
                        raise  # reading failed, not parsing: the caller names it
                    raise _csv_error(source.where, self.name, e) from None
                finally:
                    # pyarrow reads ahead from a Python stream in its own threads: a reader left for the
                    # interpreter's exit to free (an error's traceback holds this frame) aborts the process, so
                    # drop it here.
                    reader = None
                tail = body.tail
                open_quote = tail_value and (b"\n" in tail_value or b"\r" in tail_value)
                if open_quote and not tail.rstrip(b"\r\n").endswith(b'"'):
                    raise CorpusError(f"{source.where}: a quote opened in the last row is never closed, so its "
                                      f"field runs to the end of the file; close the quote, or double it (\"\") "
                                      f"inside a field")
                return


class TsvReader(CsvReader):
    """A TSV file's text column: a CSV file whose delimiter is a tab.

    Example::

        >>> from gm_graphs.corpus.source import ReadStats
        >>> reviews = source("reviews.tsv", "text\\tlabel\\ngreat film\\t1\\n")
        >>> list(TsvReader().rows(reviews, "text", 4096, ReadStats()))
        [['great film']]
    """

    name = "TSV"
    suffixes = (".tsv",)
    delimiter = "\t"


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
