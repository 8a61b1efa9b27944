"""``graphmax tune``: choose context-aware graphmax's divergence, λ, order weights and back-off on validation text.

Coordinate search on held-out perplexity of validation documents (the LM runs
once; each candidate only re-decodes its logits): divergence × λ first, then
the share of λ on KL(x‖q), the smoothing (Kneser–Ney's discount D or the
Dirichlet prior κ), how many of the graph's n-gram tables to use (when it has
some), the order weights, how fast λ falls with the context's length
(λ_t = λ·t^(−γ)), and finally λ and that share again around the best. The choice
and the perplexities behind it go into the graph's manifest, where
``GraphmaxLogitsProcessor.from_graph`` finds them (``gm_solver.DecoderChoice``). With ``--datastore DIR`` the
kNN datastore's share β and temperature T are tuned on top, then λ's scale, then
the weight of its marginal bias and λ's scale again; they are stored beside the
choice with the datastore's keys' SHA-256, and ``graphmax generate --datastore``
uses them with that datastore.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from gm_graphs.errors import OptionError
from gm_solver import ContextConfig, DecoderChoice

from .args import CLEAN_HELP, CorpusFiles, integer
from .build import add_graph_arguments, graph_arg
from .devices import add_device_arguments, resolve_device, resolve_dtype
from .models import DEFAULT_MODEL

if TYPE_CHECKING:
    from gm_solver import Datastore

    from .heldout import HeldOut

LAMBDAS = (0.3, 1.0, 3.0)
SMOOTHINGS = (*({"smoothing": "kneser-ney", "discount": d} for d in (0.6, 0.75, 0.9)),
              *({"smoothing": "dirichlet", "kappa": k} for k in (1.0, 3.0, 10.0)))
ORDER_WEIGHTS = ((1.0,), (0.8, 0.2))
KL_SHARES = (0.0, 0.1, 0.2, 0.3)
# γ of λ_t = λ·t^(−γ): the LM needs the corpus less the more of the document it has seen (on movie-review
# validation text, of λ ∈ {0.6, 1.2, 2.4, 4.8}, positions 1–8 did best with 2.4 and positions 33–64 with 0.6)
LAM_DECAYS = (0.0, 0.25, 0.5, 0.75, 1.0)
# the kNN datastore's share β in the reference and its temperature T (squared distances of SmolLM2's final states
# are in the hundreds; on drug-review and news validation text β 0.35–0.7, T 50–100 did best), then λ's scale,
# which rose by a third with the datastore in the same measurements
KNN_WEIGHTS = (0.2, 0.35, 0.5, 0.7)
KNN_TEMPERATURES = (25.0, 50.0, 100.0, 200.0)
KNN_LAM_FACTORS = (0.85, 1.0, 1.2, 1.4)
# the weight of the datastore's marginal bias on the scores, then λ's scale again (on drug-review and news validation
# text 0.75 did best with a datastore, 0.5 on the fine-tuned LM; at 64 tokens it lowered news 0.662 → 0.634 alone)
MARGINAL_WEIGHTS = (0.0, 0.5, 0.75, 1.0, 1.25, 1.5)
KNN_K = 1024


def tune_config(graph, heldout: HeldOut, *, divergences=("rkl", "kl", "l2"), lambdas=LAMBDAS,
                kl_shares=KL_SHARES, smoothings=SMOOTHINGS, order_weights=ORDER_WEIGHTS, lam_decays=LAM_DECAYS,
                progress: bool = True) -> tuple[ContextConfig, list[dict]]:
    """The ContextConfig with the lowest perplexity on ``heldout``, and every candidate tried."""
    from tqdm.auto import tqdm

    from gm_solver import GraphmaxLogitsProcessor

    from .heldout import perplexity

    tried: dict[ContextConfig, float] = {}
    bar = tqdm(desc="tune", unit="candidate", disable=not progress)

    def ppl(cfg: ContextConfig) -> float:
        if cfg not in tried:
            tried[cfg] = perplexity(heldout, GraphmaxLogitsProcessor.from_graph(graph, settings=cfg))
            bar.update(1)
            bar.set_postfix(best=f"{min(tried.values()):.2f}", refresh=False)
        return tried[cfg]

    best = min((ContextConfig(divergence=d, lam=lam, kl_share=0.0) for d in divergences for lam in lambdas), key=ppl)
    if best.divergence != "kl":  # KL(x‖q) plus itself is itself
        best = min((dataclasses.replace(best, kl_share=m) for m in kl_shares), key=ppl)
    best = min((dataclasses.replace(best, **sm) for sm in smoothings), key=ppl)
    tables = sorted(getattr(graph, "ngrams", None) or {})
    if tables:
        best = min((dataclasses.replace(best, ngram_order=n) for n in (2, *tables)), key=ppl)
    best = min((dataclasses.replace(best, order_weights=w) for w in order_weights), key=ppl)
    # λ is constant so far: each γ keeps λ_t at the median scored position equal to it; λ is scanned again next
    mid = statistics.median(t for row in heldout.logits for t in range(1, len(row) + 1))
    best = min((dataclasses.replace(best, lam_decay=g, lam=best.lam * mid ** g) for g in lam_decays), key=ppl)
    best = min((dataclasses.replace(best, lam=best.lam * f) for f in (0.5, 0.7, 0.85, 1.0, 1.2, 1.4, 2.0)), key=ppl)
    if best.divergence != "kl":
        best = min((dataclasses.replace(best, kl_share=round(min(1.0, max(0.0, best.kl_share + d)), 6))
                    for d in (-0.05, 0, 0.05)),
                   key=ppl)
    bar.close()
    table = [{**cfg.to_dict(), "perplexity": p} for cfg, p in sorted(tried.items(), key=lambda kv: kv[1])]
    for row in table:
        row.pop("source")
    return best, table


def tune_knn(graph, heldout: HeldOut, config: ContextConfig, datastore: Datastore, *, weights=KNN_WEIGHTS,
             temperatures=KNN_TEMPERATURES, lam_factors=KNN_LAM_FACTORS, marginal_weights=MARGINAL_WEIGHTS,
             k: int = KNN_K, around: dict | None = None,
             progress: bool = True) -> tuple[ContextConfig, dict, list[dict]]:
    """``KnnContextGraphmaxLogitsProcessor``'s β and T on top of ``config`` (``tune_config``'s choice), then λ's
    scale, then (when the datastore records marginals) the marginal bias' weight and λ's scale again, by held-out
    perplexity of ``heldout`` (scored with ``hidden=True``): the config, the kNN arguments, and every candidate
    tried. ``around`` (the kNN arguments this tuning chose for another LM over the same corpus, e.g. the base LM's
    for the fine-tuned or prompted one) narrows the β, T and marginal-weight grids to its values' neighbours."""
    if around is not None:
        weights, temperatures = _near(weights, around["knn_weight"]), _near(temperatures, around["knn_temperature"])
        marginal_weights = _near(marginal_weights, around["marginal_weight"])
    from tqdm.auto import tqdm

    from gm_solver import GraphmaxLogitsProcessor, HiddenStateTap

    from .heldout import perplexity

    tap = HiddenStateTap()
    tried: dict[tuple, float] = {}
    bar = tqdm(desc="tune kNN", unit="candidate", disable=not progress)

    def ppl(key: tuple) -> float:
        if key not in tried:
            weight, temperature, factor, marginal = key
            scaled = dataclasses.replace(config, lam=config.lam * factor)
            # (weight 0: no search, the marginal bias alone, none at marginal weight 0 too)
            proc = GraphmaxLogitsProcessor.from_graph(
                graph, settings=scaled, datastore=datastore, tap=tap if weight > 0 else None, knn_weight=weight,
                knn_k=k, knn_temperature=temperature, marginal_weight=marginal)
            tried[key] = perplexity(heldout, proc)
            bar.update(1)
        return tried[key]

    with datastore.remembered():  # one search per held-out step, whatever β, T and λ
        best = min(((w, t, 1.0, 0.0) for w in weights for t in temperatures), key=ppl)
        best = min(((*best[:2], f, 0.0) for f in lam_factors), key=ppl)
        if datastore.marginals is not None:
            best = min(((*best[:3], m) for m in marginal_weights), key=ppl)
            best = min(((*best[:2], best[2] * f, best[3]) for f in lam_factors), key=ppl)
    bar.close()
    table = [{**dataclasses.replace(config, lam=config.lam * f).to_dict(), "knn_weight": w, "knn_temperature": t,
              "knn_k": k, "marginal_weight": m, "perplexity": p}
             for (w, t, f, m), p in sorted(tried.items(), key=lambda kv: kv[1])]
    for row in table:
        row.pop("source")
    knn = {"knn_weight": best[0], "knn_temperature": best[1], "knn_k": k, "marginal_weight": best[3]}
    return dataclasses.replace(config, lam=config.lam * best[2]), knn, table


