"""A graph as loaded (gm_graphs.graph): load_graph refuses a missing graph or operator, a tokenizer of another
vocabulary or one that splits text differently, and a model whose head is narrower than the graph."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gm_graphs import build_graph, load_graph, merge_graphs
from gm_graphs.errors import GraphFormatError, MergeError, TokenizerError
from gm_graphs.format.graph_files import write_manifest
from gm_graphs.tokenize.encoder import SPLIT_PROBE, TokenizerIdentity


def word_pieces(pre_tokenizer: str):
    """A word-level tokenizer over the words and digits of :data:`SPLIT_PROBE`, with the pre-tokenizer named: the
    same vocabulary, split two ways ("1999" one token or four)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(SPLIT_PROBE.split()) | set("0123456789") | {"the", "cat", "sat"})
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, "[UNK]"))
    raw.pre_tokenizer = (pre_tokenizers.WhitespaceSplit() if pre_tokenizer == "words" else
                         pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(True)]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat in 1999\nthe cat sat\n")
    return path


def test_graph_and_tokenizer_vocabulary_mismatch(tmp_path, csv_corpus, bpe_tokenizer, smollm2_tokenizer):
    path, _ = csv_corpus
    g = build_graph(path, bpe_tokenizer, path=tmp_path / "g", progress=False)
    load_graph(g.path, tokenizer=bpe_tokenizer)
    with pytest.raises(TokenizerError, match="rebuild the graph with this tokenizer"):
        load_graph(g.path, tokenizer=smollm2_tokenizer)


def test_missing_graph_and_missing_operator(home, tmp_path, csv_corpus, bpe_tokenizer):
    with pytest.raises(GraphFormatError, match="graphmax build"):
        load_graph("nothing")
    path, _ = csv_corpus
    g = build_graph(path, bpe_tokenizer, path=tmp_path / "g", progress=False)
    g2 = load_graph(g.path, order=2)  # not materialised: the matrix-free form remains
    assert g2.base.shape == g.matrix.shape
    with pytest.raises(GraphFormatError, match="no materialised order2"):
        g2.matrix


def test_a_tokenizer_with_the_same_vocabulary_that_splits_text_differently_is_refused(tmp_path, corpus):
    words, digits = word_pieces("words"), word_pieces("digits")
    assert words.get_vocab() == digits.get_vocab() and words("1999")["input_ids"] != digits("1999")["input_ids"]
    g = build_graph(corpus, words, path=tmp_path / "g", progress=False)
    recorded = g.manifest["tokenizer"]
    assert recorded == TokenizerIdentity.of(words).to_dict() and len(recorded["split_sha256"]) == 64
    load_graph(g.path, tokenizer=words)
    with pytest.raises(TokenizerError) as e:
        load_graph(g.path, tokenizer=digits)
    message = str(e.value)
    assert "\n" not in message and "splits text differently" in message and "rebuild the graph" in message


def test_a_graph_written_before_the_split_was_recorded_loads_and_is_checked_by_its_vocabulary(tmp_path, corpus,
                                                                                             smollm2_tokenizer):
    words, digits = word_pieces("words"), word_pieces("digits")
    g = build_graph(corpus, words, path=tmp_path / "g", progress=False)
    manifest = dict(g.manifest)
    manifest["tokenizer"] = {k: v for k, v in manifest["tokenizer"].items() if k != "split_sha256"}
    write_manifest(g.path, manifest)
    load_graph(g.path, tokenizer=digits)  # the vocabulary is all it can tell
    with pytest.raises(TokenizerError, match="rebuild the graph with this tokenizer"):
        load_graph(g.path, tokenizer=smollm2_tokenizer)


@pytest.mark.parametrize("split", ["AB" * 32, "ab" * 31, 7, None])
def test_a_malformed_split_record_is_refused_in_one_line(tmp_path, corpus, split):
    g = build_graph(corpus, word_pieces("words"), path=tmp_path / "g", progress=False)
    manifest = json.loads((g.path / "manifest.json").read_text())
    manifest["tokenizer"]["split_sha256"] = split
    write_manifest(g.path, manifest)
    with pytest.raises(GraphFormatError, match=r"manifest field tokenizer\.split_sha256 should be 64 lowercase hex"):
        load_graph(g.path)


def test_merging_parts_split_differently_is_refused_and_a_part_without_a_split_leaves_none(tmp_path):
    words, digits = word_pieces("words"), word_pieces("digits")
    for name, text in (("a.txt", "the cat sat in 1999\n"), ("b.txt", "the cat sat\n")):
        (tmp_path / name).write_text(text)
    a = build_graph(tmp_path / "a.txt", words, path=tmp_path / "a", progress=False)
    b = build_graph(tmp_path / "b.txt", digits, path=tmp_path / "b", progress=False)
    with pytest.raises(MergeError, match="split text differently"):
        merge_graphs([a, b], path=tmp_path / "ab", progress=False)
    same = build_graph(tmp_path / "b.txt", words, path=tmp_path / "same", progress=False)
    assert merge_graphs([a, same], path=tmp_path / "kept", progress=False).manifest["tokenizer"] == \
        a.manifest["tokenizer"]
    manifest = dict(b.manifest)
    manifest["tokenizer"] = {k: v for k, v in manifest["tokenizer"].items() if k != "split_sha256"}
    write_manifest(b.path, manifest)
    merged = merge_graphs([a, load_graph(b.path)], path=tmp_path / "old", progress=False)
    assert "split_sha256" not in merged.manifest["tokenizer"]
    assert int(merged.counts.sum()) == int(a.counts.sum()) + int(b.counts.sum()) == 4 + 2


@pytest.mark.parametrize("width", [6, 7, 1000, np.int64(6)])
def test_a_head_as_wide_as_the_vocabulary_or_wider_is_accepted(tmp_path, corpus, width):
    g = build_graph(corpus, word_pieces("words"), path=tmp_path / "g", progress=False)
    g.check_output_width(int(g.vocab_size) + width - 6)


@pytest.mark.parametrize("short", [1, 2, 100])
def test_a_head_narrower_than_the_vocabulary_is_refused_in_one_line_naming_both_sizes(tmp_path, corpus, short):
    g = build_graph(corpus, word_pieces("words"), path=tmp_path / "g", progress=False)
    width = max(1, g.vocab_size - short)
    with pytest.raises(TokenizerError) as e:
        g.check_output_width(width)
    message = str(e.value)
    assert "\n" not in message and f"has {g.vocab_size} tokens but the model scores {width}" in message
    assert "rebuild the graph with this model's tokenizer" in message


@pytest.mark.parametrize("width", [0, -3, True, 2.0, "9", None])
def test_an_output_width_that_is_no_positive_int_is_refused(tmp_path, corpus, width):
    g = build_graph(corpus, word_pieces("words"), path=tmp_path / "g", progress=False)
    with pytest.raises(ValueError, match="width must be the model's output width, an int >= 1"):
        g.check_output_width(width)
