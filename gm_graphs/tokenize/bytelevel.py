"""A word cache for byte-level BPE tokenizers (GPT-2's scheme, SmolLM2's): the same ids for a fraction of the CPU.

A byte-level BPE tokenizer splits text into words with one regular expression and encodes each word on its own,
so a word's ids never depend on its neighbours. The fast tokenizer runs that split, BPE (or its cache) and builds
an ``Encoding`` for every token: about 1.1 µs of CPU a token here. A corpus of millions of documents repeats a few
million words. :class:`WordCache` splits documents with GPT-2's expression written out as a numba kernel over
their UTF-8 bytes (tested against the tokenizer's own split on every character it knows, in every context),
looks each word up in a bounded hash table filled by the tokenizer's own BPE model, and lays the words' ids end to
end, without the GIL. The kernel knows the characters whose classes (letter, number, space, other) have stood
since Unicode 4.1: ASCII, the Latin supplements and extensions (U+0080–U+024F), general punctuation
(U+2000–U+206F) and the replacement character. Documents with any other character, or with an added token's
text, are encoded by the tokenizer itself, so every document gets exactly the ids the tokenizer gives it.
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from gm_graphs.store.kernel_cache import ensure_cache_dir

ensure_cache_dir()  # before the cached kernels below are defined

# The characters the kernel knows, and each one's class in GPT-2's expression: \p{L}, \p{N}, \s (Unicode's
# White_Space: in ASCII \t \n \v \f \r and the space, not \x1c-\x1f, which Python's str.isspace also takes) or
# none of them. Documents with any other character go to the tokenizer.
_LETTER, _DIGIT, _SPACE, _OTHER, _UNKNOWN = 0, 1, 2, 3, 4
KNOWN = "\x00-\u024f\u2000-\u206f\ufffd"
_OUTSIDE = re.compile(f"[^{KNOWN}]")
_PARALLEL_BYTES = 1 << 16  # a batch of this much text is split on two threads


def _classes() -> np.ndarray:
    classes = np.full(0x10000, _UNKNOWN, np.uint8)
    for first, last in ((0, 0x24F), (0x2000, 0x206F), (0xFFFD, 0xFFFD)):
        for cp in range(first, last + 1):
            c = chr(cp)
            category = unicodedata.category(c)
            classes[cp] = (_LETTER if category[0] == "L" else _DIGIT if category[0] == "N"
                           else _SPACE if c.isspace() and not 0x1C <= cp <= 0x1F else _OTHER)
    return classes


CLASSES = _classes()
_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)


def _byte_symbols() -> list[str]:
    """GPT-2's map from each byte to the printable character that stands for it in the BPE vocabulary."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


_SYMBOLS = _byte_symbols()


def cacheable(backend) -> bool:
    """Whether ``backend`` (a ``tokenizers.Tokenizer``) is plain byte-level BPE, whose words :class:`WordCache`
    can encode: no normaliser, GPT-2's pre-tokenizer alone (its own expression, no prefix space), a BPE model
    without dropout, and neither truncation nor padding. Anything else (another expression, a normaliser, a
    sequence of pre-tokenizers) is encoded by the tokenizer itself."""
    config = json.loads(backend.to_str())
    pre, model = config.get("pre_tokenizer") or {}, config.get("model") or {}
    return (config.get("normalizer") is None and backend.truncation is None and backend.padding is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
            and model.get("type") == "BPE" and not model.get("dropout"))


@numba.njit(nogil=True, cache=True)
def _char(text, i):
    """The code point of the UTF-8 character at ``text[i]`` (one the kernel knows: three bytes at most), and its
    length in bytes."""
    b = text[i]
    if b < 0x80:
        return numba.int64(b), 1
    if b < 0xE0:
        return (numba.int64(b & 0x1F) << 6) | (text[i + 1] & 0x3F), 2
    return (numba.int64(b & 0x0F) << 12) | (numba.int64(text[i + 1] & 0x3F) << 6) | (text[i + 2] & 0x3F), 3


