"""Writing graphs: corpus → counts → operators (and n-gram tables) → a graph folder, committed atomically;
merging partial builds; adding n-gram tables to a built graph.

Every writer holds the target's lock and commits in one atomic step (``gm_graphs.store.folders``): a build, overwrite
or merge fills a temporary folder that replaces the target at once; ``add_ngrams`` writes its tables into a new
sub-folder and commits by replacing the manifest. A kill at any point leaves the old graph or the new one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gm_graphs.build.local import build_local
from gm_graphs.build.options import BuildOptions
from gm_graphs.build.ray_engine import RayOptions, build_on_ray
from gm_graphs.corpus.read import CorpusSpec
from gm_graphs.count.runs import RUN_ENTRIES
from gm_graphs.errors import OptionError
from gm_graphs.format.graph_files import (
    DEFAULT_SHARD_NNZ,
)
from gm_graphs.graph import Graph
from gm_graphs.powers import PruneRule
from gm_graphs.store.folders import (
    target_folder,
)


@dataclass(frozen=True)
class Engine:
    """A build engine: ``build(corpus, tokenizer, target, options, overwrite=, progress=)`` writes the graph, and
    an engine with ``options`` (the record of what only it takes) gets one as a fifth argument."""

    build: Callable[..., Graph]
    options: type | None = None


# the engines a build runs on, each writing the same graph
ENGINES = {"local": Engine(build_local), "ray": Engine(build_on_ray, RayOptions)}


def build_graph(corpus: CorpusSpec, tokenizer, name: str | None = None, path: str | os.PathLike | None = None, *,
                text_column: str = "text", orders: Sequence[int] = (1,), mixture: int | None = None,
                eps: float = 1e-8, clean: bool = False, bos_eos: bool = False, prune: PruneRule = PruneRule(),
                shard_nnz: int = DEFAULT_SHARD_NNZ, overwrite: bool = False, batch_docs: int = 2048,
                ngrams: Sequence[int] = (), ngram_run_entries: int = RUN_ENTRIES, progress: bool = True,
                engine: str = "local", engine_options=None, allow_duplicate_files: bool = False) -> Graph:
    """Build a graph from ``corpus`` with ``tokenizer`` as ``$GRAPHMAX_HOME/graphs/<name>`` or in the folder ``path``.

    The corpus is read and tokenized once; the bigrams and every n-gram order (``ngrams``, such as ``(3, 4)``) are
    counted from that one pass into sorted runs of ``ngram_run_entries`` entries in the build's temporary folder,
    which bound memory whatever the corpus size. Everything goes into one atomic build: a failure or a kill anywhere
    leaves the previous graph of that name (or none), never a graph without its tables. Options are checked and
    the target's lock taken before the corpus is read.

    ``engine="ray"`` runs the same build on Ray Data (``pip install 'graphmax[ray]'``): the workers read, tokenize
    and count blocks of the corpus and merge ranges of the counts; this process writes the graph, byte for byte the
    one the local engine writes (the manifest's ``build`` section aside). Its ``engine_options`` are a
    :class:`~gm_graphs.build.ray_engine.RayOptions` (the cluster's address, …); without them, a Ray already
    initialised in this process, else a local one.

    A real build names a corpus, the LM's tokenizer and a graph name:
    ``build_graph("reviews/*.csv.gz", "smollm2", name="amazon", orders=(1, 2), ngrams=(3, 4))``.

    Args:
        corpus (``str``, ``os.PathLike`` or an iterable of them): corpus files or globs (:func:`expand_corpus`).
        tokenizer: a loaded tokenizer or anything :func:`load_tokenizer` takes (``"smollm2"``, a folder, a
            ``tokenizer.json`` or ``.gguf`` file); the graph's nodes are its vocabulary.
        name (``str`` or ``None``, defaults to ``None``): store the graph as ``$GRAPHMAX_HOME/graphs/<name>``.
        path (``str``, ``os.PathLike`` or ``None``, defaults to ``None``): or write it to this folder (exactly one
            of ``name`` and ``path``).
        text_column (``str``, defaults to ``"text"``): the column or JSONL key holding the text.
        orders (sequence of ``int``, defaults to ``(1,)``): the powers Ãᵏ to materialise.
        mixture (``int`` or ``None``, defaults to ``None``): also materialise Ã+…+Ãⁿ for this n.
        eps (``float``, defaults to 1e-8): ε in D_ii = Σ_j A_ij + ε.
        clean (``bool``, defaults to ``False``): unescape HTML entities and drop ``<br />`` tags.
        bos_eos (``bool``, defaults to ``False``): add BOS→first and last→EOS edges per document.
        prune (``PruneRule``, defaults to ``PruneRule()``): what the higher orders keep of each row.
        shard_nnz (``int``, defaults to 2²⁶): non-zeros per CSR shard file.
        overwrite (``bool``, defaults to ``False``): replace an existing graph graphmax wrote (never another
            folder).
        batch_docs (``int``, defaults to 2048): documents tokenized per batch.
        ngrams (sequence of ``int``, defaults to ``()``): n-gram orders (each ≥ 3) to count and store, for
            context-aware graphmax.
        ngram_run_entries (``int``, defaults to ``NGRAM_RUN_ENTRIES``): entries of each order buffered in memory
            before they are sorted into a run on disk.
        progress (``bool``, defaults to ``True``): show progress bars.
        engine (``str``, defaults to ``"local"``): one of ``ENGINES``: ``"local"`` or ``"ray"``.
        engine_options (defaults to ``None``): the options only ``engine`` takes, its record: a ``RayOptions`` for
            ``"ray"``; the local engine takes none. ``None``: the engine's defaults.
        allow_duplicate_files (``bool``, defaults to ``False``): count corpus files that hold the same bytes once
            each, on purpose; otherwise they are refused in one line naming them (a glob over a folder that holds a
            backup copy would double every count).

    Returns:
        ``Graph``: the built graph, opened at order 1.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
        >>> g = build_graph(folder / "reviews.txt", tok, path=folder / "graph", orders=(1, 2), ngrams=(3,),
        ...                 progress=False)
        >>> [round(p, 3) for p in g.matrix[1].toarray()[0].tolist()]      # Ã's row of "the"
        [0.0, 0.0, 0.667, 0.333, 0.0, 0.0]
        >>> sorted(g.operators), sorted(g.ngrams)
        (['order1', 'order2'], [3])
    """
    target = target_folder(name, path)
    options = BuildOptions(text_column=text_column, orders=orders, mixture=mixture, eps=eps, clean=clean,
                           bos_eos=bos_eos, prune=prune, shard_nnz=shard_nnz, batch_docs=batch_docs, ngrams=ngrams,
                           ngram_run_entries=ngram_run_entries, allow_duplicate_files=allow_duplicate_files)
    if engine not in ENGINES:
        raise OptionError(f"engine is one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    run = ENGINES[engine]
    if run.options is None:
        if engine_options is not None:
            raise OptionError(f"the {engine} engine takes no engine options, got {engine_options!r}; drop them, or "
                              f"build on the engine they are for")
        return run.build(corpus, tokenizer, target, options, overwrite=overwrite, progress=progress)
    if engine_options is None:
        engine_options = run.options()
    elif not isinstance(engine_options, run.options):
        raise OptionError(f"the {engine} engine's options are a {run.options.__name__}, got {engine_options!r}")
    return run.build(corpus, tokenizer, target, options, engine_options, overwrite=overwrite, progress=progress)
