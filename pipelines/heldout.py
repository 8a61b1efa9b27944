"""Teacher-forced scoring of held-out documents: the LM's logits once, then any decoder's perplexity on them.

A decoder is a logits processor (or None for softmax): it sees exactly what it
would see inside ``generate()`` — the document's tokens so far and the LM's
scores — so perplexity measures the distribution it would decode with.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from gm_solver import HiddenStateTap

from .metrics import mean_and_standard_error

if TYPE_CHECKING:
    from gm_solver import ContextReference


@dataclass
class HeldOut:
    """Token ids of each document (first ``positions + 1`` tokens) and the LM's logits predicting ids[1:]."""

    ids: list[torch.Tensor]
    logits: list[torch.Tensor]
    hidden: list[torch.Tensor] | None = None  # the LM head's input at each scored position (``hidden=True``)

    @property
    def positions(self) -> int:
        return sum(len(x) for x in self.logits)

    def within(self, position: int) -> int:
        """How many scored tokens lie among the first ``position`` targets of their document: in ``steps()``
        order (position by position), those are the first entries of a ``token_nll`` vector."""
        return sum(min(len(x), position) for x in self.logits)

    def _rows(self):
        """(t, the documents with a t-th target) for t = 1, 2, …: the rows of every step, in one order."""
        longest = max(len(x) for x in self.logits)
        for t in range(1, longest + 1):
            yield t, [d for d in range(len(self.ids)) if len(self.logits[d]) >= t]

    def steps(self):
        """(input_ids (B, t), scores (B, V), targets (B,)) for t = 1, 2, …: every document with a t-th target."""
        for t, docs in self._rows():
            yield (torch.stack([self.ids[d][:t] for d in docs]), torch.stack([self.logits[d][t - 1] for d in docs]),
                   torch.stack([self.ids[d][t] for d in docs]))

    def hidden_steps(self):
        """The hidden states (B, d) of each ``steps()`` step, in its rows' order (needs ``hidden``)."""
        if self.hidden is None:
            raise ValueError("these held-out documents were scored without hidden states; score_documents(..., "
                             "hidden=True)")
        for t, docs in self._rows():
            yield torch.stack([self.hidden[d][t - 1] for d in docs])


def score_documents(model, tok, texts: list[str], positions: int = 32, batch_docs: int = 8,
                    progress: bool = True, hidden: bool = False, prefix: list[int] | None = None) -> HeldOut:
    """Run the LM once over the first ``positions + 1`` tokens of each text (texts shorter than 2 tokens skipped),
    on the model's device, where the ids, logits and states are then kept (every decoder scored on them runs there);
    ``hidden`` also keeps the LM head's input at each scored position (what a kNN datastore is searched with).
    ``prefix``: token ids the LM reads before each text (a prompt); the logits and states kept are the text's
    only, and ``ids`` hold the text's tokens alone (what a decoder of the text sees)."""
    device = getattr(model, "device", torch.device("cpu"))
    encoded = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"][:positions + 1], device=device)
               for t in texts]
    encoded = [e for e in encoded if len(e) >= 2]
    if not encoded:
        raise ValueError("no held-out document has two tokens or more; give longer texts")
    head = torch.tensor(list(prefix or ()), dtype=torch.long, device=device)
    p = len(head)
    ids, logits, states = [], [], []
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    with torch.no_grad(), HiddenStateTap(model if hidden else None) as tap:
        for i in tqdm(range(0, len(encoded), batch_docs), desc="LM on held-out", disable=not progress):
            chunk = encoded[i:i + batch_docs]
            width = p + max(len(e) for e in chunk)
            batch = torch.full((len(chunk), width), pad, dtype=torch.long, device=device)
            mask = torch.zeros_like(batch)
            for j, e in enumerate(chunk):  # right padding: positions of real tokens are unchanged
                batch[j, :p] = head
                batch[j, p:p + len(e)] = e
                mask[j, :p + len(e)] = 1
            # after a prompt, the head runs on the texts' positions only (its logits are most of the memory)
            out = model(input_ids=batch, attention_mask=mask, **({"logits_to_keep": width - p} if p else {}))
            out = out.logits.float()
            for j, e in enumerate(chunk):  # the kept positions (and the tap's states) start at the text's first
                ids.append(e)
                logits.append(out[j, :len(e) - 1].clone())
                if hidden:
                    states.append(tap.states[j, :len(e) - 1].float().clone())
    return HeldOut(ids, logits, states if hidden else None)


