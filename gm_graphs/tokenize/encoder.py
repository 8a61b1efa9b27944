"""Loading the LM's own tokenizer and encoding batches of documents with it."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gm_graphs.corpus import bundled
from gm_graphs.corpus.words import encode_in_pieces
from gm_graphs.errors import TokenizerError
from gm_graphs.tokenize.bytelevel import WordCache, cacheable
from gm_graphs.tokenize.gguf import load_gguf_tokenizer

# A name that resolves to the tokenizer inside the bundled SmolLM2 GGUF file.
BUNDLED_ALIASES = {"smollm2": bundled.smollm2_gguf}


def word_tokenizer(words: list[str]):
    """A whitespace tokenizer with one token per word of ``words`` (id 0 is ``[UNK]``), for examples and tests.

    Real graphs use the language model's own tokenizer (:func:`load_tokenizer`); this one makes a graph small
    enough to read in a docstring.

    Args:
        words (``list[str]``): the vocabulary after ``[UNK]``; any other word becomes ``[UNK]``.

    Returns:
        ``transformers.PreTrainedTokenizerFast`` with ``len(words) + 1`` tokens.

    Example::

        >>> tok = word_tokenizer("the cat sat".split())
        >>> tok("the cat sat on")["input_ids"]
        [1, 2, 3, 0]
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast  # transformers is heavy: only when a tokenizer is made

    vocab = {"[UNK]": 0, **{w: i for i, w in enumerate(words, start=1)}}
    model = Tokenizer(models.WordLevel(vocab, "[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]")


def load_tokenizer(spec: Any):
    """A transformers tokenizer from a loaded tokenizer, a name, a folder, a ``tokenizer.json`` or a GGUF file.

    ``"smollm2"`` names the tokenizer of the bundled SmolLM2-135M GGUF file. A GGUF file's tokenizer is converted
    once and then loaded from graphmax's cache (:mod:`gm_graphs.tokenize.gguf`).
    Nothing is downloaded: names must already be in the local Hugging Face cache.

    Args:
        spec: a loaded tokenizer (returned as it is), ``"smollm2"``, a Hugging Face name already cached, a
            tokenizer folder, a ``tokenizer.json`` or a ``.gguf`` file.

    Returns:
        ``transformers.PreTrainedTokenizerBase``: the tokenizer.

    Raises:
        TokenizerError: it cannot be loaded (the message says what to pass instead).

    Example::

        >>> import tempfile; from pathlib import Path
        >>> from tokenizers import Tokenizer, models
        >>> vocab = {w: i for i, w in enumerate("[UNK] the cat sat".split())}
        >>> tmp = tempfile.TemporaryDirectory(); path = Path(tmp.name) / "tokenizer.json"
        >>> Tokenizer(models.WordLevel(vocab, "[UNK]")).save(str(path))
        >>> tok = load_tokenizer(path)
        >>> tok.convert_tokens_to_ids("cat"), load_tokenizer(tok) is tok
        (2, True)
    """
    if hasattr(spec, "get_vocab") and hasattr(spec, "convert_tokens_to_ids"):
        return spec
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = os.fspath(spec)
    if text in BUNDLED_ALIASES:
        text = str(BUNDLED_ALIASES[text]())
    path = Path(text)
    try:
        if path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"no GGUF file at {text}")
            tok = load_gguf_tokenizer(path)
        elif path.suffix == ".json":
            if not path.is_file():
                raise FileNotFoundError(f"no tokenizer file at {text}")
            tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
            tok.name_or_path = str(path)
        else:
            tok = AutoTokenizer.from_pretrained(text, local_files_only=True)
    except Exception as e:  # transformers raises many kinds here; all mean "cannot load"
        raise TokenizerError(
            f"cannot load the tokenizer {text!r} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"pass a local folder, a tokenizer.json, a .gguf file or 'smollm2' "
            f"(no network: hub names must already be cached)"
        ) from e
    return tok


