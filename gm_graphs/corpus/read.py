"""Reading a corpus: files or globs expanded and checked before any work (``expand_corpus``), then streamed as
batches of documents (``iter_documents``), never holding a whole file.

Each file's name picks its reader (``gm_graphs.corpus.readers``: Parquet, CSV/TSV, JSONL, text, zip), which
yields its raw values; what is done with them is the same for every format, here. No document is longer than
``MAX_DOCUMENT_BYTES`` (32 MB): a longer line or value is refused in one line, whatever the reader; and a batch
holds about ``BATCH_BYTES`` (64 MB) of text at most, whatever its number of documents.
Every file is opened by ``open_regular`` (never a FIFO or a device, which could block forever) and handed to
pyarrow open, never by name (a name need not be UTF-8). Files may be gzip'd (``.gz``) or members of a ``.zip``
archive (members gzip'd too).
Undecodable bytes and NUL characters are replaced by U+FFFD and counted; a leading byte-order mark is dropped;
empty documents are skipped and counted. Anything unreadable (a truncated or corrupt file, a FIFO, a file without
read permission, a graph folder's own files) is a one-line ``CorpusError`` that names the file and the fix.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import html
import os
import re
import stat
import warnings
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gm_graphs.corpus.readers import READERS, Reader
from gm_graphs.corpus.readers.zip import ZipReader
from gm_graphs.corpus.source import (
    REPLACEMENT,
    Progress,
    ReadStats,
    Source,
    decompression_errors,
    not_regular,
    open_regular,
    printable_path,
)
from gm_graphs.errors import CorpusError
from gm_graphs.store.folders import graphs_root, is_graph_folder

PathLike = str | os.PathLike
CorpusSpec = PathLike | Iterable[PathLike]

_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)


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
            found = [m for m in matches if not os.path.isdir(m) or _named_like_corpus(m)]  # `data/**`: folders
            if not found:
                raise CorpusError(f"the glob {spec!r} matches only folders, e.g. {matches[0]!r}; pass the files in "
                                  f"them, e.g. {os.path.join(matches[0], '*.txt')!r}")
            files.extend(Path(m) for m in found)
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


def _named_like_corpus(path: str) -> bool:
    return READERS.names(os.path.basename(path.rstrip(os.sep)))


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
    reader = READERS.reader_for(f.name)
    graph = graphs.of(f)
    if graph is not None:
        raise CorpusError(f"{where!r} is inside the graph folder {str(graph)!r}, whose files are graphmax's own, "
                          f"not corpus text; narrow the glob or list the corpus files")
    try:
        with open_regular(f) as fh:
            _check_header(fh, f, reader, st.st_size)
    except PermissionError:
        raise CorpusError(f"corpus file {where!r} cannot be read (permission denied); make it readable "
                          f"(chmod u+r) or remove it from the inputs") from None
    except OSError as e:
        raise CorpusError(f"corpus file {where!r} cannot be read ({e.strerror or e}); check the file") from None


def _check_header(fh: IO[bytes], f: Path, reader: Reader, size: int) -> None:
    """The reader's cheap check of a file's first (or last) bytes, gunzipped where the name says, so that a wrong
    file fails before any work."""
    where = str(f)
    if not f.name.lower().endswith(".gz"):
        reader.check(fh, where, size)
        return
    if not reader.gzipped:
        raise CorpusError(f"{where!r} is a gzip'd {reader.name}; gunzip it and pass the {reader.suffixes[0]}")
    if fh.read(2) != b"\x1f\x8b":
        raise CorpusError(f"{where!r} is not gzip-compressed (no gzip header); "
                          f"remove the .gz suffix if it is not compressed")
    fh.seek(0)
    with decompression_errors(where):
        reader.check(gzip.GzipFile(fileobj=fh), where, None)


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
            if f.name.lower().endswith(".gz") and size >= 4:
                fh.seek(size - 4)
                total += int.from_bytes(fh.read(4), "little")
            else:
                total += READERS.reader_for(f.name).text_bytes(fh, str(f), size)
    return total


@contextmanager
def _reading(f: Path) -> Iterator[IO[bytes]]:
    """A corpus file opened to be read (a regular file: anything else is refused without blocking)."""
    with decompression_errors(str(f)):
        fh = open_regular(f)
    with fh:
        yield fh


@dataclass(frozen=True)
class _Stream:
    """One stream of bytes the duplicate check compares: a corpus file, or a member of a zip archive."""

    index: int  # its place in the order given
    file: Path
    member: str | None  # the member's name in the archive; None for the file itself
    size: int
    crc: int | None  # a member's CRC-32, from the archive's directory; None for a file

    @property
    def where(self) -> str:
        return str(self.file) if self.member is None else f"{self.file}!{self.member}"


def duplicate_files(files: list[Path]) -> list[list[str]]:
    """The groups of ``files`` and their zip members (``archive.zip!member``) that hold the same bytes, each in the
    order given: a copy would have every document in it counted twice (see ``_copies``)."""
    return [[s.where for s in group] for group in _copies(files)]


def _copies(files: list[Path]) -> list[list[_Stream]]:
    """The groups of ``files`` and their zip members that hold the same bytes, each in the order given.

    Only streams of one size are compared: by CRC-32 first (a member's from the archive's directory, a file's
    computed as it is hashed), then by SHA-256. A member whose directory lies about its CRC-32 fails its check
    when it is read, so no copy is counted twice unseen. Empty members, which hold no document, are not compared.
    """
    streams: list[_Stream] = []
    for f in files:
        streams.append(_Stream(len(streams), f, None, os.stat(f).st_size, None))
        reader = READERS.reader_for(f.name)
        if isinstance(reader, ZipReader):
            with _reading(f) as fh:
                for info in (i for i in reader.members(fh, str(f)) if i.file_size):
                    streams.append(_Stream(len(streams), f, info.filename, info.file_size, info.CRC))
    crcs: dict[_Stream, int] = {}
    digests: dict[_Stream, str] = {}
    by_size: dict[int, list[_Stream]] = {}
    for s in streams:
        by_size.setdefault(s.size, []).append(s)
    for same_size in (g for g in by_size.values() if len(g) > 1):
        for s in same_size:
            if s.member is None:
                crcs[s], digests[s] = _crc_and_digest(s.file)
            else:
                crcs[s] = s.crc
    by_crc: dict[tuple[int, int], list[_Stream]] = {}
    for s, crc in crcs.items():
        by_crc.setdefault((s.size, crc), []).append(s)
    wanted: dict[Path, list[_Stream]] = {}  # the members to hash, by archive: each archive opened once
    for s in (s for g in by_crc.values() if len(g) > 1 for s in g if s.member is not None):
        wanted.setdefault(s.file, []).append(s)
    for archive, members in wanted.items():
        with _reading(archive) as fh:
            found = READERS.reader_for(archive.name).member_digests(fh, str(archive), [s.member for s in members])
        digests.update({s: found[s.member] for s in members})
    groups = []
    for same in (g for g in by_crc.values() if len(g) > 1):
        by_digest: dict[str, list[_Stream]] = {}
        for s in same:
            by_digest.setdefault(digests[s], []).append(s)
        groups.extend(g for g in by_digest.values() if len(g) > 1)
    return sorted((sorted(g, key=lambda s: s.index) for g in groups), key=lambda g: g[0].index)


def _crc_and_digest(f: Path) -> tuple[int, str]:
    """A file's CRC-32 and SHA-256, in one pass."""
    crc, sha = 0, hashlib.sha256()
    with _reading(f) as fh:
        while block := fh.read(1 << 20):
            crc = zlib.crc32(block, crc)
            sha.update(block)
    return crc, sha.hexdigest()


