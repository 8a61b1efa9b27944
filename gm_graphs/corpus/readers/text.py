"""Plain text: a document a line."""

from __future__ import annotations

from collections.abc import Iterator

from gm_graphs.corpus.readers.base import Reader
from gm_graphs.corpus.source import Lines, ReadStats, Source, batches, decode


class TextReader(Reader):
    """A text file's lines, a document each; blank lines are counted as empty documents, a run at a time
    (``Lines``), and the column is ignored.

    Example::

        >>> from gm_graphs.corpus.source import ReadStats
        >>> reviews, stats = source("reviews.txt", "great film\\n\\n\\ndull\\n"), ReadStats()
        >>> list(TextReader().rows(reviews, "text", 4096, stats)), stats.empty_skipped
        ([['great film', 'dull']], 2)
    """

    name = "text"
    suffixes = (".txt", ".text")

    def rows(self, source: Source, column: str, batch_docs: int,
             stats: ReadStats) -> Iterator[list[str | None]]:
        lines = Lines(source)
        for rows in batches((line for _, line in lines), batch_docs):
            yield decode(rows, stats)
        stats.empty_skipped += lines.blank