# Text whose ids tell apart tokenizers that share a vocabulary but split text differently: runs of digits (GPT-2's
# expression keeps "1999" whole, Llama 3's cuts it 199|9, Qwen2's 1|9|9|9), runs of spaces, tabs and newlines,
# contractions and punctuation, letters a normaliser changes (NFC, NFKC, case), scripts beyond Latin, and characters
# a byte-fallback vocabulary spells in bytes.
SPLIT_PROBE = (
    "In 1999, 12,345 people paid $3.50 (or €4) — 2024-01-15T09:30, 100% of 1234567.\n"
    "It's   three  spaces;\ttabs\tand\r\nnewlines\n\n\nhere. I'll say they've gone, we'd've \"quoted\" 'single'\n"
    "UPPER lower Title café cafe\u0301 naïve ﬁne ＡＢ ½ ² Ⅻ Привет 中文字 日本語 한국어 العربية हिन्दी\n"
    "👍🏽🎉 👨\u200d👩\u200d👧 ☃ 𝔘𝔫 \u00a0nbsp\u200bzero \x07bell  end   "
)


@dataclass(frozen=True)
class TokenizerIdentity:
    """What a graph records of its tokenizer: its vocabulary, and how it splits text into that vocabulary's ids.

    Two tokenizers with one vocabulary may still split text differently (another pre-tokenizer or normaliser:
    transformers builds a ``Qwen2Tokenizer`` from a folder whose ``config.json`` says ``qwen2``, and that class
    cuts "1999" into four digits where the folder's ``tokenizer.json`` alone keeps three together); the ids of
    :data:`SPLIT_PROBE` tell them apart.

    Args:
        name (``str``): the tokenizer's name or path, for messages.
        vocab_size (``int``): the number of ids, the graph's N.
        vocab_sha256 (``str``): SHA-256 of the vocabulary (token → id).
        split_sha256 (``str`` or ``None``, defaults to ``None``): SHA-256 of the ids the tokenizer gives
            :data:`SPLIT_PROBE` (no special tokens added); ``None`` in graphs built before it was recorded, and for
            a tokenizer that cannot encode the probe (a word-level vocabulary without an unknown token).

    Example::

        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from transformers import PreTrainedTokenizerFast
        >>> vocab = {w: i for i, w in enumerate("[UNK] the cat sat".split())}
        >>> words, pieces = (Tokenizer(models.WordLevel(vocab, "[UNK]")) for _ in range(2))
        >>> words.pre_tokenizer, pieces.pre_tokenizer = pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)
        >>> a, b = (TokenizerIdentity.of(PreTrainedTokenizerFast(tokenizer_object=t)) for t in (words, pieces))
        >>> a.vocab_size, len(a.vocab_sha256), a.vocab_sha256 == b.vocab_sha256, a.split_sha256 == b.split_sha256
        (4, 64, True, False)
    """

    name: str
    vocab_size: int
    vocab_sha256: str
    split_sha256: str | None = None

    @classmethod
    def of(cls, tok) -> TokenizerIdentity:
        """The identity of ``tok`` (a loaded tokenizer)."""
        vocab = sorted(tok.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
        digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
        size = max(len(tok), (vocab[-1][1] + 1) if vocab else 0)
        return cls(name=str(getattr(tok, "name_or_path", "") or type(tok).__name__),
                   vocab_size=int(size), vocab_sha256=digest, split_sha256=_split_digest(tok))

    def to_dict(self) -> dict:
        """The identity as a manifest records it (``split_sha256`` only when known)."""
        return {"name": self.name, "vocab_size": self.vocab_size, "vocab_sha256": self.vocab_sha256,
                **({"split_sha256": self.split_sha256} if self.split_sha256 is not None else {})}


def _split_digest(tok) -> str | None:
    """SHA-256 of the ids ``tok`` gives :data:`SPLIT_PROBE`, encoded as a build encodes documents."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and (backend.truncation is not None or backend.padding is not None):
        backend = _whole_documents(tok)  # a copy costs a third of a second on a 49k vocabulary: only when needed
    try:
        ids = (backend.encode(SPLIT_PROBE, add_special_tokens=False).ids if backend is not None
               else list(tok(SPLIT_PROBE, add_special_tokens=False)["input_ids"]))
    except Exception:  # tokenizers and transformers raise many kinds here; the vocabulary still identifies it
        return None
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()


class BatchEncoder:
    """Encodes lists of documents to one flat id array plus document offsets.

    Byte-level BPE tokenizers (SmolLM2's) encode through a word cache (:class:`~gm_graphs.tokenize.bytelevel.WordCache`,
    the same ids for a fraction of the CPU); other fast tokenizers encode a batch in Rust on all cores
    (``encode_batch_fast``); the rest fall back to the tokenizer's ``__call__``.

    Args:
        tok: a loaded tokenizer.
        add_bos_eos (``bool``, defaults to ``False``): put BOS before and EOS after every document.
        word_cache (``bool``, defaults to ``True``): use the word cache where it applies; ``False`` encodes every
            batch with the Rust tokenizer (the same ids, e.g. to time the tokenizer alone).
    """

    def __init__(self, tok, *, add_bos_eos: bool = False, word_cache: bool = True):
        self.tok = tok
        self.vocab_size = TokenizerIdentity.of(tok).vocab_size
        self.dtype = np.int32 if self.vocab_size < 2**31 else np.int64
        self._backend = _whole_documents(tok)
        self._words = WordCache(self._backend, self.dtype) if (
            word_cache and self._backend is not None and cacheable(self._backend)) else None
        self.bos = self.eos = None
        if add_bos_eos:
            self.bos, self.eos = tok.bos_token_id, tok.eos_token_id
            if self.bos is None or self.eos is None:
                raise TokenizerError(
                    f"the tokenizer {getattr(tok, 'name_or_path', '')!r} has no BOS/EOS token "
                    f"(bos={self.bos}, eos={self.eos}); build without --bos-eos"
                )

    def encode(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(ids, offsets)``: document i is ``ids[offsets[i]:offsets[i+1]]``. A run of characters longer
        than ``MAX_WORD_CHARS``, and a document longer than ``MAX_PIECE_CHARS``, are encoded in pieces
        (:mod:`gm_graphs.corpus.words`: BPE holds ~100 bytes a byte of a word, the tokenizer 150-300 a token)."""
        pieced = encode_in_pieces(self.encode, docs, framed=self.bos is not None)
        if pieced is not None:
            return pieced
        if self._words is not None:
            ids, offsets = self._words.encode(docs)
            return (ids, offsets) if self.bos is None else _framed(ids, offsets, self.bos, self.eos)
        if self._backend is not None:
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            lists = [e.ids for e in encode(docs, add_special_tokens=False)]
        else:
            lists = self.tok(docs, add_special_tokens=False)["input_ids"]
        if self.bos is not None:
            lists = [[self.bos, *ids, self.eos] for ids in lists]
        lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=self.dtype, count=int(offsets[-1]))
        return ids, offsets


def _whole_documents(tok):
    """A copy of ``tok``'s Rust tokenizer that neither truncates nor pads (``None`` for a slow tokenizer).

    transformers sets the shared Rust tokenizer's truncation and padding at each call and leaves them set, so a
    tokenizer called with ``truncation=True`` before would cut every document a build encodes, and padding would
    count pad ids; the copy is ours alone.
    """
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.encode_special_tokens = backend.encode_special_tokens  # a flag the JSON does not carry
    copy.no_truncation()
    copy.no_padding()
    return copy


def _framed(ids: np.ndarray, offsets: np.ndarray, bos: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """Each document of ``(ids, offsets)`` between ``bos`` and ``eos``."""
    framed = offsets + 2 * np.arange(len(offsets), dtype=np.int64)
    out = np.empty(len(ids) + 2 * (len(offsets) - 1), ids.dtype)
    inside = np.ones(len(out), bool)
    inside[framed[:-1]] = inside[framed[1:] - 1] = False
    out[inside] = ids
    out[framed[:-1]], out[framed[1:] - 1] = bos, eos
    return out, framed