@numba.njit(nogil=True, cache=True)
def _word_end(text, i, end, classes):
    """Where the word of GPT-2's expression that starts at ``text[i]`` ends, in a document ending at ``end``; the
    expression's first alternative that matches wins: 's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+|
    ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    c, size = _char(text, i)
    if c == 39 and i + 1 < end:  # an apostrophe: 's 't 'm 'd, then 're 've 'll
        d = text[i + 1]
        if d == 115 or d == 116 or d == 109 or d == 100:
            return i + 2
        if i + 2 < end and ((d == 114 and text[i + 2] == 101) or (d == 118 and text[i + 2] == 101)
                            or (d == 108 and text[i + 2] == 108)):
            return i + 3
    kind = classes[c]
    if c == 32 and i + 1 < end:
        after, after_size = _char(text, i + 1)
        if classes[after] != _SPACE:  # a space joins the letters, digits or other characters after it
            kind, size = classes[after], 1 + after_size
    j = i + size
    if kind != _SPACE:
        while j < end:
            c, size = _char(text, j)
            if classes[c] != kind:
                break
            j += size
        return j
    last = i  # where the run's last space starts
    while j < end:
        c, size = _char(text, j)
        if classes[c] != _SPACE:
            break
        last = j
        j += size
    # \s+(?!\S) leaves the last space of a run to the word after it; a lone space before a word is \s+ itself
    return j if j == end or last == i else last


@numba.njit(nogil=True, cache=True)
def _hash(text, i, j):
    h = _FNV_OFFSET
    for k in range(i, j):
        h = (h ^ numba.uint64(text[k])) * _FNV_PRIME
    return h


@numba.njit(nogil=True, cache=True)
def _find(text, i, j, h, slots, arena, starts, sizes, hashes):
    """The word ``text[i:j]`` (hash ``h``) in the table, or -1."""
    mask = numba.uint64(len(slots) - 1)
    s = h & mask
    while True:
        w = slots[s]
        if w < 0:
            return -1
        if hashes[w] == h and sizes[w] == j - i:
            a = starts[w]
            k = 0
            while k < j - i and arena[a + k] == text[i + k]:
                k += 1
            if k == j - i:
                return w
        s = (s + numba.uint64(1)) & mask


@numba.njit(nogil=True, cache=True)
def _insert(slots, hashes, first, last):
    """Puts words ``first … last - 1`` (their hashes already in ``hashes``) into ``slots`` (linear probing)."""
    mask = numba.uint64(len(slots) - 1)
    for w in range(first, last):
        s = hashes[w] & mask
        while slots[s] >= 0:
            s = (s + numba.uint64(1)) & mask
        slots[s] = w


@numba.njit(nogil=True, cache=True)
def _split(text, i, n, doc_ends, classes, slots, arena, starts, sizes, hashes, word_start, word_size, word_hash,
           word):
    """Splits the documents of ``text`` from byte ``i`` (ending at ``doc_ends``) into words numbered from ``n`` and
    looks each up: word k is ``text[word_start[k]:word_start[k] + word_size[k]]``, ``word[k]`` its entry or -1.
    Returns the number after the last word; ``doc_ends`` is overwritten by each document's last word + 1."""
    for d in range(len(doc_ends)):
        end = doc_ends[d]
        while i < end:
            j = _word_end(text, i, end, classes)
            h = _hash(text, i, j)
            word_start[n], word_size[n], word_hash[n] = i, j - i, h
            word[n] = _find(text, i, j, h, slots, arena, starts, sizes, hashes)
            n += 1
            i = j
        doc_ends[d] = n
    return n


@numba.njit(nogil=True, cache=True)
def _lay_out(word, n, doc_words, id_starts, id_sizes, ids, out, doc_ends):
    """The ids of words ``word[:n]`` end to end in ``out``; ``doc_ends[d]`` where document d's ids end."""
    t = 0
    k = 0
    for d in range(len(doc_words)):
        while k < doc_words[d]:
            a = id_starts[word[k]]
            for m in range(id_sizes[word[k]]):
                out[t] = ids[a + m]
                t += 1
            k += 1
        doc_ends[d] = t
    return t


def split_words(text: str) -> list[str]:
    """The words GPT-2's expression splits ``text`` into, as :class:`WordCache` splits them (``text`` must hold only
    characters of ``KNOWN``).

    Example::

        >>> split_words("It's  2 caf\\u00e9s!\\n")
        ['It', "'s", ' ', ' 2', ' cafés', '!', '\\n']
    """
    if _OUTSIDE.search(text):
        raise ValueError(f"split_words takes characters of {KNOWN!r} only")
    data = np.frombuffer(text.encode("utf-8"), np.uint8)
    starts, sizes, word = (np.empty(len(data), np.int64) for _ in range(3))
    n = _split(data, 0, 0, np.array([len(data)], np.int64), CLASSES, np.full(1, -1, np.int64), np.zeros(0, np.uint8),
               np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint64), starts, sizes,
               np.empty(len(data), np.uint64), word)
    return [data[a:a + b].tobytes().decode("utf-8") for a, b in zip(starts[:n].tolist(), sizes[:n].tolist())]


