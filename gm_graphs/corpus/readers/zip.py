"""Zip archives: each member in a corpus format read by that format's reader, in name order."""

from __future__ import annotations

import hashlib
import struct
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from gm_graphs.corpus.readers.base import Reader, Registry
from gm_graphs.corpus.source import ReadStats, Source, brief, decompression_errors, printable_path
from gm_graphs.errors import CorpusError

_METHODS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}  # what Python inflates


class ZipReader(Reader):
    """A zip archive's members, each read by the reader its name picks among ``formats`` (members may be gzip'd).

    Folders, macOS metadata (``__MACOSX/``, ``._x``), hidden files and members of no corpus format (README,
    LICENSE) are skipped and listed in ``ReadStats.skipped_members``; a nested archive, an encrypted member or a
    compression method Python cannot inflate is refused.

    Args:
        formats (``Registry``): the readers of the members' formats.

    Example::

        >>> from gm_graphs.corpus.readers import FORMATS
        >>> from gm_graphs.corpus.source import ReadStats
        >>> reviews, stats = source("reviews.zip", {"a.txt": "great film\\n", "README": "not a corpus"}), ReadStats()
        >>> list(ZipReader(FORMATS).rows(reviews, "text", 4096, stats)), stats.skipped_members[0][-6:]
        ([['great film']], 'README')
    """

    name = "zip archive"
    suffixes = (".zip",)
    gzipped = False  # zip compresses its members itself

    def __init__(self, formats: Registry):
        self.formats = formats

    def check(self, fh: IO[bytes], where: str, size: int | None) -> None:
        with _open_zip(fh, where) as zf:
            self._members(zf, where)

    def text_bytes(self, fh: IO[bytes], where: str, size: int) -> int:
        with decompression_errors(where), _open_zip(fh, where) as zf:
            return sum(info.file_size for info in self._members(zf, where)[0])

    def rows(self, source: Source, column: str, batch_docs: int,
             stats: ReadStats) -> Iterator[list[str | None]]:
        # The archive itself is opened without ``source.progress``: its members tell their inflated bytes.
        with source.opener() as fh, _open_zip(fh, source.where) as zf:
            members, skipped = self._members(zf, source.where)
            archive = printable_path(source.path if source.path is not None else source.where)
            stats.skipped_members.extend(f"{archive}!{m}" for m in skipped)
            for info in members:
                member = Source(info.filename, f"{source.where}!{info.filename}",
                                lambda info=info: zf.open(info), progress=source.progress)
                with decompression_errors(member.where):
                    yield from self.formats.reader_for(info.filename).rows(member, column, batch_docs, stats)

    def members(self, fh: IO[bytes], where: str) -> list[zipfile.ZipInfo]:
        """The members ``rows`` reads, in its order, from the archive's directory alone (names, sizes, CRC-32)."""
        with _open_zip(fh, where) as zf:
            return self._members(zf, where)[0]

    def member_digests(self, fh: IO[bytes], where: str, names: list[str]) -> dict[str, str]:
        """The SHA-256 of each named member's bytes, inflated as they are read (a damaged member is one line)."""
        digests = {}
        with _open_zip(fh, where) as zf:
            for name in names:
                with decompression_errors(f"{where}!{name}"), zf.open(name) as member:
                    digests[name] = hashlib.file_digest(member, "sha256").hexdigest()
        return digests

    def _members(self, zf: zipfile.ZipFile, where: str) -> tuple[list[zipfile.ZipInfo], list[str]]:
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
            if parts[-1].lower().removesuffix(".gz").endswith(self.suffixes):
                raise CorpusError(f"{where}!{name}: nested archives are not supported; unpack the inner archive")
            if not self.formats.names(parts[-1]):
                skipped.append(name)
                continue
            if info.flag_bits & 0x1:
                raise CorpusError(f"{where}!{name} is encrypted; unpack it with its password and pass the files")
            if info.compress_type not in _METHODS:
                raise CorpusError(f"{where}!{name} uses zip compression method {info.compress_type}, which "
                                  f"Python cannot read; re-create the archive with the default (deflate)")
            readable.append(info)
        if not readable:
            shown = ", ".join(repr(s) for s in skipped[:5]) + (", …" if len(skipped) > 5 else "")
            wanted = "/".join(reader.suffixes[0] for reader in self.formats.readers)
            raise CorpusError(f"the archive {where!r} holds no corpus file (skipped: {shown or 'nothing'}); "
                              f"add {wanted} members")
        return readable, skipped


@contextmanager
def _open_zip(fh: IO[bytes], where: str) -> Iterator[zipfile.ZipFile]:
    try:
        zf = zipfile.ZipFile(fh)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, struct.error) as e:
        raise CorpusError(f"{where!r} is not a readable zip archive ({brief(e)}); copy it again if it was "
                          f"truncated, or rename it to its real format") from None
    with zf:
        yield zf
