"""A synthetic benchmark corpus at the scale graphmax is sold for: millions of review-like documents as Parquet.

    python3 benchmarks/synth_corpus.py --out /data/synth4m                 # 4,000,000 documents, seed 0
    python3 benchmarks/synth_corpus.py --out /data/synth4m --count         # … then tokens and distinct n-grams
    python3 benchmarks/synth_corpus.py --count-only /data/synth4m --count-docs 500000   # measure the first 0.5M

The text is sampled from an interpolated Kneser–Ney trigram model of words, estimated from the three bundled
corpora (gm_graphs.corpus.bundled.CORPORA: movie reviews, drug reviews, news articles). "Words" are the pre-tokens of
the GPT-2 / SmolLM2 byte-level BPE (" movie", "'s", ",", "\\n"), so a document's SmolLM2 length is close to the
sum of its words' token counts, which the sampler tracks. Each document draws a target length from the real
documents' lengths (in tokens) scaled by ``MEAN_TOKENS / their mean``, samples words until the target, then
stops at the next sentence end (or 25 % past the target); a document the model ends early continues with a new
paragraph. A document equal to a bundled one (or holding no text) is drawn again.

Document i depends only on (seed, i): the same seed gives the same bytes, and a corpus of n documents is the
first n documents of any larger one. Shards hold ``--shard-docs`` documents (default 250,000) in order, named
``part-00000.parquet`` …, so with the defaults the first 2 / 4 / 8 / 16 shards are the 0.5M / 1M / 2M / 4M
corpora (``part-0000[0-1].parquet`` is the 0.5M one).

The folder: created if absent; an empty folder is used; a folder holding this script's manifest
(``graphmax-synth.json``, listing shards, documents, seed and model) is replaced only with ``--overwrite``, and
only if it holds nothing else; any other non-empty folder is refused. Each shard is written to a temporary
name and renamed; the manifest says ``"status": "complete"`` only once every shard is in place.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "graphmax-synth.json"
KIND = "graphmax synthetic corpus"
FORMAT_VERSION = 1
SHARD = "part-{:05d}.parquet"
# The target lengths' mean, in SmolLM2 tokens. Documents run on to a sentence end, so they come out ~9 tokens
# longer (measured with seed 0): ~79 per document, like product reviews (an earlier 4M corpus had 79).
MEAN_TOKENS = 70.0
MIN_TOKENS = 3  # shortest target length
DISCOUNT = 0.9  # Kneser–Ney discount of the trigram and bigram levels; nearer 1 backs off more, more novel text
MAX_ATTEMPTS = 64  # redraws of a document that equals a bundled one or has no text
# GPT-2's pre-tokenizer with Python's re: letters are [^\W\d_], digits \d; close enough for counting
# tokens, since each word's token count is measured by the tokenizer itself.
_WORD = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")
_BOS, _EOS, _SEP = 0, 1, 2  # special word ids: document start, document end, paragraph separator " "
_SPECIALS = ("", "", " ")
_SENTENCE_END = (".", "!", "?", '."', '!"', '?"', "...", ".)", "\n")


class SynthError(Exception):
    """A bad argument or a folder this script must not touch."""


@dataclass
class Model:
    """An interpolated Kneser–Ney trigram model over words, as flat arrays for the numba sampler.

    Trigram rows are indexed by state: 0 is the document start (BOS, BOS), s ≥ 1 the bigram entry s − 1,
    i.e. the context (v, w) of that entry. Every ``*_cum`` array holds a row's cumulative discounted
    weights; ``*_tot`` the row's undiscounted total, so a uniform above the discounted total backs off.
    """

    words: list[str]
    word_bytes: np.ndarray  # uint8, all words' UTF-8 bytes
    word_off: np.ndarray  # int64, word i is word_bytes[word_off[i]:word_off[i+1]]
    word_tokens: np.ndarray  # int32, SmolLM2 tokens of each word alone (≥ 1)
    word_flags: np.ndarray  # uint8, bit 0: ends a sentence, bit 1: holds non-space text
    b_ptr: np.ndarray
    b_next: np.ndarray
    b_cum: np.ndarray
    b_tot: np.ndarray
    t_ptr: np.ndarray
    t_next: np.ndarray
    t_state: np.ndarray
    t_cum: np.ndarray
    t_tot: np.ndarray
    u_cum: np.ndarray
    real_lengths: np.ndarray  # int32, token lengths of the real documents
    scale: float
    bundled_hashes: np.ndarray  # uint64, sorted FNV-1a hashes of the real documents' bytes
    sources: list[dict]

    def describe(self) -> dict:
        return {"kind": "interpolated Kneser-Ney word trigram", "discount": DISCOUNT,
                "mean_tokens_target": float(self.scale * self.real_lengths.mean()), "min_tokens": MIN_TOKENS,
                "length_scale": self.scale,
                "words": len(self.words), "bigrams": int(self.b_next.size), "trigrams": int(self.t_next.size),
                "sources": self.sources}


# ---------------------------------------------------------------- estimation


def real_documents() -> tuple[list[str], list[dict]]:
    """The bundled corpora's documents (cleaned as graphmax reads them), and where they came from."""
    from gm_graphs import bundled
    from gm_graphs.corpus.read import expand_corpus, iter_documents
    from gm_graphs.format.graph_files import sha256_file

    docs: list[str] = []
    sources = []
    for name, c in bundled.CORPORA.items():
        path = c.path()
        n = len(docs)
        for batch in iter_documents(expand_corpus(path), c.text_column, clean=c.clean):
            docs.extend(batch)
        sources.append({"corpus": name, "file": path.name, "sha256": sha256_file(path), "documents": len(docs) - n})
    return docs, sources