class WordCache:
    """Encodes documents with a byte-level BPE tokenizer through a cache of word → ids.

    Args:
        backend (``tokenizers.Tokenizer``): a tokenizer for which :func:`cacheable` holds; its added tokens are
            read here, once.
        dtype: the ids' dtype.
        max_words (``int``): words kept at most; a word beyond is encoded for its batch and not kept (a million
            words take ~90 MB).

    Example::

        >>> from gm_graphs.tokenize.encoder import load_tokenizer
        >>> backend = load_tokenizer("smollm2").backend_tokenizer
        >>> cache = WordCache(backend, np.int32)
        >>> docs = ["the cat sat", "the dog sat", "caf\\u00e9 au lait", "\\u4e2d\\u6587"]
        >>> ids, offsets = cache.encode(docs)
        >>> [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == [
        ...     e.ids for e in backend.encode_batch(docs, add_special_tokens=False)]
        True
        >>> cache.words  # the, cat, sat, dog, café, au, lait: the Chinese went to the tokenizer
        7
    """

    def __init__(self, backend, dtype, *, max_words: int = 1 << 20):
        if max_words < 0:
            raise ValueError(f"max_words must be >= 0, got {max_words}")
        self._backend, self._model, self.dtype, self.max_words = backend, backend.model, dtype, max_words
        self._lock = threading.Lock()  # the kernels run without the GIL over arrays that encode grows and trims
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="graphmax-words")  # splits a batch's second half
        self.words = 0  # words kept
        self._slots = np.full(1 << 12, -1, np.int64)  # word numbers by hash, -1 where empty; at most half full
        self._arena, self._arena_used = np.zeros(1 << 16, np.uint8), 0  # the words' text, end to end
        self._ids, self._ids_used = np.zeros(1 << 16, dtype), 0  # the words' ids, end to end
        # per word: where its text starts in the arena, its length, hash, where its ids start and how many
        self._starts, self._sizes, self._id_starts, self._id_sizes = (np.zeros(1 << 10, np.int64) for _ in range(4))
        self._hashes = np.zeros(1 << 10, np.uint64)
        # An added token's text (<|im_start|>…) is one token wherever it appears: such documents go to the tokenizer.
        added = {t.content for t in backend.get_added_tokens_decoder().values() if t.content}
        self._added = {c: [t for t in added if t[0] == c] for c in {t[0] for t in added}}

    def _plain(self, doc: str) -> bool:
        return ((doc.isascii() or not _OUTSIDE.search(doc))
                and not any(c in doc and any(t in doc for t in texts) for c, texts in self._added.items()))

    def encode(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(ids, offsets)``: document i is ``ids[offsets[i]:offsets[i+1]]``, as the tokenizer gives it."""
        docs = [_exact(d) for d in docs]
        with self._lock:
            return self._encode(docs)

    def _encode(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        plain = [self._plain(d) for d in docs]
        parts = [d.encode("utf-8") for d, p in zip(docs, plain) if p]
        text = np.frombuffer(b"".join(parts), np.uint8)
        doc_words = np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)))
        n, word_start, word_size, word_hash, word = self._split(text, doc_words)
        missed = np.flatnonzero(word[:n] < 0)
        if len(missed):
            self._learn(text, word_start, word_size, word_hash, word, missed)
        doc_ends = np.empty(len(parts), np.int64)
        out = np.empty(int(self._id_sizes[word[:n]].sum()), self.dtype)
        _lay_out(word, n, doc_words, self._id_starts, self._id_sizes, self._ids, out, doc_ends)
        if self.words > self.max_words:  # the batch's words beyond the cap were encoded for it alone
            self.words = self.max_words
            self._arena_used, self._ids_used = int(self._starts[self.words]), int(self._id_starts[self.words])
        others = [d for d, p in zip(docs, plain) if not p]
        other_lists = ([e.ids for e in self._backend.encode_batch_fast(others, add_special_tokens=False)]
                       if others else [])  # most batches have none: no call into the tokenizer
        return _interleave(out, doc_ends, plain, other_lists, self.dtype)

    def _split(self, text: np.ndarray, doc_words: np.ndarray) -> tuple:
        """``_split`` over the whole batch: the second half of a large batch on the helper thread, at once (the
        table is only read); its words are written from index ``b``, the first half's bytes, which the first half's
        words cannot pass, then moved up behind them."""
        word_start, word_size, word = (np.empty(len(text), np.int64) for _ in range(3))
        word_hash = np.empty(len(text), np.uint64)
        table = (CLASSES, self._slots, self._arena, self._starts, self._sizes, self._hashes, word_start, word_size,
                 word_hash, word)
        k = int(np.searchsorted(doc_words, len(text) // 2)) + 1 if len(text) >= _PARALLEL_BYTES else len(doc_words)
        if k >= len(doc_words):
            return _split(text, 0, 0, doc_words, *table), word_start, word_size, word_hash, word
        b = int(doc_words[k - 1])
        second = self._helper.submit(_split, text, b, b, doc_words[k:], *table)
        n1 = _split(text, 0, 0, doc_words[:k], *table)
        n2 = second.result() - b
        for a in (word_start, word_size, word_hash, word):
            a[n1:n1 + n2] = a[b:b + n2]
        doc_words[k:] -= b - n1
        return n1 + n2, word_start, word_size, word_hash, word

    def _learn(self, text, word_start, word_size, word_hash, word, missed) -> None:
        """Encodes the batch's unknown words with the BPE model, stores them after the words kept (the table takes
        those within the cap), and points ``word`` at them."""
        new: dict[bytes, int] = {}
        hashes = []
        for k in missed.tolist():
            key = text[word_start[k]:word_start[k] + word_size[k]].tobytes()
            w = new.get(key)
            if w is None:
                w = new[key] = self.words + len(new)
                hashes.append(word_hash[k])
            word[k] = w
        encoded = [[t.id for t in self._model.tokenize("".join(_SYMBOLS[b] for b in key))] for key in new]
        first, last = self.words, self.words + len(new)
        sizes = np.fromiter(map(len, new), np.int64, len(new))
        id_sizes = np.fromiter(map(len, encoded), np.int64, len(new))
        arena_end, ids_end = self._arena_used + int(sizes.sum()), self._ids_used + int(id_sizes.sum())
        self._grow(last, arena_end, ids_end)
        self._starts[first:last] = self._arena_used + np.cumsum(sizes) - sizes
        self._sizes[first:last], self._hashes[first:last] = sizes, hashes
        self._id_starts[first:last] = self._ids_used + np.cumsum(id_sizes) - id_sizes
        self._id_sizes[first:last] = id_sizes
        self._arena[self._arena_used:arena_end] = np.frombuffer(b"".join(new), np.uint8)
        self._ids[self._ids_used:ids_end] = [i for ids in encoded for i in ids]
        self._arena_used, self._ids_used, self.words = arena_end, ids_end, last
        kept = min(last, self.max_words)
        if 2 * kept > len(self._slots):
            self._slots = np.full(1 << (4 * kept).bit_length(), -1, np.int64)
            first = 0
        _insert(self._slots, self._hashes, first, kept)

    def _grow(self, words: int, text: int, ids: int) -> None:
        """Room for ``words`` words of ``text`` bytes and ``ids`` ids in all."""
        if words > len(self._starts):
            size = max(words, 2 * len(self._starts))
            self._starts, self._sizes, self._id_starts, self._id_sizes, self._hashes = (
                np.resize(a, size) for a in (self._starts, self._sizes, self._id_starts, self._id_sizes, self._hashes))
        if text > len(self._arena):
            self._arena = np.resize(self._arena, max(text, 2 * len(self._arena)))
        if ids > len(self._ids):
            self._ids = np.resize(self._ids, max(ids, 2 * len(self._ids)))


def _exact(doc) -> str:
    """``doc`` as a plain ``str``: the kernels trust its length and characters, which a subclass could misreport."""
    if type(doc) is str:
        return doc
    if not isinstance(doc, str):
        raise TypeError(f"documents are str, got {type(doc).__name__}")
    return str.__str__(doc)


def _interleave(out: np.ndarray, doc_ends: np.ndarray, plain: list[bool], other_lists: list[list[int]],
                dtype) -> tuple[np.ndarray, np.ndarray]:
    """One id array in document order from the cached documents' ids (``out``, each ending at ``doc_ends``) and the
    tokenizer's lists for the others."""
    offsets = np.zeros(len(plain) + 1, np.int64)
    if not other_lists:
        offsets[1:] = doc_ends
        return out, offsets
    pieces, ends, start, others = [], iter(doc_ends.tolist()), 0, iter(other_lists)
    for p in plain:
        if p:
            end = next(ends)
            pieces.append(out[start:end])
            start = end
        else:
            pieces.append(np.asarray(next(others), dtype))
    np.cumsum([len(piece) for piece in pieces], out=offsets[1:])
    return np.concatenate(pieces).astype(dtype, copy=False), offsets
