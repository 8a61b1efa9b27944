"""``graphmax build``, ``graphmax merge`` and ``graphmax graphs list|info``."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gm_graphs.errors import GraphFormatError, OptionError

from .args import CLEAN_HELP, CorpusFiles, help_when_shown, integer, integers, number

if TYPE_CHECKING:
    from gm_graphs import PruneRule

# The library's limits and names that the parser checks, as gm_graphs defines them: MAX_ORDER
# (gm_graphs.build.options), MAX_NGRAM_ORDER (gm_graphs.count.ngram_counts' MAX_ORDER), NGRAM_RUN_ENTRIES
# (gm_graphs.count.runs' RUN_ENTRIES) and ENGINES (gm_graphs.build.graphs' keys). Copied, because those modules
# import numba, scipy and pyarrow (a second), and an argument error comes before them; tests/test_startup.py pins
# each copy to its source.
MAX_ORDER = 999
MAX_NGRAM_ORDER = 63
NGRAM_RUN_ENTRIES = 1 << 24
ENGINES = ("local", "ray")
MAX_TOP_K = 2**31 - 1  # more than any row holds (indices are int32 or int64 over a vocabulary)
# a run's buffer of 8-byte entries is allocated whole: it must fit in this machine's memory
MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
MAX_RUN_ENTRIES = MEMORY // 8


def _add_target_options(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--name", help="store under $GRAPHMAX_HOME/graphs/NAME")
    target.add_argument("--path", type=Path, metavar="DIR", help="or write the graph folder DIR")


def _add_operator_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--orders", type=integers(1, "1,2", MAX_ORDER), default=[1],
                   help="powers Ãᵏ to materialise, e.g. 1,2 (default 1)")
    p.add_argument("--mixture", type=integer(2, MAX_ORDER), default=None,
                   help="also materialise Ã+Ã²+…+Ãⁿ for this n ≥ 2")
    p.add_argument("--eps", type=number(at_least=0), default=1e-8, help="ε in D_ii = Σ_j A_ij + ε (default 1e-8)")
    p.add_argument("--prune-top-k", type=integer(0, MAX_TOP_K, " (0 keeps all)"), default=64,
                   help="keep the K largest entries of each row of a higher order (default 64; 0 keeps all)")
    p.add_argument("--prune-min", type=number(at_least=0), default=0.0,
                   help="drop higher-order entries below this value")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing graph of that name (only ever a graph graphmax wrote)")


def add_graph_arguments(p: argparse.ArgumentParser, flag: str | None = None) -> None:
    """A graph to read: by name (positional, or ``flag`` such as --graph) or by folder (--path DIR)."""
    source = p.add_mutually_exclusive_group(required=True)
    if flag:
        source.add_argument(flag, dest="graph", metavar="NAME", help="graph name (under $GRAPHMAX_HOME/graphs)")
    else:
        source.add_argument("graph", nargs="?", metavar="NAME", help="graph name (under $GRAPHMAX_HOME/graphs)")
    source.add_argument("--path", dest="graph_path", type=Path, metavar="DIR", help="or a graph folder")


def graph_arg(args) -> str | Path:
    """What ``add_graph_arguments`` parsed: a name (str) or a folder (Path)."""
    return args.graph_path if args.graph_path is not None else args.graph


def _prune(args) -> PruneRule:
    from gm_graphs import PruneRule

    return PruneRule(top_k=args.prune_top_k or None, min_value=args.prune_min)


def register(sub) -> None:
    p = sub.add_parser("build", help="build a graph from a corpus")
    help_when_shown(p.add_argument("corpus", nargs="+", action=CorpusFiles), _corpus_help)
    p.add_argument("--tokenizer", required=True,
                   help="a local tokenizer folder, tokenizer.json, .gguf file, or 'smollm2' (bundled)")
    _add_target_options(p)
    p.add_argument("--text-column", default="text", help="column/field holding the text (default text)")
    p.add_argument("--clean", action="store_true", help=CLEAN_HELP)
    p.add_argument("--bos-eos", action="store_true", help="add BOS→first and last→EOS edges per document")
    p.add_argument("--allow-duplicate-files", action="store_true",
                   help="count every file given, even files that hold the same bytes (by default copies are refused: "
                        "each copy counts its documents again)")
    p.add_argument("--ngrams", type=integers(3, "3,4", MAX_NGRAM_ORDER), metavar="ORDERS",
                   help="also store n-gram counts of these orders (e.g. 3,4), so context-aware graphmax "
                        "conditions on up to n−1 tokens; part of the same atomic build")
    p.add_argument("--ngram-run-entries", type=integer(1, MAX_RUN_ENTRIES, f" (8 bytes each, in this machine's "
                                                                      f"{MEMORY / 2**30:,.0f} GiB of memory)"),
                   default=NGRAM_RUN_ENTRIES, metavar="N",
                   help=f"bigrams and n-grams of each order buffered in memory (8 bytes each) before they are "
                        f"sorted into a run in the build's temporary folder, merged at the end; bounds memory "
                        f"(default {NGRAM_RUN_ENTRIES:,}: 128 MB per order)")
    p.add_argument("--engine", choices=ENGINES, default="local",
                   help="local: this machine (default); ray: a Ray cluster's workers count, this machine writes "
                        "(needs pip install 'graphmax[ray]')")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="with --engine ray: the cluster, 'auto' on one of its nodes, HOST:6379 or ray://HOST:10001 "
                        "(default: a local Ray)")
    _add_operator_options(p)
    p.set_defaults(run=run_build)

    p = sub.add_parser("merge", help="merge graphs built from disjoint parts of a corpus")
    p.add_argument("graphs", nargs="*", metavar="NAME", help="names of the partial graphs")
    p.add_argument("--part-path", action="append", type=Path, default=[], metavar="DIR",
                   help="a partial graph given by folder (repeatable)")
    _add_target_options(p)
    _add_operator_options(p)
    p.set_defaults(run=run_merge)

    p = sub.add_parser("graphs", help="list built graphs or show one")
    gsub = p.add_subparsers(dest="graphs_command", required=True, metavar="{list,info,upgrade}")
    gsub.add_parser("list", help="the graphs under $GRAPHMAX_HOME").set_defaults(run=run_list)
    info = gsub.add_parser("info", help="a graph's manifest summary")
    add_graph_arguments(info)
    info.add_argument("--json", action="store_true", help="print the whole manifest")
    info.set_defaults(run=run_info)
    upgrade = gsub.add_parser("upgrade", help="convert a graph of an older format in place (atomically)")
    add_graph_arguments(upgrade)
    upgrade.set_defaults(run=run_upgrade)


def _corpus_help() -> str:
    from gm_graphs.corpus.readers import READERS

    return f"files or globs: {READERS.described()}"


def run_build(args) -> int:
    from gm_graphs import build_graph
    from gm_graphs.build.ray_engine import RayOptions

    if args.ray_address is not None and args.engine != "ray":
        raise OptionError("--ray-address names the Ray cluster of --engine ray; add --engine ray, or drop it")
    t0 = time.perf_counter()
    g = build_graph(args.corpus, args.tokenizer, name=args.name, path=args.path, text_column=args.text_column,
                    orders=args.orders, mixture=args.mixture, eps=args.eps, clean=args.clean,
                    bos_eos=args.bos_eos, prune=_prune(args), overwrite=args.overwrite, ngrams=args.ngrams or (),
                    ngram_run_entries=args.ngram_run_entries, engine=args.engine,
                    engine_options=RayOptions(address=args.ray_address) if args.engine == "ray" else None,
                    allow_duplicate_files=args.allow_duplicate_files)
    _summary(g, time.perf_counter() - t0)
    return 0


def run_merge(args) -> int:
    from gm_graphs import merge_graphs

    t0 = time.perf_counter()
    g = merge_graphs([*args.graphs, *args.part_path], name=args.name, path=args.path, orders=args.orders,
                     mixture=args.mixture, eps=args.eps, prune=_prune(args), overwrite=args.overwrite)
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
    if g.decoder:  # what `graphmax tune` stored: generate and from_graph decode with it
        print(f"  decoder    {', '.join(f'{k}={v}' for k, v in g.decoder.items() if k != 'source')}")
    stages = {"tokenize+count": "count_pass_s", "counts and Ã": "bigrams_s", "higher orders": "operators_s",
              "n-grams (beside them)": "ngrams_s", "commit": "commit_s"}
    timings = getattr(g, "timings", {})  # what build_graph measured (a graph loaded from disk has none)
    done = [f"{label} {timings[key]:.1f} s" for label, key in stages.items() if key in timings]
    if done:
        print(f"  stages     {', '.join(done)}")
    if seconds is not None:
        print(f"  built in   {seconds:.1f} s")


def run_list(args) -> int:
    from gm_graphs import list_graphs, load_graph

    names = list_graphs()
    if not names:
        print("no graphs yet; build one with `graphmax build CORPUS --tokenizer T --name NAME`")
    for name in names:
        try:
            m = load_graph(name, verify=False).manifest
        except GraphFormatError as e:  # one broken graph does not hide the others
            print(f"{name:<20} broken: {e}")
            continue
        print(f"{name:<20} {m['corpus']['documents']:>10,} docs {m['corpus']['tokens']:>14,} tokens  "
              f"operators: {', '.join(sorted(m['operators']))}")
    return 0


def run_upgrade(args) -> int:
    from gm_graphs import graph_path, upgrade_graph
    from gm_graphs.format.graph_files import read_manifest

    target = graph_arg(args)
    read_manifest(graph_path(target), v1_ngrams=True)  # a folder that is not a graph is refused before it is walked
    before = _folder_bytes(graph_path(target))
    t0 = time.perf_counter()
    if not upgrade_graph(target):
        print(f"graph {target} is already in this graphmax's format; nothing to do")
        return 0
    after = _folder_bytes(graph_path(target))
    print(f"graph {target} converted to this graphmax's format in {time.perf_counter() - t0:.1f} s: "
          f"{before:,} -> {after:,} bytes")
    return 0


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def run_info(args) -> int:
    from gm_graphs import load_graph

    g = load_graph(graph_arg(args), verify=False)
    if args.json:
        print(json.dumps(g.manifest, indent=2, sort_keys=True))
    else:
        _summary(g)
    return 0