def _fnv1a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@numba.njit(cache=True)
def _fnv1a_many(data, off):
    out = np.empty(off.size - 1, dtype=np.uint64)
    for i in range(off.size - 1):
        h = np.uint64(0xCBF29CE484222325)
        for k in range(off[i], off[i + 1]):
            h = (h ^ np.uint64(data[k])) * np.uint64(0x100000001B3)
        out[i] = h
    return out


@numba.njit(cache=True)
def _sequences(ids, doc_off, n_words):
    """Bigram keys over [BOS, w…, EOS] and trigram keys over [BOS, BOS, w…, EOS] of every document."""
    n_docs = doc_off.size - 1
    n_b = ids.size + n_docs
    bkeys = np.empty(n_b, dtype=np.int64)
    tkeys = np.empty(n_b, dtype=np.int64)
    V = np.int64(n_words)
    k = 0
    for d in range(n_docs):
        u = np.int64(0)
        v = np.int64(0)
        for i in range(doc_off[d], doc_off[d + 1] + 1):
            w = np.int64(ids[i]) if i < doc_off[d + 1] else np.int64(1)
            bkeys[k] = v * V + w
            tkeys[k] = (u * V + v) * V + w
            k += 1
            u = v
            v = w
    return bkeys, tkeys


@numba.njit(cache=True)
def _row_cumsum(ptr, weights, discount):
    cum = np.empty(weights.size, dtype=np.float64)
    tot = np.zeros(ptr.size - 1, dtype=np.float64)
    for r in range(ptr.size - 1):
        s = 0.0
        t = 0.0
        for k in range(ptr[r], ptr[r + 1]):
            s += max(weights[k] - discount, 0.0)
            t += weights[k]
            cum[k] = s
        tot[r] = t
    return cum, tot


