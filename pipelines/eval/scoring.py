"""Each decoder measured: held-out perplexity teacher-forced over each window (paired with softmax token by
token), the interpolation baseline from each token's two probabilities, and generated continuations scored with
BLEU against held-out references."""

from __future__ import annotations

import math
import time

import torch

from gm_solver import InterpolationLogitsProcessor

from ..decoding import generate_texts
from ..heldout import (
    HeldOut,
    decoded_positions,
    interpolation_nll,
    optimal_interpolation,
    paired_nll_difference,
    target_probabilities,
    token_nll,
)
from ..metrics import References, corpus_bleu_scores, distinct_n, paired_bleu_difference, self_bleu
from .roster import LM, OURS, SOFTMAX, Decoder, DecoderId, Method, interpolation, interpolation_optimum, strongest

INTERP_WEIGHTS = (0.1, 0.2, 0.3, 0.5)
# what generates continuations, in this order on each LM: softmax, the paper's decoder on Ã at each λ, the
# interpolation at its optimum (on the base LM), ours without and with the datastore
GENERATED = (Method.SOFTMAX, Method.PAPER, Method.INTERPOLATION_OPTIMUM, Method.OURS, Method.OURS_KNN,
             Method.REGISTERED)

NLL = dict[DecoderId, dict[int, torch.Tensor]]  # decoder → window → per-token NLL on the test tokens


def score_decoders(decoders: list[Decoder], scored: dict[LM, HeldOut],
                   windows: list[int]) -> tuple[NLL, dict[DecoderId, float]]:
    """Each decoder over its LM's test logits, once.

    Args:
        decoders: the roster.
        scored: each LM's logits on the test documents.
        windows: the first this many tokens reported; the windows are prefixes of one pass.

    Returns:
        Per decoder, window → per-token NLL (the windows within its ``positions``), and ms per position (over the
        positions decoded: none after a step with an infinite NLL).
    """
    nll: NLL = {}
    ms: dict[DecoderId, float] = {}
    for dec in decoders:
        held = scored[dec.lm]
        t0 = time.perf_counter()
        vec = token_nll(held, dec.processor, desc=dec.label, positions=dec.positions, until_infinite=True)
        ms[dec.id] = 1e3 * (time.perf_counter() - t0) / decoded_positions(held, vec)
        nll[dec.id] = {w: vec[:held.within(w)] for w in windows if dec.positions is None or w <= dec.positions}
        print(f"perplexity {dec.label:<50} " + "  ".join(f"{w}: {math.exp(float(v.mean())):8.2f}"
                                                         for w, v in nll[dec.id].items())
              + f"  ({ms[dec.id]:.1f} ms/position)", flush=True)
    return nll, ms


def interpolations(graph, scored: dict[LM, HeldOut], windows: list[int],
                   nll: NLL) -> tuple[list[Decoder], dict[LM, dict[int, float]]]:
    """The interpolation baseline from each token's two probabilities: the ``INTERP_WEIGHTS`` grid on the base LM,
    and on each LM the weight optimised on the test tokens of each window. Adds their NLL to ``nll``.

    Args:
        graph: the graph whose reference rows are mixed in.
        scored: each LM's logits on the test documents.
        windows: the first this many tokens reported.
        nll: ``score_decoders``' NLL, added to.

    Returns:
        The interpolation decoders, and per LM the optimal weights (window → w).
    """
    reference = InterpolationLogitsProcessor(graph, INTERP_WEIGHTS[0]).reference
    decoders, weights = [], {}
    for lm, held in scored.items():
        p_lm, p_ref = target_probabilities(held, reference)
        cut = {c: held.within(c) for c in windows}
        if lm is LM.BASE:
            for w in INTERP_WEIGHTS:
                decoders.append(interpolation(w))
                nll[decoders[-1].id] = {c: interpolation_nll(p_lm[:n], p_ref[:n], w) for c, n in cut.items()}
        fits = {c: optimal_interpolation(p_lm[:n], p_ref[:n]) for c, n in cut.items()}
        weights[lm] = {c: w for c, (w, _) in fits.items()}
        decoders.append(interpolation_optimum(lm, weights[lm]))
        nll[decoders[-1].id] = {c: v for c, (_, v) in fits.items()}
    return decoders, weights


def perplexity_rows(decoders: list[Decoder], nll: NLL, ms: dict[DecoderId, float],
                    windows: list[int]) -> dict[DecoderId, dict]:
    """perplexity.csv's rows.

    Args:
        decoders: every decoder scored, in the table's order.
        nll: per decoder, window → per-token NLL.
        ms: per decoder, ms per position (none for the interpolations).
        windows: the first this many tokens reported.

    Returns:
        Per decoder: key, label, family, LM and per window perplexity, its ratio to softmax and that log ratio ±
        SE, paired by token (None beyond the decoder's positions), then ms per position.
    """
    rows = {}
    softmax = nll[LM.BASE, SOFTMAX]
    for dec in decoders:
        row = {"key": dec.key, "decoder": dec.label, "family": dec.family, "lm": dec.lm}
        for w in windows:
            vec = nll[dec.id].get(w)
            if vec is None:
                row.update({f"perplexity_{w}": None, f"ratio_{w}": None, f"log_ratio_{w}": None, f"se_{w}": None})
                continue
            log_ratio, se = paired_nll_difference(vec, softmax[w])
            row.update({f"perplexity_{w}": math.exp(float(vec.mean())), f"ratio_{w}": math.exp(log_ratio),
                        f"log_ratio_{w}": log_ratio, f"se_{w}": se})
        row["ms_per_position"] = ms.get(dec.id)
        rows[dec.id] = row
    return rows


