"""A few-shot prompt from the training side: the zero-training alternative to graphmax that a user tries first.

Whole training documents, drawn in a seeded order, joined by blank lines and
ended by one, so that the held-out document reads as the next of them. Only
documents short enough are taken: the prompt stays a few hundred tokens, which
the LM reads once per document (its cost at each later step is the attention
over them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gm_graphs.errors import OptionError

SEPARATOR = "\n\n"


@dataclass(frozen=True)
class FewShotPrompt:
    """The prompt's token ids and the training documents it holds."""

    ids: list[int]
    documents: list[str]


def few_shot_prompt(texts: list[str], tok, shots: int, *, max_doc_tokens: int, seed: int = 0,
                    min_doc_tokens: int = 8) -> FewShotPrompt:
    """``shots`` documents of ``texts`` with ``min_doc_tokens`` to ``max_doc_tokens`` tokens, in a seeded random
    order, as one prompt (each followed by a blank line).

    Raises:
        ValueError: ``shots`` < 1 or the bounds out of order.
        OptionError: fewer than ``shots`` documents of that length (the message says how many and the fix).

    Example::

        >>> class Words:                         # a stand-in tokenizer: one id per word
        ...     def __call__(self, text, add_special_tokens=False):
        ...         return {"input_ids": [len(w) for w in text.split()]}
        >>> prompt = few_shot_prompt(["Great film.", "Awful plot, fine cast.", "No."], Words(), 2,
        ...                          max_doc_tokens=5, min_doc_tokens=2)
        >>> sorted(prompt.documents), len(prompt.ids)                  # "No." is too short
        (['Awful plot, fine cast.', 'Great film.'], 6)
    """
    if isinstance(shots, bool) or not isinstance(shots, int) or shots < 1:
        raise ValueError(f"shots must be an int >= 1, got {shots!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (min_doc_tokens, max_doc_tokens)) \
            or not 1 <= min_doc_tokens <= max_doc_tokens:
        raise ValueError(f"need ints 1 <= min_doc_tokens <= max_doc_tokens, got {min_doc_tokens!r} and "
                         f"{max_doc_tokens!r}")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    chosen: list[str] = []
    for i in order:  # tokenized lazily: a large training side is not read through
        text = texts[i].strip()
        n = len(tok(text, add_special_tokens=False)["input_ids"]) if text else 0
        if min_doc_tokens <= n <= max_doc_tokens and text not in chosen:
            chosen.append(text)
            if len(chosen) == shots:
                break
    if len(chosen) < shots:
        raise OptionError(f"only {len(chosen)} distinct training documents have {min_doc_tokens}–{max_doc_tokens} "
                         f"tokens, {shots} asked for; lower --shots (0: no prompted rows)")
    ids = tok(SEPARATOR.join(chosen) + SEPARATOR, add_special_tokens=False)["input_ids"]
    return FewShotPrompt(list(ids), chosen)