def estimate(docs: list[str], sources: list[dict], tokenizer=None, mean_tokens: float = MEAN_TOKENS) -> Model:
    """Estimate the model from real documents; target lengths are theirs scaled to a mean of ``mean_tokens``."""
    from gm_graphs.tokenize.encoder import load_tokenizer

    tok = load_tokenizer(tokenizer or "smollm2")
    split = [_WORD.findall(d) for d in docs]
    if sum(len(w) for s in split for w in s) != sum(map(len, docs)):  # the pattern must cover every character
        raise AssertionError("the word pattern skipped characters")
    doc_off = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in split], out=doc_off[1:])
    encoded = pa.array([w for s in split for w in s], pa.string()).dictionary_encode()
    del split
    words = [*_SPECIALS, *encoded.dictionary.to_pylist()]
    ids = encoded.indices.to_numpy().astype(np.int32) + len(_SPECIALS)
    V = len(words)

    raw = [w.encode("utf-8") for w in words]
    word_off = np.zeros(V + 1, dtype=np.int64)
    np.cumsum([len(b) for b in raw], out=word_off[1:])
    word_bytes = np.frombuffer(b"".join(raw), dtype=np.uint8)
    enc = tok.backend_tokenizer.encode_batch_fast(words[len(_SPECIALS):], add_special_tokens=False)
    word_tokens = np.ones(V, dtype=np.int32)
    word_tokens[len(_SPECIALS):] = np.maximum(1, [len(e.ids) for e in enc])
    flags = np.array([(w.endswith(_SENTENCE_END)) | (2 * (not w.isspace() and w != "")) for w in words], np.uint8)
    flags[_EOS] = 0

    bkeys, tkeys = _sequences(ids, doc_off, V)
    b_keys, b_counts = np.unique(bkeys, return_counts=True)
    t_keys, t_counts = np.unique(tkeys, return_counts=True)
    del bkeys, tkeys
    b_src, b_next = b_keys // V, (b_keys % V).astype(np.int32)
    b_ptr = np.zeros(V + 1, dtype=np.int64)
    np.cumsum(np.bincount(b_src, minlength=V), out=b_ptr[1:])

    t_ctx, t_next = t_keys // V, (t_keys % V).astype(np.int32)
    t_row = np.searchsorted(b_keys, t_ctx) + 1  # context (u, v) is bigram entry t_row − 1 …
    t_row[t_ctx == 0] = 0  # … except (BOS, BOS), the start state
    t_ptr = np.zeros(b_keys.size + 2, dtype=np.int64)
    np.cumsum(np.bincount(t_row, minlength=b_keys.size + 1), out=t_ptr[1:])
    t_state = (np.searchsorted(b_keys, (t_ctx % V) * V + t_next) + 1).astype(np.int64)  # the context (v, w)
    t_cum, t_tot = _row_cumsum(t_ptr, t_counts.astype(np.float64), DISCOUNT)
    # Kneser–Ney: the bigram level counts distinct left words of (v, w), the unigram level distinct left words of w
    b_cont = np.bincount(t_state - 1, minlength=b_keys.size).astype(np.float64)
    b_cum, b_tot = _row_cumsum(b_ptr, b_cont, DISCOUNT)
    u_cum = np.cumsum(np.bincount(b_next, minlength=V).astype(np.float64))

    lengths = np.add.reduceat(word_tokens[ids], doc_off[:-1]).astype(np.int32)
    data = [d.encode("utf-8") for d in docs]
    off = np.zeros(len(data) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in data], out=off[1:])
    hashes = np.sort(_fnv1a_many(np.frombuffer(b"".join(data), np.uint8), off))
    return Model(words, word_bytes, word_off, word_tokens, flags, b_ptr, b_next, b_cum, b_tot, t_ptr,
                 t_next, t_state, t_cum, t_tot, u_cum, lengths, mean_tokens / float(lengths.mean()), hashes,
                 sources)


# ---------------------------------------------------------------- sampling

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(cache=True, inline="always")
def _mix(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True, inline="always")
def _uniform(state):
    """(a uniform in [0, 1), the next state): splitmix64."""
    state = state + _GOLDEN
    return float(_mix(state) >> np.uint64(11)) * (1.0 / 9007199254740992.0), state


@numba.njit(cache=True)
def _doc_state(seed, doc, attempt):
    return _mix(_mix(np.uint64(seed) ^ np.uint64(0x5EED5EED5EED5EED)) + np.uint64(doc) * _GOLDEN
                + np.uint64(attempt) * np.uint64(0xD1B54A32D192ED03))


@numba.njit(cache=True)
def _target(state, real_lengths, scale):
    u, state = _uniform(state)
    r, state = _uniform(state)
    length = int(real_lengths[min(int(u * real_lengths.size), real_lengths.size - 1)] * scale + r)
    return max(length, MIN_TOKENS), state


@numba.njit(cache=True)
def cap(length):
    """The token count at which a document of target ``length`` (a number or an array) stops even mid-sentence."""
    return length + length // 4 + 4


@numba.njit(cache=True)
def _find(row_next, w):
    i = np.searchsorted(row_next, w)
    return i if i < row_next.size and row_next[i] == w else -1


