"""The bound on one word of a document before a tokenizer sees it.

A tokenizer's pre-tokenizer cuts text into words, and BPE then works on each word whole: Hugging Face's BPE holds
about 60-100 bytes of memory per byte of the word (``Word::merge_all``), so one 32 MB word, a document that is a
single run of letters, costs 2-3 GB, and a 40 MB one ended in SIGABRT under a 6 GB limit. No pre-tokenizer cuts a
run of characters of one kind (letters, or white space), so graphmax does: a run of more than
``MAX_WORD_CHARS`` characters without white space, or of white space alone, is cut every ``MAX_WORD_CHARS``
characters, each piece is encoded as a document of its own, and their ids are laid end to end in the document's
place. Only the tokens at a cut can differ from what the tokenizer would give the whole run; a document without
such a run (every real one measured) is encoded as it is.

``MAX_WORD_CHARS`` (65,536) was chosen by measurement with SmolLM2's tokenizer (benchmarks/RESULTS.md): one word
of that many characters takes at most ~26 MB while it is encoded (four-byte emoji; ~2 MB for ASCII letters), where
1 M letters take ~55-90 MB and 32 M letters ~1.7 GB.
"""

from __future__ import annotations

import re

import numpy as np

MAX_WORD_CHARS = 1 << 16
_HALF = MAX_WORD_CHARS // 2
_SPACE, _TEXT = re.compile(r"\s"), re.compile(r"\S")
# A run longer than the bound, from its start (a lookbehind, so that a long run is scanned once, not from each of
# its characters).
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_WORD_CHARS + 1},}}|(?<!\s)\s{{{MAX_WORD_CHARS + 1},}}")


def _may_have_long_run(doc: str) -> bool:
    """Whether ``doc`` may hold a run longer than ``MAX_WORD_CHARS``: such a run covers a whole one of the
    aligned blocks of ``MAX_WORD_CHARS / 2`` characters, which then holds one kind of character only. Each block
    costs a search that stops at its first space (or first other character): a few steps in real text."""
    if len(doc) <= MAX_WORD_CHARS:
        return False
    return any(_SPACE.search(doc, start, start + _HALF) is None or _TEXT.search(doc, start, start + _HALF) is None
               for start in range(0, len(doc) - _HALF + 1, _HALF))


def split_long_words(docs: list[str]) -> tuple[list[str], np.ndarray | None]:
    """``docs`` with each run longer than ``MAX_WORD_CHARS`` cut into pieces of that many characters.

    Args:
        docs (``list[str]``): documents.

    Returns:
        ``(pieces, counts)``: ``counts[i]`` pieces in a row are document i; ``(docs, None)`` when no document
        holds such a run (then nothing was copied).

    Example::

        >>> pieces, counts = split_long_words(["short", "x" * (MAX_WORD_CHARS + 2) + " end"])
        >>> [len(p) for p in pieces], counts.tolist()
        ([5, 65536, 6], [1, 2])
    """
    cut: dict[int, list[str]] = {}
    for i, doc in enumerate(docs):
        if _may_have_long_run(doc):
            ends = [end for m in _LONG_RUN.finditer(doc) for end in range(m.start() + MAX_WORD_CHARS, m.end(),
                                                                          MAX_WORD_CHARS)]
            if ends:
                bounds = [0, *ends, len(doc)]
                cut[i] = [doc[a:b] for a, b in zip(bounds, bounds[1:])]
    if not cut:
        return docs, None
    pieces, counts = [], np.ones(len(docs), np.int64)
    for i, doc in enumerate(docs):
        if i in cut:
            pieces.extend(cut[i])
            counts[i] = len(cut[i])
        else:
            pieces.append(doc)
    return pieces, counts


def join_pieces(ids: np.ndarray, offsets: np.ndarray, counts: np.ndarray,
                framed: bool) -> tuple[np.ndarray, np.ndarray]:
    """The ids of the pieces ``split_long_words`` made, laid end to end per document: ``(ids, offsets)`` with
    document i at ``ids[offsets[i]:offsets[i+1]]``. ``framed``: each piece was encoded between BOS and EOS, which
    a document keeps only at its ends.

    Example::

        >>> ids, offsets = join_pieces(np.array([7, 1, 2, 3]), np.array([0, 1, 3, 4]), np.array([1, 2]), False)
        >>> ids.tolist(), offsets.tolist()
        ([7, 1, 2, 3], [0, 1, 4])
    """
    first = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=first[1:])  # the first piece of each document, and the end
    if framed:  # drop each inner piece's EOS and the next piece's BOS
        starts = offsets[:-1]
        inner = np.ones(len(starts), bool)
        inner[first[:-1]] = False  # a document's first piece keeps its BOS
        drop = np.zeros(len(ids), bool)
        drop[starts[inner]] = True
        drop[starts[inner] - 1] = True
        lengths = np.diff(offsets) - inner - np.roll(inner, -1)
        ids = ids[~drop]
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
    return ids, offsets[first]
