"""The corpus readers, one class a format, and the registry that picks one by a file's name.

Adding a format is one module here, with a ``Reader`` subclass (its ``name``, ``suffixes``, ``rows`` and, where a
cheap check of a file's first bytes can tell it is not of the format, ``check``), and one entry in ``FORMATS``.
The messages and the build's help that list the suffixes read them from here.
"""

from gm_graphs.corpus.readers.base import Reader, Registry
from gm_graphs.corpus.readers.csv import CsvReader, TsvReader
from gm_graphs.corpus.readers.jsonl import JsonlReader
from gm_graphs.corpus.readers.parquet import ParquetReader
from gm_graphs.corpus.readers.text import TextReader
from gm_graphs.corpus.readers.zip import ZipReader

FORMATS = Registry([ParquetReader(), CsvReader(), TsvReader(), JsonlReader(), TextReader()])  # what a zip may hold
READERS = Registry([*FORMATS.readers, ZipReader(FORMATS)])

__all__ = ["FORMATS", "READERS", "Reader", "Registry"]