@numba.njit(cache=True)
def _step(state, v, rng, b_ptr, b_next, b_cum, b_tot, t_ptr, t_next, t_state, t_cum, t_tot, u_cum):
    """Sample the word after the context (state, v); returns (word, new state, rng)."""
    if state >= 0:
        a, b = t_ptr[state], t_ptr[state + 1]
        u, rng = _uniform(rng)
        r = u * t_tot[state]
        if b > a and r < t_cum[b - 1]:
            k = a + np.searchsorted(t_cum[a:b], r, side="right")
            return t_next[k], t_state[k], rng
    a, b = b_ptr[v], b_ptr[v + 1]
    u, rng = _uniform(rng)
    r = u * b_tot[v]
    if b > a and r < b_cum[b - 1]:
        k = a + np.searchsorted(b_cum[a:b], r, side="right")
        return b_next[k], k + 1, rng
    u, rng = _uniform(rng)
    w = np.searchsorted(u_cum, u * u_cum[-1], side="right")
    k = _find(b_next[a:b], w)
    return w, (a + k + 1) if k >= 0 else -1, rng


@numba.njit(cache=True, parallel=True)
def _sample_words(first, seed, lengths, slot_off, words, counts, tokens, word_bytes, word_off, word_tokens,
                  word_flags, b_ptr, b_next, b_cum, b_tot, t_ptr, t_next, t_state, t_cum, t_tot, u_cum, hashes):
    """Documents first … first+n−1 into their word slots; returns each document's byte length (−1: no
    acceptable draw within MAX_ATTEMPTS)."""
    nbytes = np.full(lengths.size, -1, dtype=np.int64)
    for i in numba.prange(lengths.size):
        doc = first + i
        base = slot_off[i]
        length = lengths[i]
        limit = cap(length)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            rng = _doc_state(seed, doc, attempt)
            state, v, m, tok, size, text = 0, 0, 0, 0, 0, False
            h = np.uint64(0xCBF29CE484222325)
            while True:
                w, state, rng = _step(state, v, rng, b_ptr, b_next, b_cum, b_tot, t_ptr, t_next, t_state, t_cum,
                                      t_tot, u_cum)
                if w == 1:  # the model ends the document
                    if 4 * tok >= 3 * length:
                        break
                    w, state = 2, 0  # too short: a new paragraph from the start state
                    v = 0
                else:
                    v = w
                if m < slot_off[i + 1] - base:
                    words[base + m] = w
                m += 1
                tok += word_tokens[w]
                size += word_off[w + 1] - word_off[w]
                text = text or (word_flags[w] & 2) != 0
                for k in range(word_off[w], word_off[w + 1]):
                    h = (h ^ np.uint64(word_bytes[k])) * np.uint64(0x100000001B3)
                if tok >= limit or (tok >= length and (word_flags[w] & 1) != 0):
                    break
            j = np.searchsorted(hashes, h)
            if text and not (j < hashes.size and hashes[j] == h):
                counts[i] = m
                tokens[i] = tok
                nbytes[i] = size
                break
    return nbytes


@numba.njit(cache=True, parallel=True)
def targets(first, n, seed, real_lengths, scale):
    """The target lengths (SmolLM2 tokens) of documents first … first+n−1, drawn from their own streams."""
    out = np.empty(n, dtype=np.int64)
    for i in numba.prange(n):
        out[i], _ = _target(_doc_state(seed, first + i, 0), real_lengths, scale)
    return out


@numba.njit(cache=True, parallel=True)
def _write_bytes(slot_off, counts, words, byte_off, word_bytes, word_off, out):
    for i in numba.prange(counts.size):
        p = byte_off[i]
        for m in range(counts[i]):
            w = words[slot_off[i] + m]
            for k in range(word_off[w], word_off[w + 1]):
                out[p] = word_bytes[k]
                p += 1