def generated(decoders: list[Decoder]) -> list[Decoder]:
    """The decoders whose continuations are generated: by LM, then in ``GENERATED``'s order (softmax first)."""
    return [d for lm in LM for method in GENERATED for d in decoders if d.lm is lm and d.variant.method is method
            and (method is not Method.INTERPOLATION_OPTIMUM or lm is LM.BASE)]


def lm_perplexity_of(model, tok, prompts: list[str], texts: list[str]) -> float:
    """Perplexity of the generated continuations under the plain LM (conditioned on their prompts)."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for prompt, text in zip(prompts, texts):
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            c = tok(text, add_special_tokens=False)["input_ids"]
            if not c:
                continue
            logits = model(input_ids=torch.tensor([p + c], device=model.device)).logits[0, len(p) - 1:-1].double()
            nll -= float(torch.log_softmax(logits, -1).gather(1, torch.tensor(c, device=model.device)[:, None]).sum())
            count += len(c)
    return math.exp(nll / max(count, 1))


def generation_rows(decoders: list[Decoder], lms: dict[LM, tuple[object, list[int] | None]], model, tok,
                    openings: list[str], references: list[str], new_tokens: int,
                    seed: int) -> tuple[dict[DecoderId, dict], dict[DecoderId, list[str]]]:
    """Continuations of ``openings`` by each decoder (sampled, fixed seed), with BLEU against the held-out
    ``references``, diversity, and perplexity under the base LM (without the prompt).

    Args:
        decoders: what generates, softmax first.
        lms: per LM, the model that runs and the prompt ids it reads before each opening (None: none).
        model, tok: the base LM, which scores the continuations, and the tokenizer.
        openings: the test documents' openings continued.
        references: held-out texts BLEU is measured against.
        new_tokens: tokens generated per opening.
        seed: the sampling's seed.

    Returns:
        generation.csv's rows and the continuations, per decoder.
    """
    rows, samples = {}, {}
    for dec in decoders:
        lm, prefix = lms[dec.lm]
        texts, ms_token = generate_texts(lm, tok, openings, dec.processor, max_new_tokens=new_tokens,
                                         do_sample=True, seed=seed, prefix=prefix)
        samples[dec.id] = texts
        bleu = corpus_bleu_scores(texts, references)
        rows[dec.id] = {"key": dec.key, "decoder": dec.label, **{f"BLEU-{n}": 100 * b for n, b in bleu.items()},
                        "self-BLEU-4": 100 * self_bleu(texts, 4), "distinct-1": distinct_n(texts, 1),
                        "distinct-2": distinct_n(texts, 2),
                        "LM perplexity": lm_perplexity_of(model, tok, openings, texts), "ms_per_token": ms_token}
        print(f"generate {dec.label:<50} BLEU-4 {rows[dec.id]['BLEU-4']:.2f}  ({ms_token:.0f} ms/token)", flush=True)
    return rows, samples


def bleu_comparisons(samples: dict[DecoderId, list[str]], references: References,
                     rows: dict[DecoderId, dict]) -> dict[tuple[DecoderId, DecoderId], tuple[float, float]]:
    """The paired BLEU-4 differences the report states, over the openings: each decoder against softmax (also
    written into its generation row, as "BLEU-4 − softmax" ± SE), graphmax on the prompted LM against the prompt
    alone, and ours and graphmax on the fine-tuned LM against that LM alone.

    Args:
        samples: per generated decoder, its continuations (softmax first).
        references: the held-out references.
        rows: generation.csv's rows, given their two columns.

    Returns:
        (a, b) → (mean, SE) of a's BLEU-4 minus b's.
    """
    softmax = (LM.BASE, SOFTMAX)
    pairs = [(a, softmax) for a in list(samples)[1:]]
    if (LM.PROMPTED, SOFTMAX) in samples:
        pairs.append((strongest(LM.PROMPTED, samples), (LM.PROMPTED, SOFTMAX)))
    if (LM.FINE_TUNED, SOFTMAX) in samples:
        pairs += [((LM.BASE, OURS), (LM.FINE_TUNED, SOFTMAX)), ((LM.FINE_TUNED, OURS), (LM.FINE_TUNED, SOFTMAX))]
    bleu4 = {(a, b): paired_bleu_difference(samples[a], samples[b], references, 4) for a, b in pairs}
    for dec, row in rows.items():
        mean, se = bleu4.get((dec, softmax), (0.0, 0.0))
        row["BLEU-4 − softmax"], row["± SE"] = 100 * mean, 100 * se
    return bleu4
