"""Text-generation metrics: BLEU-n against many references (Texygen protocol), self-BLEU, distinct-n.

BLEU-n of one generated text uses every held-out text as a reference: clipped
n-gram counts against the maximum count over references, the closest reference
length for the brevity penalty (the shorter on ties), uniform weights over orders
1..n and sacrebleu's "floor" smoothing (Chen & Cherry method 1, 0.1). The
reference n-gram maxima are computed once, so scoring against thousands of
references costs one pass over them. ``tests/test_metrics.py`` checks the result
against ``sacrebleu.metrics.BLEU`` on small cases.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter

from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

_tokenize13a = Tokenizer13a()
FLOOR = 0.1


def words(text: str) -> list[str]:
    """sacrebleu's 13a tokenisation, lowercased."""
    return _tokenize13a(text.lower().strip()).split()


def ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


class References:
    """Max n-gram counts over a set of reference texts, for orders 1..``max_n``."""

    def __init__(self, texts: list[str], max_n: int = 5):
        if not texts:
            raise ValueError("BLEU needs at least one reference text")
        self.max_n = max_n
        self.max_counts: list[dict] = [dict() for _ in range(max_n)]
        lengths = set()
        for text in texts:
            toks = words(text)
            lengths.add(len(toks))
            for n in range(1, max_n + 1):
                table = self.max_counts[n - 1]
                for gram, c in ngrams(toks, n).items():
                    if c > table.get(gram, 0):
                        table[gram] = c
        self.lengths = sorted(lengths)

    def closest_length(self, hyp_len: int) -> int:
        i = bisect.bisect_left(self.lengths, hyp_len)
        candidates = self.lengths[max(i - 1, 0):i + 1]
        return min(candidates, key=lambda r: (abs(r - hyp_len), r))


def sentence_bleu(hypothesis: str, refs: References, n: int) -> float:
    """BLEU-n in [0, 1] of one text against all ``refs``."""
    if not 1 <= n <= refs.max_n:
        raise ValueError(f"n must be in 1..{refs.max_n}, got {n}")
    toks = words(hypothesis)
    if not toks:
        return 0.0
    log_p = 0.0
    for k in range(1, n + 1):
        grams = ngrams(toks, k)
        total = sum(grams.values())
        if total == 0:
            return 0.0
        table = refs.max_counts[k - 1]
        correct = sum(min(c, table.get(g, 0)) for g, c in grams.items())
        if k == 1 and correct == 0:
            return 0.0
        log_p += math.log((correct if correct else FLOOR) / total) / n
    ref_len = refs.closest_length(len(toks))
    bp = 1.0 if len(toks) >= ref_len else math.exp(1 - ref_len / len(toks))
    return bp * math.exp(log_p)


def corpus_bleu_scores(hypotheses: list[str], references: list[str], orders=(2, 3, 4, 5)) -> dict[int, float]:
    """Mean BLEU-n of each hypothesis against all references, for each n in ``orders`` (in [0, 1])."""
    refs = References(references, max(orders))
    return {n: sum(sentence_bleu(h, refs, n) for h in hypotheses) / len(hypotheses) for n in orders}


def mean_and_standard_error(values: list[float]) -> tuple[float, float]:
    """Mean of ``values`` and its standard error (sample standard deviation / √n); needs 2 values or more."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


def paired_bleu_difference(hyp_a: list[str], hyp_b: list[str], references: References | list[str],
                           n: int = 4) -> tuple[float, float]:
    """Mean and standard error of BLEU-n(a_i) − BLEU-n(b_i) over paired texts (the same prompt), in [−1, 1].

    Continuations of the same openings are paired, so the prompt-to-prompt spread
    cancels; a difference within about two standard errors is sampling noise.
    """
    if len(hyp_a) != len(hyp_b) or len(hyp_a) < 2:
        raise ValueError(f"need two equally long lists of at least 2 texts, got {len(hyp_a)} and {len(hyp_b)}")
    refs = references if isinstance(references, References) else References(references, n)
    diffs = [sentence_bleu(a, refs, n) - sentence_bleu(b, refs, n) for a, b in zip(hyp_a, hyp_b)]
    return mean_and_standard_error(diffs)


def self_bleu(texts: list[str], n: int = 4) -> float:
    """Mean BLEU-n of each text against the others (higher = less diverse)."""
    if len(texts) < 2:
        raise ValueError("self-BLEU needs at least two texts")
    return sum(sentence_bleu(t, References(texts[:i] + texts[i + 1:], n), n) for i, t in enumerate(texts)) / len(texts)


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-grams over all n-grams of ``texts`` (higher = more diverse); 0 when there are none."""
    grams = Counter()
    for t in texts:
        grams.update(ngrams(words(t), n))
    total = sum(grams.values())
    return len(grams) / total if total else 0.0