def check_distinct(files: list[Path]) -> None:
    """Refuse corpus files, or zip members, that hold the same bytes, in one line that names them and the fix."""
    groups = _copies(files)
    if groups:
        first = groups[0]
        more = f" (and {len(groups) - 1} more group(s) of copies)" if len(groups) > 1 else ""
        fix = "pass each file once" + ("; leave one copy in the archive" if any(s.member for s in first) else "")
        raise CorpusError(f"the corpus files {', '.join(repr(s.where) for s in first)} hold the same bytes{more}, so "
                          f"every document in them would be counted {len(first)} times; {fix}, or add "
                          f"--allow-duplicate-files (allow_duplicate_files=True in Python) to count the copies on "
                          f"purpose")


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
        plain = f if not f.name.lower().endswith(".gz") else None
        source = Source(f.name, str(f), lambda f=f: open_regular(f), path=plain, progress=progress)
        yield from _read(source, READERS.reader_for(f.name), text_column, clean, batch_docs, stats)
        stats.per_file[printable_path(f)] = stats.documents - before
    if stats.documents == 0:
        raise CorpusError(
            f"the corpus has no documents: every row of {[str(f) for f in files]} was empty "
            f"(text column {text_column!r}); check the files and --text-column"
        )


def _read(source: Source, reader: Reader, column: str, clean: bool, batch_docs: int,
          stats: ReadStats) -> Iterator[list[str]]:
    """What every format's rows go through: empty documents skipped, NUL characters replaced, ``clean``."""
    with decompression_errors(source.where):
        for rows in reader.rows(source, column, batch_docs, stats):
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