def _near(grid, value) -> tuple:
    """The values of ``grid`` (ascending) next to ``value``: the nearest and one on each side where the grid has
    one (a grid of one value: that value)."""
    i = min(range(len(grid)), key=lambda j: abs(grid[j] - value))
    return tuple(grid[max(0, i - 1):i + 2])


def read_texts(corpus, text_column: str, clean: bool, limit: int) -> list[str]:
    from gm_graphs import expand_corpus, iter_documents

    texts: list[str] = []
    for docs in iter_documents(expand_corpus(corpus), text_column, clean=clean):
        texts.extend(docs)
        if len(texts) >= limit:
            break
    return texts[:limit]


def register(sub) -> None:
    p = sub.add_parser("tune",
                       help="choose context-aware graphmax settings on validation text; store them in the graph")
    add_graph_arguments(p)
    p.add_argument("--corpus", nargs="+", required=True, action=CorpusFiles,
                   help="validation files (not the graph's training text)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--clean", action="store_true", help=f"{CLEAN_HELP}, as the build did")
    p.add_argument("--model", default=DEFAULT_MODEL)
    add_device_arguments(p)
    p.add_argument("--docs", type=integer(1), default=48, help="validation documents (default 48)")
    p.add_argument("--positions", type=integer(1), default=64, help="scored tokens per document (default 64)")
    p.add_argument("--datastore", type=Path, metavar="DIR",
                   help="also tune a kNN datastore's β and T (graphmax datastore; of --model over training text)")
    p.set_defaults(run=run, loads_model=True)


