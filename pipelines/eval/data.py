"""The eval's text: the corpus checked before anything is written, split by document, and the graph built from
the training side only; the held-out side alternates into validation (tuning) and test (everything reported)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pyarrow.parquet as pq

from gm_graphs import Graph, add_ngrams, count_corpus, iter_documents, split_corpus, write_graph
from gm_graphs.corpus.split import heldout_side
from gm_graphs.errors import CorpusError

# a corpus of up to this many documents is read whole before --out is made, so that its split is checked there
# too (a second read of at most a second or two); a larger one has its split checked after the split is written
PRECHECK_DOCS = 20_000


@dataclasses.dataclass
class Setup:
    """The split and the graphs built from its training side.

    Args:
        graph: the graph of the training side, with its n-gram tables.
        mixture: the same graph read as the paper's Ã+Ã².
        test: the held-out documents everything is reported on.
        validation: the held-out documents context graphmax is tuned on.
        split_docs: the split's document counts ("train", "heldout").
        train_path: the training side (Parquet, column "text"): the graph's and fine-tuning's text.
        build_seconds: the graph and its n-gram tables, from counting to the last table written.
    """

    graph: Graph
    mixture: Graph
    test: list[str]
    validation: list[str]
    split_docs: dict
    train_path: Path | None = None
    build_seconds: float = 0.0


def prepare(args, tok, work: Path) -> Setup:
    """Split ``args.corpus`` into ``work/split``, then build the graph (and its n-gram tables) at ``work/graph``
    from the training side only.

    Args:
        args: the command's arguments (corpus, heldout_fraction, seed, text_column, clean).
        tok: the LM's tokenizer.
        work: the report's working folder.

    Returns:
        The ``Setup``.
    """
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


def check_sides(train: int, heldout: int, fraction: float) -> None:
    """Refuse a split with an empty side, as ``split_corpus`` would, in the command's words."""
    if not train or not heldout:
        raise CorpusError(f"the corpus is too small for --heldout-fraction {fraction:g}: its split has {train:,} "
                          f"training and {heldout:,} held-out documents; add documents or change --heldout-fraction")


def check_corpus(args, files: list[Path]) -> None:
    """What can be known of the corpus before anything is written, past its ``files`` (``expand_corpus`` of
    ``args.corpus``): its text column, that it holds documents, and, for one of at most ``PRECHECK_DOCS``
    documents (read whole here), its split's sides."""
    sides = {False: 0, True: 0}  # held out?
    for docs in iter_documents(files, args.text_column, clean=args.clean):
        for doc in docs:
            sides[heldout_side(doc, args.heldout_fraction, args.seed)] += 1
        if sides[False] + sides[True] > PRECHECK_DOCS:
            return
    check_sides(sides[False], sides[True], args.heldout_fraction)
