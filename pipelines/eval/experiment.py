"""The eval's run, from the split to the report: context graphmax tuned and the baselines fitted, every decoder
of the roster scored, continuations generated, the solvers and top tokens probed, and ``Results`` written out."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from gm_solver import ContextConfig, KnnContextGraphmaxLogitsProcessor

from ..decoding import decode_cost
from ..heldout import HeldOut, score_documents
from ..metrics import References
from ..models import check_fits
from ..tune import tune_config
from .baselines import FineTuned, Knn, Prompted, datastore_decoder, draw_prompt, fine_tuned_baseline, prompted_baseline
from .data import Setup, prepare
from .probes import draw, solver_traces, top_token_panels, top_tokens
from .report import Results, write_ab_sheet, write_report, write_tables
from .roster import LM, OURS, SOFTMAX, Decoder, Method, interpolation_at, prompted_decoders, roster
from .scoring import bleu_comparisons, generated, generation_rows, interpolations, perplexity_rows, score_decoders
from .sizes import PAPER_GRIDS

SHORT_WINDOW = 32  # reported beside --positions: the window of earlier rounds
OPENING_WORDS = 8  # a test document's first words are the opening continued
COST_OPENINGS = 4  # the greedy batch-1 cost is measured on this many openings


def paper_grids(args) -> tuple[list[float], list[float]]:
    """The λ grids of the paper's decoders: ``--lams`` and ``--mixture-lams`` as given, else the default's (or
    ``--full``'s) from ``PAPER_GRIDS``."""
    grids = PAPER_GRIDS["full" if args.full else "default"]
    return args.lams or grids["lams"], args.mixture_lams or grids["mixture_lams"]


@dataclasses.dataclass
class Fitted:
    """What is fitted on the training and validation sides before anything is reported.

    Args:
        tuned: context graphmax's choice on the base LM.
        tuning: every candidate tried, for tuning.csv.
        knn, finetuned, prompted: the baselines, None for those not run.
        scored: each LM's logits on the test documents.
    """

    tuned: ContextConfig
    tuning: list[dict]
    knn: Knn | None
    finetuned: FineTuned | None
    prompted: Prompted | None
    scored: dict[LM, HeldOut]


def fit(args, sizes: dict, model, tok, setup: Setup, prompt, work: Path) -> Fitted:
    """Context graphmax tuned on the validation half (never on the test half), then the baselines, and each LM's
    test logits."""
    positions = sizes["positions"]
    t0 = time.perf_counter()
    valid_docs, test_docs = setup.validation[:sizes["tune_docs"]], setup.test[:sizes["ppl_docs"]]
    hidden = args.datastore_docs > 0  # the kNN decoder reads the LM's hidden states
    valid = score_documents(model, tok, valid_docs, positions, hidden=hidden)
    tuned, tuning = tune_config(setup.graph, valid)
    knn = datastore_decoder(model, tok, setup, tuned, valid, args.datastore_docs, positions,
                            work / "datastore") if hidden else None
    tune_seconds = time.perf_counter() - t0  # with the datastore's build and tuning: all graphmax's own compute
    # the baseline a user would pick: fine-tune the LM on the same training text, for as long as graphmax took
    finetuned = fine_tuned_baseline(args, model, tok, setup, tuned, valid_docs, test_docs, positions, tune_seconds,
                                    knn, work)
    # the baseline that needs no training at all: training documents in the prompt
    prompted = prompted_baseline(model, tok, setup, prompt, tuned, valid_docs, test_docs, positions, knn)
    scored = {LM.BASE: score_documents(model, tok, test_docs, positions, hidden=hidden)}
    if knn is not None:
        tuning += knn.table
    if finetuned is not None:
        scored[LM.FINE_TUNED] = finetuned.test
        tuning += finetuned.retune_table
    if prompted is not None:
        scored[LM.PROMPTED] = prompted.test
        tuning += prompted.retune_table
    return Fitted(tuned, tuning, knn, finetuned, prompted, scored)


def generators(setup: Setup, fitted: Fitted, decoders: list[Decoder], weights: dict[int, float]) -> list[Decoder]:
    """The generated decoders (``scoring.generated``) as they run inside ``generate()``: the interpolation at its
    optimum over all positions (``weights``: window → w), and the prompted LM's graphmax counting λ_t after the
    prompt."""
    positions = max(weights)
    prompted = fitted.prompted
    after_prompt = {} if prompted is None else {
        d.id: d for d in prompted_decoders(setup, prompted, prompt_length=len(prompted.prompt.ids))}
    return [interpolation_at(d, setup.graph, weights[positions])
            if d.variant.method is Method.INTERPOLATION_OPTIMUM else after_prompt.get(d.id, d)
            for d in generated(decoders)]


def continuations(setup: Setup, fitted: Fitted, decoders: list[Decoder], weights: dict[int, float], model, tok,
                  sizes: dict, seed: int) -> tuple[list[str], list[str], dict, dict]:
    """Held-out openings continued by each of the ``generators`` and scored against held-out texts.

    Returns:
        The openings, the references, generation.csv's rows and the continuations (``scoring.generation_rows``).
    """
    gen = generators(setup, fitted, decoders, weights)
    lms = {LM.BASE: (model, None)}
    if fitted.finetuned is not None:
        lms[LM.FINE_TUNED] = (fitted.finetuned.result.model, None)
    if fitted.prompted is not None:
        lms[LM.PROMPTED] = (model, fitted.prompted.prompt.ids)
    openings = [" ".join(t.split()[:OPENING_WORDS]) for t in setup.test[-sizes["prompts"]:]]
    references = setup.test[:sizes["references"]]
    knn = [d for d in gen if isinstance(d.processor, KnnContextGraphmaxLogitsProcessor) and d.processor.tap is not None]
    for dec in knn:  # inside generate() a kNN decoder's tap reads its own LM's head
        dec.processor.tap.attach(lms[dec.lm][0])
    generation, samples = generation_rows(gen, lms, model, tok, openings, references, sizes["new_tokens"], seed)
    for dec in knn:
        dec.processor.tap.remove()
    return openings, references, generation, samples


def evaluate(args, sizes: dict, model, tok, out: Path) -> None:
    """The measurements, written into the report folder ``out``."""
    setup = prepare(args, tok, out / "work")
    check_fits(setup.graph, model, tok)
    prompt = draw_prompt(args, tok, setup)
    lams, mixture_lams = paper_grids(args)
    positions = sizes["positions"]
    windows = sorted({min(SHORT_WINDOW, positions), positions})
    fitted = fit(args, sizes, model, tok, setup, prompt, out / "work")

    decoders = roster(setup, fitted.tuned, [lam for lam in lams if lam > 0], mixture_lams, positions,
                      fitted.finetuned, fitted.knn, fitted.prompted)
    nll, ms = score_decoders(decoders, fitted.scored, windows)
    interpolated, weights = interpolations(setup.graph, fitted.scored, windows, nll)
    decoders += interpolated
    perplexity = perplexity_rows(decoders, nll, ms, windows)
    for row in perplexity.values():
        print(f"{row['decoder']:<60} " + "  ".join(f"{w}: {row[f'ratio_{w}']:.3f}×" if row[f"ratio_{w}"] else
                                                   f"{w}: —" for w in windows), flush=True)

    openings, references, generation, samples = continuations(setup, fitted, decoders, weights[LM.BASE], model,
                                                              tok, sizes, args.seed)

    # the per-step cost goal is for batch 1: greedy, one opening at a time, plain vs ours
    by_id = {d.id: d for d in decoders}
    cost = decode_cost(model, tok, openings[:COST_OPENINGS], by_id[LM.BASE, OURS].processor,
                       max_new_tokens=sizes["new_tokens"])
    print(f"batch 1 greedy: ours {cost['ratio']:.2f}× plain ({cost['processor_ms']:.1f} ms per processor call, "
          f"{cost['implied_ratio']:.3f}× implied)", flush=True)
    bleu4 = bleu_comparisons(samples, References(references, 4), generation)

    traces = solver_traces(setup.graph, model, tok)
    probe = openings[0]  # a test document's opening: the top-10 figure shows this corpus, not a fixed review
    finetuned_model = None if fitted.finetuned is None else fitted.finetuned.result.model
    top10 = top_tokens(tok, top_token_panels(setup.graph, model, by_id, finetuned_model), probe)
    results = Results(
        corpus=args.corpus, clean=args.clean, model=args.model, seed=args.seed, sizes=sizes,
        documents={**setup.split_docs, "validation": len(setup.validation), "test": len(setup.test)},
        tuned=fitted.tuned, windows=windows, perplexity=perplexity, nll=nll, interpolation_weights=weights,
        generation=generation, samples=samples, bleu4=bleu4, traces=traces, openings=openings, cost=cost,
        knn=None if fitted.knn is None else fitted.knn.summary(),
        finetune=None if fitted.finetuned is None else fitted.finetuned.summary,
        prompted=None if fitted.prompted is None else fitted.prompted.summary())
    write_tables(out, results, fitted.tuning)
    draw(out, lams, perplexity, generation, traces, top10, probe, windows[0])
    write_ab_sheet(out, openings, samples[LM.BASE, SOFTMAX], samples[LM.BASE, OURS], args.seed)
    write_report(out, results)