def sample_shard(model: Model, first: int, n: int, seed: int) -> tuple[pa.StringArray, np.ndarray]:
    """Documents ``first`` … ``first + n − 1`` as a string array, and each one's SmolLM2 length as estimated by
    the sampler (the sum of its words' token counts)."""
    m = model
    lengths = targets(first, n, seed, m.real_lengths, m.scale)
    slot_off = np.zeros(n + 1, dtype=np.int64)  # every word adds at least a token and sampling stops at the cap
    np.cumsum(cap(lengths) + 1, out=slot_off[1:])
    words = np.empty(slot_off[-1], dtype=np.int32)
    counts = np.empty(n, dtype=np.int64)
    tokens = np.empty(n, dtype=np.int64)
    nbytes = _sample_words(first, seed, lengths, slot_off, words, counts, tokens, m.word_bytes, m.word_off,
                           m.word_tokens, m.word_flags, m.b_ptr, m.b_next, m.b_cum, m.b_tot, m.t_ptr, m.t_next,
                           m.t_state, m.t_cum, m.t_tot, m.u_cum, m.bundled_hashes)
    if (nbytes < 0).any():
        raise SynthError(f"document {first + int(np.argmax(nbytes < 0)):,} equalled a bundled document or held no "
                         f"text in {MAX_ATTEMPTS} draws; try another --seed")
    if (counts > slot_off[1:] - slot_off[:-1]).any():  # cannot happen: see slot_off
        raise AssertionError("a document outgrew its word slot")
    byte_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nbytes, out=byte_off[1:])
    if byte_off[-1] >= 2**31:
        raise SynthError(f"a shard of {n:,} documents holds {byte_off[-1]:,} bytes, over a string column's 2 GiB; "
                         f"use a smaller --shard-docs")
    data = np.empty(byte_off[-1], dtype=np.uint8)
    _write_bytes(slot_off, counts, words, byte_off, m.word_bytes, m.word_off, data)
    arr = pa.StringArray.from_buffers(n, pa.py_buffer(byte_off.astype(np.int32)), pa.py_buffer(data))
    arr.validate(full=True)  # the words are whole UTF-8 strings, so this only guards the kernel
    return arr, tokens


# ---------------------------------------------------------------- the folder


def _read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return m if isinstance(m, dict) and m.get("kind") == KIND else None


def _write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, folder / MANIFEST)


def prepare_folder(folder: Path, overwrite: bool) -> None:
    """Create ``folder``, or check that it may be written: empty, or a corpus this script wrote (``overwrite``)."""
    if folder.exists() and not folder.is_dir():
        raise SynthError(f"{folder} is a file, not a folder; name a new or empty folder")
    if not folder.exists():
        folder.mkdir(parents=True)
        return
    entries = sorted(p.name for p in folder.iterdir())
    if not entries:
        return
    old = _read_manifest(folder)
    if old is None:
        raise SynthError(f"{folder} is not empty and holds no {MANIFEST}, so graphmax did not write it; "
                         f"name a new or empty folder")
    ours = {MANIFEST, f".{MANIFEST}.tmp", *(s["file"] for s in old.get("shards", [])),
            *(f".{s['file']}.tmp" for s in old.get("shards", []))}
    foreign = [e for e in entries if e not in ours]
    if foreign:
        raise SynthError(f"{folder} holds a synthetic corpus and also files graphmax did not write "
                         f"({', '.join(foreign[:5])}); move them away or name another folder")
    if not overwrite:
        raise SynthError(f"{folder} already holds a synthetic corpus ({old.get('docs', '?'):,} documents, seed "
                         f"{old.get('seed', '?')}, {old.get('status', '?')}); pass --overwrite to replace it")
    for e in entries:
        if e != MANIFEST:
            (folder / e).unlink()
    (folder / MANIFEST).unlink()


