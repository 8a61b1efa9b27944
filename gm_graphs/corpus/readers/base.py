"""What a corpus reader is (``Reader``: one format, one class) and how a file's name picks one (``Registry``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, ClassVar

from gm_graphs.corpus.source import ReadStats, Source, check_encoding
from gm_graphs.errors import CorpusError

# Compressions and archives people try, with what to do instead.
UNSUPPORTED = {".bz2": "bzip2", ".xz": "xz", ".zst": "zstd", ".lz4": "lz4", ".tar": "tar", ".tgz": "tar",
               ".7z": "7-Zip", ".rar": "RAR"}


class Reader(ABC):
    """One corpus format: the suffixes that name it, a cheap check of a file before any work, and its rows.

    A reader reads one stream (``Source``: a file or an archive member, already gunzipped where its name ends in
    ``.gz``) and yields the raw values of its text column or field, in order; what is done with them (empty
    values skipped, NUL characters replaced, ``--clean``) is the same for every format, and done by
    ``gm_graphs.corpus.read``. It refuses what it cannot read with a one-line ``CorpusError`` naming the file and
    the fix, and holds no value longer than ``MAX_DOCUMENT_BYTES``.
    """

    name: ClassVar[str]  # the format, for messages
    suffixes: ClassVar[tuple[str, ...]]  # lower case, with the dot; the first is the one messages suggest
    gzipped: ClassVar[bool] = True  # whether the format may be gzip'd (``reviews.csv.gz``)

    def check(self, fh: IO[bytes], where: str, size: int | None) -> None:
        """Refuse a file that is not of this format, from its first (or last) bytes, before any work.

        Args:
            fh: the file's bytes from its start, gunzipped where its name ends in ``.gz``.
            where: the file, for messages.
            size: the file's size in bytes, or ``None`` where ``fh`` is gunzipped as it is read.
        """
        check_encoding(fh.read(4), where)

    def text_bytes(self, fh: IO[bytes], where: str, size: int) -> int:
        """The bytes of text reading the (uncompressed) file hands over, as far as the file says before it is read."""
        return size

    @abstractmethod
    def rows(self, source: Source, column: str, batch_docs: int,
             stats: ReadStats) -> Iterator[list[str | None]]:
        """The text of each document of ``source``, in order and in lists of at most ``batch_docs`` (a
        format may yield fewer, e.g. to bound a batch's bytes); ``None`` or ``""`` for an empty one.

        ``column`` names the column or field that holds the text (a format without columns ignores it);
        ``stats`` is told what reading saw (undecodable bytes, blank lines, members skipped).
        """


class Registry:
    """The readers by suffix: a file's name, after an optional ``.gz``, picks its reader.

    Example::

        >>> from gm_graphs.corpus.readers import READERS
        >>> READERS.reader_for("reviews.CSV.gz").name
        'CSV'
    """

    def __init__(self, readers: Iterable[Reader]):
        self.readers = tuple(readers)
        self._by_suffix: dict[str, Reader] = {}
        for reader in self.readers:
            for suffix in reader.suffixes:
                if suffix in self._by_suffix:
                    raise ValueError(f"the suffix {suffix!r} is claimed by the {self._by_suffix[suffix].name} and "
                                     f"{reader.name} readers; give each suffix one reader")
                self._by_suffix[suffix] = reader

    def reader_for(self, name: str) -> Reader:
        """The reader of a file named ``name``; a name of no known format is a one-line ``CorpusError``."""
        lower = name.lower()
        suffix = Path(lower[:-3] if lower.endswith(".gz") else lower).suffix
        reader = self._by_suffix.get(suffix)
        if reader is None:
            if suffix in UNSUPPORTED:
                raise CorpusError(f"{name!r} is a {UNSUPPORTED[suffix]} file, which graphmax does not read; unpack "
                                  f"it, or recompress the corpus files with gzip or zip")
            raise CorpusError(f"cannot tell the format of {name!r}; use one of the suffixes {self.described()}")
        return reader

    def names(self, name: str) -> bool:
        """Whether ``name`` is named like a file of one of these formats."""
        try:
            self.reader_for(name)
        except CorpusError:
            return False
        return True

    def described(self) -> str:
        """The suffixes, for messages and help: ``.csv, .jsonl, … (optionally .gz), or .zip``."""
        gzipped = sorted(s for r in self.readers if r.gzipped for s in r.suffixes)
        plain = sorted(s for r in self.readers if not r.gzipped for s in r.suffixes)
        return ", ".join(gzipped) + " (optionally .gz)" + "".join(f", or {s}" for s in plain)