def token_nll(heldout: HeldOut, processor=None, desc: str | None = None, positions: int | None = None,
              until_infinite: bool = False) -> torch.Tensor:
    """Negative log-likelihood of each held-out token under ``processor`` (None: softmax), in ``steps()`` order.

    ``desc`` shows a progress bar over token positions under that label;
    ``positions`` stops after that many targets per document (the first
    ``heldout.within(positions)`` entries of the full vector). The order is the
    same for every decoder, so two results pair token by token. With
    ``until_infinite``, the steps after one with an infinite NLL are not decoded
    and count as infinite: the perplexity of every window that holds that step
    is infinite whatever they are (``decoded_positions`` says how many were).
    """
    nll = []
    steps = max(len(x) for x in heldout.logits)
    steps = steps if positions is None else min(steps, positions)
    # a decoder that reads the LM's hidden states (a kNN datastore's) gets each step's through its tap
    tap = getattr(processor, "tap", None)
    hidden = heldout.hidden_steps() if tap is not None else itertools.repeat(None)
    for (input_ids, scores, targets), states in tqdm(zip(itertools.islice(heldout.steps(), steps), hidden),
                                                     total=steps, desc=desc, disable=desc is None, leave=False):
        if nll and until_infinite and torch.isinf(nll[-1]).any():
            nll.append(torch.full((targets.shape[0],), math.inf, dtype=torch.float64, device=targets.device))
            continue
        if tap is not None:
            tap.states = states
        logp = torch.log_softmax(scores.double(), -1) if processor is None else processor(input_ids, scores).double()
        nll.append(-logp.gather(1, targets[:, None])[:, 0])
    return torch.cat(nll)


def decoded_positions(heldout: HeldOut, nll: torch.Tensor) -> int:
    """How many entries of ``token_nll(…, until_infinite=True)``'s ``nll`` were decoded: all up to the end of the
    step of its first infinite one."""
    infinite = torch.nonzero(torch.isinf(nll))
    if not infinite.numel():
        return nll.numel()
    first, step = int(infinite[0, 0]), 1
    while heldout.within(step) <= first:
        step += 1
    return heldout.within(step)


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


def target_probabilities(heldout: HeldOut, reference: ContextReference) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(z)[y] and q(y | context) of each held-out token y, in ``steps()`` order (float64).

    q is the reference an interpolation mixes in (``InterpolationLogitsProcessor``):
    with both, its NLL at any weight is one vector operation (``interpolation_nll``).
    """
    p_lm, p_ref = [], []
    for input_ids, scores, targets in heldout.steps():
        z = scores.double()
        p_lm.append(torch.softmax(z, -1).gather(1, targets[:, None])[:, 0])
        q = reference.restricted(input_ids, z)  # as the processor
        p_ref.append(q.gather(1, targets[:, None])[:, 0])
    return torch.cat(p_lm), torch.cat(p_ref)


def interpolation_nll(p_lm: torch.Tensor, p_ref: torch.Tensor, weight: float) -> torch.Tensor:
    """−log((1 − w)·p_lm + w·p_ref) per token: the interpolation's NLL from ``target_probabilities``."""
    return -torch.log((1.0 - weight) * p_lm + weight * p_ref)


def optimal_interpolation(p_lm: torch.Tensor, p_ref: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The weight w in (0, 1) with the lowest mean NLL of the interpolation on these tokens, and its NLL vector.

    The mean NLL is convex in w (−log of an affine function), so a bounded scalar
    search (Brent's method on the interval) finds its minimum; the search stops
    1e-5 inside the ends, so an optimum at an end (the LM alone, or q alone) is
    taken from the end itself.
    """
    from scipy.optimize import minimize_scalar

    if p_lm.shape != p_ref.shape or p_lm.numel() == 0:
        raise ValueError(f"need two equally long, non-empty probability vectors, got {tuple(p_lm.shape)} and "
                         f"{tuple(p_ref.shape)}")
    def mean_nll(w: float) -> float:
        return float(interpolation_nll(p_lm, p_ref, w).mean())

    found = minimize_scalar(mean_nll, bounds=(0.0, 1.0), method="bounded", options={"xatol": 1e-5})
    weight = min((float(found.x), 0.0, 1.0), key=mean_nll)
    return weight, interpolation_nll(p_lm, p_ref, weight)