def write_corpus(folder: Path, docs: int, seed: int = 0, shard_docs: int = 250_000, *, overwrite: bool = False,
                 model: Model | None = None, log=print) -> dict:
    """Write ``docs`` documents as Parquet shards into ``folder``; returns the manifest."""
    from gm_graphs.format.graph_files import sha256_file

    if docs < 1:
        raise SynthError(f"--docs must be at least 1, got {docs}")
    if shard_docs < 1:
        raise SynthError(f"--shard-docs must be at least 1, got {shard_docs}")
    if not 0 <= seed < 2**63:
        raise SynthError(f"--seed must be in [0, 2**63), got {seed}")
    folder = Path(folder)
    prepare_folder(folder, overwrite)
    t0 = time.perf_counter()
    if model is None:
        model = estimate(*real_documents())
        log(f"model: {len(model.words):,} words, {model.b_next.size:,} bigrams, {model.t_next.size:,} trigrams "
            f"from {model.real_lengths.size:,} real documents ({time.perf_counter() - t0:.1f} s)")
    plan = [(SHARD.format(k), start, min(shard_docs, docs - start)) for k, start in
            enumerate(range(0, docs, shard_docs))]
    manifest = {"kind": KIND, "format_version": FORMAT_VERSION, "status": "writing", "seed": seed, "docs": docs,
                "shard_docs": shard_docs, "text_column": "text", "model": model.describe(),
                "shards": [{"file": f, "first_doc": s, "docs": n} for f, s, n in plan]}
    _write_manifest(folder, manifest)
    schema = pa.schema([("text", pa.string())])
    total_bytes = total_tokens = 0
    for entry in manifest["shards"]:
        arr, tokens = sample_shard(model, entry["first_doc"], entry["docs"], seed)
        tmp = folder / f".{entry['file']}.tmp"
        pq.write_table(pa.Table.from_arrays([arr], schema=schema), tmp, compression="zstd", use_dictionary=False,
                       write_statistics=False, row_group_size=50_000)
        os.replace(tmp, folder / entry["file"])
        entry.update(text_bytes=len(arr.buffers()[2]), tokens_estimate=int(tokens.sum()),
                     file_bytes=(folder / entry["file"]).stat().st_size, sha256=sha256_file(folder / entry["file"]))
        total_bytes += entry["text_bytes"]
        total_tokens += entry["tokens_estimate"]
        log(f"{entry['file']}: documents {entry['first_doc']:,}–{entry['first_doc'] + entry['docs'] - 1:,}, "
            f"{entry['text_bytes'] / 2**20:,.0f} MiB of text ({time.perf_counter() - t0:.0f} s)")
    manifest.update(status="complete", text_bytes=total_bytes, tokens_estimate=total_tokens)
    _write_manifest(folder, manifest)
    return manifest


# ---------------------------------------------------------------- measuring


@numba.njit(cache=True)
def _ngram_keys(ids, offsets, order, vocab):
    """Keys of every n-gram of ``order`` inside one document, in base ``vocab``."""
    n = 0
    for d in range(offsets.size - 1):
        n += max(0, offsets[d + 1] - offsets[d] - order + 1)
    out = np.empty(n, dtype=np.uint64)
    k = 0
    for d in range(offsets.size - 1):
        for i in range(offsets[d], offsets[d + 1] - order + 1):
            key = np.uint64(0)
            for j in range(order):
                key = key * np.uint64(vocab) + np.uint64(ids[i + j])
            out[k] = key
            k += 1
    return out


@numba.njit(cache=True)
def _partition(keys, bits):
    """Keys reordered by the top ``bits`` bits of a multiplicative hash, and each part's bounds."""
    parts = np.uint64(1) << np.uint64(bits)
    pid = ((keys * _GOLDEN) >> np.uint64(64 - bits)).astype(np.int64)
    start = np.zeros(int(parts) + 1, dtype=np.int64)
    for p in pid:
        start[p + 1] += 1
    for p in range(int(parts)):
        start[p + 1] += start[p]
    fill = start[:-1].copy()
    out = np.empty_like(keys)
    for i in range(keys.size):
        out[fill[pid[i]]] = keys[i]
        fill[pid[i]] += 1
    return out, start