def check_not_training_text(graph, files: list[Path]) -> None:
    """Refuse validation files whose bytes are a file the graph was built from (by SHA-256, whatever the name):
    λ chosen on text the graph's counts memorised would favour the graph beyond what it knows of new text."""
    from gm_graphs.corpus.read import fingerprint

    trained = {f["sha256"]: f["path"] for f in graph.manifest["corpus"]["files"]}
    sizes = {f["bytes"] for f in graph.manifest["corpus"]["files"]}
    for f in files:
        if f.stat().st_size not in sizes:
            continue  # only a file of a training file's size can be one; the rest need no hashing
        sha = fingerprint([f])[0]["sha256"]
        if sha in trained:
            raise OptionError(f"the validation file {str(f)!r} is the text graph {graph.name!r} was built from "
                              f"({trained[sha]!r}, SHA-256 {sha[:12]}…); tuning on it would choose λ on memorised "
                              f"text: pass --corpus files held out of the build (e.g. split with "
                              f"gm_graphs.split_corpus before building)")


def run(args) -> int:
    # torch, transformers and the LM only now: a bad argument is refused before they load
    from gm_graphs import expand_corpus, load_graph
    from gm_solver import load_datastore

    from .heldout import perplexity, score_documents
    from .models import check_fits, load_model

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    graph = load_graph(graph_arg(args))  # a missing or broken graph (or datastore) is refused before the model loads
    tuned_on = graph.identity  # the choice is stored only if the graph is still this one when tuning ends
    check_not_training_text(graph, expand_corpus(args.corpus))
    datastore = None
    if args.datastore is not None:
        datastore = load_datastore(args.datastore, device=device)  # searched where the LM's states are
        tokenizer = graph.manifest["tokenizer"]
        datastore.check_tokenizer(tokenizer["vocab_sha256"], tokenizer["vocab_size"], tokenizer.get("split_sha256"))
    model, tok = load_model(args.model, device=device, dtype=dtype)
    check_fits(graph, model, tok)
    if datastore is not None:
        datastore.check_model(model)
    texts = read_texts(args.corpus, args.text_column, args.clean, args.docs)
    heldout = score_documents(model, tok, texts, args.positions, hidden=datastore is not None)
    softmax = perplexity(heldout)
    best, table = tune_config(graph, heldout)
    source = {"tuned": True, "validation": [str(f) for f in expand_corpus(args.corpus)],
              "documents": len(heldout.ids), "positions": heldout.positions, "softmax_perplexity": softmax,
              "perplexity": table[0]["perplexity"], "model": str(args.model)}
    knn_choice = None
    if datastore is not None:
        with_knn, knn, knn_table = tune_knn(graph, heldout, best, datastore)
        choice = DecoderChoice.with_knn(dataclasses.replace(best, source=source), knn, with_knn.lam, datastore,
                                        knn_table[0]["perplexity"])
        knn_choice = choice.knn
    else:
        choice = DecoderChoice(dataclasses.replace(best, source=source))
    graph.set_decoder(choice.to_json(), expected=tuned_on)
    print(f"{'divergence':<20} {'λ':>6} {'smoothing':<20} {'order weights':<14} {'perplexity':>10}")
    for row in table[:10]:
        cfg = ContextConfig.from_dict(row)
        print(f"{cfg.divergence_label:<20} {row['lam']:>6.3g} {cfg.smoothing_label:<20} "
              f"{str(row['order_weights']):<14} {row['perplexity']:>10.2f}")
    print(f"softmax perplexity {softmax:.2f}; chosen: {best.divergence_label}, λ={best.lam:g}, {best.smoothing_label}, "
          f"order weights {list(best.order_weights)}, λ_t = λ·t^(−{best.lam_decay:g}) "
          f"({table[0]['perplexity'] / softmax:.3f}× softmax), "
          f"stored in {graph.path / 'manifest.json'}")
    if knn_choice is not None:
        knn = knn_choice.config
        print(f"with the datastore ({len(datastore):,} keys): β = {knn.knn_weight:g}, T = "
              f"{knn.knn_temperature:g}, marginal bias weight {knn.marginal_weight:g}, λ = {knn_choice.lam:g} "
              f"({knn_choice.perplexity / softmax:.3f}× softmax), stored for `graphmax generate --datastore "
              f"{args.datastore}`")
    return 0
