"""BLEU against many references equals sacrebleu's; diversity metrics behave as documented."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sacrebleu.metrics import BLEU

from pipelines.metrics import (
    References,
    corpus_bleu_scores,
    distinct_n,
    paired_bleu_difference,
    self_bleu,
    sentence_bleu,
    words,
)

VOCAB = "the a movie film was good bad great not very I it this and of , .".split()
TEXT = st.lists(st.sampled_from(VOCAB), min_size=1, max_size=14).map(" ".join)


@given(TEXT, st.lists(TEXT, min_size=1, max_size=6), st.integers(2, 5))
def test_sentence_bleu_equals_sacrebleu(hyp, refs, n):
    ours = sentence_bleu(hyp, References(refs, 5), n)
    # sacrebleu takes the first closest reference length; sorting makes that the shorter on ties, as ours does
    refs_sorted = sorted(refs, key=lambda r: len(words(r)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bleu = BLEU(max_ngram_order=n, smooth_method="floor", smooth_value=0.1, lowercase=True, effective_order=False)
        theirs = bleu.sentence_score(hyp, refs_sorted).score / 100
    assert ours == pytest.approx(theirs, abs=1e-9)


def test_corpus_scores_average_the_sentences_and_identical_text_scores_one():
    refs = ["the movie was very good .", "a bad film , not good at all ."]
    scores = corpus_bleu_scores(["the movie was very good .", "a bad film"], refs, orders=(2, 4))
    r = References(refs, 4)
    assert scores[4] == pytest.approx((sentence_bleu("the movie was very good .", r, 4) +
                                       sentence_bleu("a bad film", r, 4)) / 2)
    assert sentence_bleu(refs[0], r, 4) == pytest.approx(1.0)


def test_diversity_metrics():
    same = ["the movie was good"] * 3
    varied = ["the movie was good", "a bad film indeed", "I loved this story"]
    assert distinct_n(same, 2) == pytest.approx(1 / 3) and distinct_n(varied, 2) == 1.0
    assert self_bleu(same, 4) == pytest.approx(1.0) and self_bleu(varied, 4) < 0.1
    with pytest.raises(ValueError, match="at least two"):
        self_bleu(["one"], 4)
    with pytest.raises(ValueError, match="at least one reference"):
        References([])


@given(st.lists(st.tuples(TEXT, TEXT), min_size=2, max_size=8))
def test_paired_bleu_difference_is_the_mean_of_per_prompt_differences(pairs):
    refs = ["the movie was very good .", "a bad film , not good at all ."]
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    mean, se = paired_bleu_difference(a, b, refs, 4)
    r = References(refs, 4)
    diffs = [sentence_bleu(x, r, 4) - sentence_bleu(y, r, 4) for x, y in pairs]
    assert mean == pytest.approx(sum(diffs) / len(diffs), abs=1e-12)
    assert se >= 0 and (se == pytest.approx(0, abs=1e-12)) == (max(diffs) - min(diffs) < 1e-12)
    swapped, se_swapped = paired_bleu_difference(b, a, refs, 4)
    assert swapped == pytest.approx(-mean, abs=1e-12) and se_swapped == pytest.approx(se, abs=1e-12)


def test_paired_bleu_difference_needs_paired_texts():
    with pytest.raises(ValueError, match="equally long"):
        paired_bleu_difference(["a", "b"], ["a"], ["a"])
