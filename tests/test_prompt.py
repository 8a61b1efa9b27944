"""The few-shot prompt of the eval's prompted baseline: whole training documents, seeded, within bounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipelines.prompt import SEPARATOR, few_shot_prompt


class Words:
    """A stand-in tokenizer: one id per word (its length), as SmolLM2's is called."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}


DOCS = st.lists(st.lists(st.sampled_from(["drug", "pain", "ok", "worked", "no", "sleep"]), max_size=12)
                .map(" ".join), min_size=1, max_size=30)


@given(DOCS, st.integers(1, 5), st.integers(1, 6), st.integers(0, 6), st.integers(0, 3))
def test_the_prompt_holds_distinct_documents_of_bounded_length_in_a_seeded_order(texts, shots, low, extra, seed):
    tok, high = Words(), low + extra
    fitting = {t.strip() for t in texts if low <= len(t.split()) <= high}
    if len(fitting) < shots:
        with pytest.raises(ValueError, match=f"only {len(fitting)} distinct training documents"):
            few_shot_prompt(texts, tok, shots, max_doc_tokens=high, min_doc_tokens=low, seed=seed)
        return
    prompt = few_shot_prompt(texts, tok, shots, max_doc_tokens=high, min_doc_tokens=low, seed=seed)
    assert len(prompt.documents) == len(set(prompt.documents)) == shots and set(prompt.documents) <= fitting
    assert prompt.ids == tok(SEPARATOR.join(prompt.documents) + SEPARATOR)["input_ids"]
    again = few_shot_prompt(texts, tok, shots, max_doc_tokens=high, min_doc_tokens=low, seed=seed)
    assert again == prompt  # the same seed, the same prompt


def test_seeds_draw_different_documents():
    texts = [f"review number {i} was fine" for i in range(50)]
    drawn = {tuple(few_shot_prompt(texts, Words(), 3, max_doc_tokens=10, min_doc_tokens=2, seed=s).documents)
             for s in range(5)}
    assert len(drawn) > 1


@pytest.mark.parametrize("shots", [0, -1, 1.5, True, "2"])
def test_shots_must_be_a_positive_int(shots):
    with pytest.raises(ValueError, match="shots must be an int >= 1"):
        few_shot_prompt(["a b c"], Words(), shots, max_doc_tokens=5)


@pytest.mark.parametrize("low, high", [(3, 2), (0, 2), (True, True), (1, 2.5), ("1", 4)])
def test_bounds_must_be_ordered_ints(low, high):
    with pytest.raises(ValueError, match="need ints 1 <= min_doc_tokens <= max_doc_tokens"):
        few_shot_prompt(["a b c"], Words(), 1, max_doc_tokens=high, min_doc_tokens=low)
