"""Teacher-forced scoring of held-out documents: the LM's logits once, then any decoder's perplexity on them.

A decoder is a logits processor (or None for softmax): it sees exactly what it
would see inside ``generate()`` — the document's tokens so far and the LM's
scores — so perplexity measures the distribution it would decode with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .metrics import mean_and_standard_error


@dataclass
class HeldOut:
    """Token ids of each document (first ``positions + 1`` tokens) and the LM's logits predicting ids[1:]."""

    ids: list[torch.Tensor]
    logits: list[torch.Tensor]

    @property
    def positions(self) -> int:
        return sum(len(x) for x in self.logits)

    def steps(self):
        """(input_ids (B, t), scores (B, V), targets (B,)) for t = 1, 2, …: every document with a t-th target."""
        longest = max(len(x) for x in self.logits)
        for t in range(1, longest + 1):
            docs = [d for d in range(len(self.ids)) if len(self.logits[d]) >= t]
            yield (torch.stack([self.ids[d][:t] for d in docs]), torch.stack([self.logits[d][t - 1] for d in docs]),
                   torch.stack([self.ids[d][t] for d in docs]))


def score_documents(model, tok, texts: list[str], positions: int = 32, batch_docs: int = 8,
                    progress: bool = True) -> HeldOut:
    """Run the LM once over the first ``positions + 1`` tokens of each text (texts shorter than 2 tokens skipped)."""
    encoded = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"][:positions + 1]) for t in texts]
    encoded = [e for e in encoded if len(e) >= 2]
    if not encoded:
        raise ValueError("no held-out document has two tokens or more; give longer texts")
    ids, logits = [], []
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    with torch.no_grad():
        for i in tqdm(range(0, len(encoded), batch_docs), desc="LM on held-out", disable=not progress):
            chunk = encoded[i:i + batch_docs]
            width = max(len(e) for e in chunk)
            batch = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(batch)
            for j, e in enumerate(chunk):  # right padding: positions of real tokens are unchanged
                batch[j, :len(e)] = e
                mask[j, :len(e)] = 1
            out = model(input_ids=batch, attention_mask=mask).logits.float()
            for j, e in enumerate(chunk):
                ids.append(e)
                logits.append(out[j, :len(e) - 1].clone())
    return HeldOut(ids, logits)


def token_nll(heldout: HeldOut, processor=None, desc: str | None = None) -> torch.Tensor:
    """Negative log-likelihood of each held-out token under ``processor`` (None: softmax), in ``steps()`` order.

    ``desc`` shows a progress bar over token positions under that label. The
    order is the same for every decoder, so two results pair token by token.
    """
    nll = []
    steps = max(len(x) for x in heldout.logits)
    for input_ids, scores, targets in tqdm(heldout.steps(), total=steps, desc=desc, disable=desc is None,
                                           leave=False):
        logp = torch.log_softmax(scores.double(), -1) if processor is None else processor(input_ids, scores).double()
        nll.append(-logp.gather(1, targets[:, None])[:, 0])
    return torch.cat(nll)


def perplexity(heldout: HeldOut, processor=None, desc: str | None = None) -> float:
    """exp of the mean negative log-likelihood of the held-out tokens under ``processor`` (None: softmax)."""
    return math.exp(float(token_nll(heldout, processor, desc).mean()))


def paired_nll_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error of the per-token NLL difference a − b (negative: a predicts the text better).

    The mean is log(ppl_a / ppl_b); the standard error says whether that ratio is
    more than token-to-token noise. An infinite NLL makes both infinite.
    """
    if a.shape != b.shape or a.numel() < 2:
        raise ValueError(f"need two paired NLL vectors of at least 2 tokens, got {tuple(a.shape)} and {tuple(b.shape)}")
    d = a - b
    if not torch.isfinite(d).all():
        return float("inf"), float("inf")
    return mean_and_standard_error(d.tolist())
