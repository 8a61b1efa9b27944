"""Bounds on what a tokenizer is handed at once: one word, and one call's worth of a long document.

A tokenizer's pre-tokenizer cuts text into words, and BPE then works on each word whole: Hugging Face's BPE holds
about 60-100 bytes of memory per byte of the word (``Word::merge_all``), so one 32 MB word, a document that is a
single run of letters, costs 2-3 GB, and a 40 MB one ended in SIGABRT under a 6 GB limit. No pre-tokenizer cuts a
run of characters of one kind (letters, or white space), so graphmax does: a run of more than
``MAX_WORD_CHARS`` characters without white space, or of white space alone, is cut every ``MAX_WORD_CHARS``
characters. The Rust tokenizer also keeps 150-300 bytes per token of a document until it is done with it (an
``Encoding``: each token's text, offsets and masks), so a document longer than ``MAX_PIECE_CHARS`` characters is
cut too, before a white space that precedes text (where GPT-2's expression, SmolLM2's, starts a word anyway, so
its ids do not change), and handed over ``MAX_PIECE_CHARS`` characters at a time. The pieces' ids are laid end to
end in the document's place: only the tokens at a cut inside a run can differ from what the tokenizer gives the
whole document, and a document shorter than ``MAX_PIECE_CHARS`` without such a run (every real one measured) is
encoded as it is.

Both bounds were chosen by measurement with SmolLM2's tokenizer (benchmarks/RESULTS.md): one word of 65,536
characters takes at most ~26 MB while it is encoded (four-byte emoji; ~2 MB for ASCII letters), where 1 M letters
take ~55-90 MB and 32 M letters ~1.7 GB; a piece of 262,144 characters takes at most ~120 MB (emoji: 786,432
tokens). The worst 32 MB document then peaks at 1.2 GB in a whole build, where it took up to 5.6 GB.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

MAX_WORD_CHARS = 1 << 16
MAX_PIECE_CHARS = 1 << 18
_HALF = MAX_WORD_CHARS // 2
_SPACE, _TEXT = re.compile(r"\s"), re.compile(r"\S")
# A run longer than the bound, from its start (a lookbehind, so that a long run is scanned once, not from each of
# its characters).
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_WORD_CHARS + 1},}}|(?<!\s)\s{{{MAX_WORD_CHARS + 1},}}")
_BEFORE_TEXT = re.compile(r"\s(?=\S)")  # a white space that precedes text: a cut there starts a word anyway

Encode = Callable[[list[str]], tuple[np.ndarray, np.ndarray]]


def _may_have_long_run(doc: str) -> bool:
    """Whether ``doc`` may hold a run longer than ``MAX_WORD_CHARS``: such a run covers a whole one of the
    aligned blocks of ``MAX_WORD_CHARS / 2`` characters, which then holds one kind of character only. Each block
    costs a search that stops at its first space (or first other character): a few steps in real text."""
    if len(doc) <= MAX_WORD_CHARS:
        return False
    return any(_SPACE.search(doc, start, start + _HALF) is None or _TEXT.search(doc, start, start + _HALF) is None
               for start in range(0, len(doc) - _HALF + 1, _HALF))


def _cut_before_text(doc: str, start: int, end: int) -> int:
    """The last place in ``(start, end]`` just before a white space that precedes text, else ``end``."""
    for tail in (4096, MAX_WORD_CHARS):
        last = None
        for m in _BEFORE_TEXT.finditer(doc, max(start + 1, end - tail), min(len(doc), end + 2)):
            if m.start() <= end:
                last = m.start()
        if last is not None:
            return last
    return end


def _cuts(doc: str) -> list[int]:
    """Where ``doc`` is cut: every ``MAX_WORD_CHARS`` characters inside a longer run, and so that no piece is
    longer than ``MAX_PIECE_CHARS``."""
    runs = []
    if _may_have_long_run(doc):
        runs = [end for m in _LONG_RUN.finditer(doc) for end in range(m.start() + MAX_WORD_CHARS, m.end(),
                                                                      MAX_WORD_CHARS)]
    if len(doc) <= MAX_PIECE_CHARS:
        return runs
    cuts, start = [], 0
    for end in [*runs, len(doc)]:
        while end - start > MAX_PIECE_CHARS:
            start = _cut_before_text(doc, start, start + MAX_PIECE_CHARS)
            cuts.append(start)
        if end < len(doc):
            cuts.append(end)
        start = end
    return cuts


def split_long_words(docs: list[str]) -> tuple[list[str], np.ndarray | None]:
    """``docs`` cut into pieces for a tokenizer: each run longer than ``MAX_WORD_CHARS`` every that many characters,
    and each document into pieces of at most ``MAX_PIECE_CHARS`` characters.

    Args:
        docs (``list[str]``): documents.

    Returns:
        ``(pieces, counts)``: ``counts[i]`` pieces in a row are document i; ``(docs, None)`` when no document
        needs cutting (then nothing was copied).

    Example::

        >>> pieces, counts = split_long_words(["short", "x" * (MAX_WORD_CHARS + 2) + " end"])
        >>> [len(p) for p in pieces], counts.tolist()
        ([5, 65536, 6], [1, 2])
    """
    cut: dict[int, list[str]] = {}
    for i, doc in enumerate(docs):
        if len(doc) > MAX_WORD_CHARS:
            ends = _cuts(doc)
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


def _groups(pieces: list[str]) -> Iterator[list[str]]:
    """``pieces`` in consecutive groups of at most ``MAX_PIECE_CHARS`` characters (a longer piece alone)."""
    group: list[str] = []
    size = 0
    for piece in pieces:
        if group and size + len(piece) > MAX_PIECE_CHARS:
            yield group
            group, size = [], 0
        group.append(piece)
        size += len(piece)
    if group:
        yield group


def encode_in_pieces(encode: Encode, docs: list[str], framed: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """``encode(docs)`` with every document cut by ``split_long_words`` and handed to ``encode`` at most
    ``MAX_PIECE_CHARS`` characters at a time, the pieces' ids laid end to end; None when no document needs it
    (then the caller encodes ``docs`` itself). ``framed``: ``encode`` puts BOS and EOS around each document."""
    pieces, counts = split_long_words(docs)
    if counts is None:
        return None
    ids, lengths = [], []
    for group in _groups(pieces):
        group_ids, group_offsets = encode(group)
        ids.append(group_ids)
        lengths.append(np.diff(group_offsets))
    offsets = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum(np.concatenate(lengths), out=offsets[1:])
    return join_pieces(np.concatenate(ids), offsets, counts, framed)
