"""``graphmax build``, ``graphmax merge`` and ``graphmax graphs list|info``."""

from __future__ import annotations

import argparse
import json
import time

from gm_graphs import PruneRule, add_ngrams, build_graph, list_graphs, load_graph, merge_graphs
from gm_graphs.ngrams import RUN_ENTRIES

from .args import CorpusFiles, integer, integers, number, several


def _add_operator_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--orders", type=integers(1, "1,2"), default=[1],
                   help="powers Ãᵏ to materialise, e.g. 1,2 (default 1)")
    p.add_argument("--mixture", type=integer(2), default=None, help="also materialise Ã+Ã²+…+Ãⁿ for this n ≥ 2")
    p.add_argument("--eps", type=number(at_least=0), default=1e-8, help="ε in D_ii = Σ_j A_ij + ε (default 1e-8)")
    p.add_argument("--prune-top-k", type=integer(0), default=64,
                   help="keep the K largest entries of each row of a higher order (default 64; 0 keeps all)")
    p.add_argument("--prune-min", type=number(at_least=0), default=0.0,
                   help="drop higher-order entries below this value")
    p.add_argument("--overwrite", action="store_true", help="replace an existing graph of that name")


def _prune(args) -> PruneRule:
    return PruneRule(top_k=args.prune_top_k or None, min_value=args.prune_min)


def register(sub) -> None:
    p = sub.add_parser("build", help="build a graph from a corpus")
    p.add_argument("corpus", nargs="+", action=CorpusFiles,
                   help="files or globs: .parquet .csv .tsv .jsonl .txt (optionally .gz), .zip")
    p.add_argument("--tokenizer", required=True,
                   help="a local tokenizer folder, tokenizer.json, .gguf file, or 'smollm2' (bundled)")
    p.add_argument("--name", help="store under $GRAPHMAX_HOME/graphs/NAME")
    p.add_argument("--out", help="or write to this folder")
    p.add_argument("--text-column", default="text", help="column/field holding the text (default text)")
    p.add_argument("--clean", action="store_true", help="unescape HTML entities and drop <br /> tags")
    p.add_argument("--bos-eos", action="store_true", help="add BOS→first and last→EOS edges per document")
    p.add_argument("--ngrams", type=integers(3, "3,4"), metavar="ORDERS",
                   help="also store n-gram counts of these orders (e.g. 3,4), so context-aware graphmax "
                        "conditions on up to n−1 tokens")
    p.add_argument("--ngram-run-entries", type=integer(1), default=RUN_ENTRIES, metavar="N",
                   help=f"distinct n-grams of an order held in memory before a sorted run is written beside the "
                        f"graph and merged later; bounds memory (default {RUN_ENTRIES:,}, about 1 GB)")
    _add_operator_options(p)
    p.set_defaults(run=run_build)

    p = sub.add_parser("merge", help="merge graphs built from parts of a corpus")
    p.add_argument("graphs", nargs="+", action=several(2, "graphs"), help="names or folders of the partial graphs")
    p.add_argument("--name", help="store under $GRAPHMAX_HOME/graphs/NAME")
    p.add_argument("--out", help="or write to this folder")
    _add_operator_options(p)
    p.set_defaults(run=run_merge)

    p = sub.add_parser("graphs", help="list built graphs or show one")
    gsub = p.add_subparsers(dest="graphs_command", required=True, metavar="{list,info}")
    gsub.add_parser("list", help="the graphs under $GRAPHMAX_HOME").set_defaults(run=run_list)
    info = gsub.add_parser("info", help="a graph's manifest summary")
    info.add_argument("name")
    info.add_argument("--json", action="store_true", help="print the whole manifest")
    info.set_defaults(run=run_info)


def _need_target(args) -> None:
    if not args.name and not args.out:
        raise SystemExit("graphmax: error: give --name NAME or --out FOLDER")


def run_build(args) -> int:
    _need_target(args)
    t0 = time.perf_counter()
    g = build_graph(args.corpus, args.tokenizer, name=args.name, out=args.out, text_column=args.text_column,
                    orders=args.orders, mixture=args.mixture, eps=args.eps, clean=args.clean,
                    bos_eos=args.bos_eos, prune=_prune(args), overwrite=args.overwrite)
    if args.ngrams:
        add_ngrams(g, args.corpus, args.tokenizer, args.ngrams, text_column=args.text_column, clean=args.clean,
                   run_entries=args.ngram_run_entries)
    _summary(g, time.perf_counter() - t0)
    return 0


def run_merge(args) -> int:
    _need_target(args)
    t0 = time.perf_counter()
    g = merge_graphs(args.graphs, name=args.name, out=args.out, orders=args.orders, mixture=args.mixture,
                     eps=args.eps, prune=_prune(args), overwrite=args.overwrite)
    _summary(g, time.perf_counter() - t0)
    return 0


def _summary(g, seconds: float | None = None) -> None:
    m = g.manifest
    c = m["corpus"]
    print(f"graph {m['name']!r} at {g.path}")
    print(f"  tokenizer  {m['tokenizer']['name']} (N = {m['tokenizer']['vocab_size']:,})")
    print(f"  corpus     {len(c['files'])} file(s), {c['documents']:,} documents, {c['tokens']:,} tokens, "
          f"{c['distinct_bigrams']:,} distinct bigrams")
    if c["undecodable_documents"] or c["empty_skipped"]:
        print(f"  input      {c['undecodable_documents']:,} documents had undecodable bytes "
              f"({c['replaced_sequences']:,} replaced); {c['empty_skipped']:,} empty rows skipped")
    for order, e in m.get("ngrams", {}).get("orders", {}).items():
        print(f"  {order}-grams    {e['entries']:,} distinct, {e['contexts']:,} contexts")
    for name, op in sorted(m["operators"].items()):
        extra = ""
        if op.get("prune_rule"):
            kept = op["row_mass_kept"]
            extra = f", pruned by {op['prune_rule']}: rows keep {kept['mean']:.1%} of their mass on average " \
                    f"(min {kept['min']:.1%})"
        print(f"  {name:<10} {op['nnz']:,} non-zeros{extra}")
    if seconds is not None:
        print(f"  built in   {seconds:.1f} s")


def run_list(args) -> int:
    names = list_graphs()
    if not names:
        print("no graphs yet; build one with `graphmax build CORPUS --tokenizer T --name NAME`")
    for name in names:
        m = load_graph(name, verify=False).manifest
        print(f"{name:<20} {m['corpus']['documents']:>10,} docs {m['corpus']['tokens']:>14,} tokens  "
              f"operators: {', '.join(sorted(m['operators']))}")
    return 0


def run_info(args) -> int:
    g = load_graph(args.name, verify=False)
    if args.json:
        print(json.dumps(g.manifest, indent=2, sort_keys=True))
    else:
        _summary(g)
    return 0