def count_corpus(folder: Path, max_docs: int | None = None, orders=(2, 3, 4), log=print) -> dict:
    """SmolLM2 tokens and distinct n-grams (within documents) of the corpus in ``folder`` or its first documents.

    The n-gram keys are hash-partitioned into files on disk (8 bytes per n-gram position), then each
    part is de-duplicated on its own, so memory stays at a part's size.
    """
    from gm_graphs.tokenize.encoder import BatchEncoder, load_tokenizer

    folder = Path(folder)
    manifest = _read_manifest(folder)
    if manifest is None or manifest.get("status") != "complete":
        raise SynthError(f"{folder} holds no complete synthetic corpus ({MANIFEST}); write one first")
    encoder = BatchEncoder(load_tokenizer("smollm2"))
    bundled = set(real_documents()[0])
    bits = 6
    t0 = time.perf_counter()
    docs = tokens = equal_bundled = 0
    longest = 0
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.count-") as work:
        files = {(n, p): open(Path(work) / f"{n}-{p}.u64", "wb") for n in orders for p in range(1 << bits)}
        pending_ids: list[np.ndarray] = []
        pending_off: list[np.ndarray] = []

        def flush() -> None:
            if not pending_ids:
                return
            ids = np.concatenate(pending_ids)
            offs = np.concatenate([pending_off[0]] + [o[1:] for o in pending_off[1:]])
            for n in orders:
                keys, start = _partition(_ngram_keys(ids, offs, n, encoder.vocab_size), bits)
                for p in range(1 << bits):
                    keys[start[p]:start[p + 1]].tofile(files[(n, p)])
            pending_ids.clear()
            pending_off.clear()

        held = 0
        for entry in manifest["shards"]:
            pf = pq.ParquetFile(folder / entry["file"])
            for batch in pf.iter_batches(batch_size=8192, columns=["text"]):
                texts = batch.column(0).to_pylist()
                if max_docs is not None:
                    texts = texts[:max(0, max_docs - docs)]
                if not texts:
                    break
                equal_bundled += sum(t in bundled for t in texts)
                ids, offs = encoder.encode(texts)
                docs += len(texts)
                tokens += ids.size
                longest = max(longest, int(np.diff(offs).max()))
                pending_ids.append(ids)
                pending_off.append(offs + held)
                held += ids.size
                if held >= 1 << 24:
                    flush()
                    held = 0
            if max_docs is not None and docs >= max_docs:
                break
            log(f"counted {docs:,} documents, {tokens:,} tokens ({time.perf_counter() - t0:.0f} s)")
        flush()
        for fh in files.values():
            fh.close()
        tokenize_s = time.perf_counter() - t0
        distinct = {}
        for n in orders:
            total = 0
            for p in range(1 << bits):
                path = Path(work) / f"{n}-{p}.u64"
                total += int(np.unique(np.fromfile(path, dtype=np.uint64)).size)
                path.unlink()
            distinct[n] = total
    return {"documents": docs, "tokens": tokens, "tokens_per_document": tokens / max(docs, 1),
            "longest_document": longest, "equal_to_bundled": equal_bundled,
            "distinct": distinct, "seconds": time.perf_counter() - t0, "tokenize_and_partition_s": tokenize_s}


def _print_count(c: dict) -> None:
    print(f"SmolLM2 tokens: {c['tokens']:,} in {c['documents']:,} documents "
          f"({c['tokens_per_document']:.1f} per document, longest {c['longest_document']:,})")
    print(f"documents equal to a bundled one: {c['equal_to_bundled']:,}")
    for n, d in c["distinct"].items():
        print(f"distinct {n}-grams: {d:,}")
    print(f"counting took {c['seconds']:.0f} s ({c['tokenize_and_partition_s']:.0f} s tokenizing and partitioning)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", type=Path, help="the folder to write (new, empty, or one this script wrote)")
    what.add_argument("--count-only", type=Path, metavar="DIR", help="only measure a corpus written before")
    ap.add_argument("--docs", type=int, default=4_000_000, help="documents (default 4,000,000)")
    ap.add_argument("--seed", type=int, default=0, help="the seed (default 0)")
    ap.add_argument("--shard-docs", type=int, default=250_000, help="documents per shard (default 250,000)")
    ap.add_argument("--overwrite", action="store_true", help="replace a corpus this script wrote before")
    ap.add_argument("--count", action="store_true", help="after writing, count SmolLM2 tokens and distinct n-grams")
    ap.add_argument("--count-docs", type=int, default=None, metavar="K", help="count only the first K documents")
    args = ap.parse_args(argv)
    try:
        if args.out is not None:
            t0 = time.perf_counter()
            m = write_corpus(args.out, args.docs, args.seed, args.shard_docs, overwrite=args.overwrite)
            seconds = time.perf_counter() - t0
            print(f"documents: {m['docs']:,} in {len(m['shards'])} shards of {m['shard_docs']:,} ({args.out})")
            print(f"text bytes: {m['text_bytes']:,} ({m['text_bytes'] / m['docs']:.0f} per document); Parquet "
                  f"bytes: {sum(s['file_bytes'] for s in m['shards']):,}")
            print(f"SmolLM2 tokens (sum of words' token counts, an estimate): {m['tokens_estimate']:,}")
            print(f"time: {seconds:.1f} s")
        if args.count_only is not None or args.count:
            _print_count(count_corpus(args.count_only or args.out, args.count_docs))
    except SynthError as e:
        print(f"synth_corpus: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
