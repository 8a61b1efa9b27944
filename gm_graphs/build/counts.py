"""Graphs from counts held in memory: count a corpus, write its counts as a graph, read a graph's counts back, and
merge the graphs of disjoint parts of a corpus."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from gm_graphs.build.graph_source import GraphSource, opened_graph, write_graph_into
from gm_graphs.build.local import counters
from gm_graphs.build.options import BuildOptions
from gm_graphs.corpus.read import CorpusSpec, expand_corpus, fingerprint
from gm_graphs.count.bigrams import BigramCounts, key_dtype
from gm_graphs.count.ngram_counts import NgramCounts, merge_ngrams
from gm_graphs.count.onepass import count_pass
from gm_graphs.count.runs import RUN_ENTRIES
from gm_graphs.errors import MergeError
from gm_graphs.format.graph_files import (
    DEFAULT_SHARD_NNZ,
    GRAPH,
)
from gm_graphs.graph import Graph, load_graph
from gm_graphs.powers import PruneRule
from gm_graphs.store.folders import (
    check_replaceable,
    locked,
    staged_folder,
    target_folder,
)
from gm_graphs.tokenize.encoder import BatchEncoder, TokenizerIdentity, load_tokenizer


@dataclass
class CorpusCounts:
    """Counts of one corpus (or a merge of several) with what the manifest records about them.

    Made by :func:`count_corpus` or read back from a graph by :func:`load_counts`; :func:`write_graph` writes one
    as a graph, and ``merge`` adds up the counts of disjoint parts of a corpus.

    Args:
        counts (``BigramCounts``): the bigram counts A.
        tokenizer (``TokenizerIdentity``): the tokenizer that made them.
        files (``list[dict]``): path, size and SHA-256 of each corpus file.
        read (``dict``): what reading saw (``ReadStats`` as a dict).
        options (``dict``): the counting options (``text_column``, ``clean``, ``bos_eos``); parts merge only
            with equal options.
        timings (``dict``, defaults to ``{}``): seconds per phase.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt, more.txt (conftest.py)
        >>> cc = count_corpus(folder / "reviews.txt", tok, progress=False)
        >>> cc.counts.total, cc.tokenizer.vocab_size, cc.options["text_column"]
        (6, 6, 'text')
        >>> cc.merge(count_corpus(folder / "more.txt", tok, progress=False)).counts.total
        8
    """

    counts: BigramCounts
    tokenizer: TokenizerIdentity
    files: list[dict]
    read: dict
    options: dict
    timings: dict = field(default_factory=dict)

    def merge(self, other: CorpusCounts) -> CorpusCounts:
        mine, theirs = self.tokenizer, other.tokenizer
        if theirs.vocab_sha256 != mine.vocab_sha256 or theirs.vocab_size != mine.vocab_size:
            raise MergeError("cannot merge counts made with different tokenizers "
                             f"({mine.name!r} and {theirs.name!r}); build every part with one tokenizer")
        if None not in (mine.split_sha256, theirs.split_sha256) and mine.split_sha256 != theirs.split_sha256:
            raise MergeError(f"cannot merge counts made with tokenizers that split text differently ({mine.name!r} "
                             f"and {theirs.name!r}: one vocabulary, other ids for the same text); build every part "
                             f"with one tokenizer, loaded the same way")
        if other.options != self.options:
            raise MergeError(f"cannot merge counts made with different options ({self.options} vs {other.options}); "
                             f"build every part with the same --text-column, --clean and --bos-eos")
        twice = {f["path"] for f in self.files} & {f["path"] for f in other.files}
        same = [f for f in other.files if f["path"] in twice and f in self.files]
        if same:
            raise MergeError(f"the corpus file {same[0]['path']} was counted in two of the graphs; merging would "
                             f"count it twice: merge graphs of disjoint parts")
        read = {k: self.read[k] + other.read[k] for k in self.read if k != "per_file"}
        read["per_file"] = {**self.read["per_file"], **other.read["per_file"]}
        # a part built before the split was recorded may have been split either way: the sum records no split
        ident = mine if theirs.split_sha256 == mine.split_sha256 else replace(mine, split_sha256=None)
        return CorpusCounts(self.counts.merge(other.counts), ident,
                            sorted(self.files + other.files, key=lambda f: f["path"]), read, self.options)


def count_corpus(corpus: CorpusSpec, tokenizer, *, text_column: str = "text", clean: bool = False,
                 bos_eos: bool = False, batch_docs: int = 2048, progress: bool = True) -> CorpusCounts:
    """Stream ``corpus`` through the tokenizer and count its within-document bigrams, in memory.

    Memory grows with the distinct bigrams; ``build_graph`` streams them to disk instead.

    Args:
        corpus (``str``, ``os.PathLike`` or an iterable of them): corpus files or globs (:func:`expand_corpus`).
        tokenizer: a loaded tokenizer or anything :func:`load_tokenizer` takes (``"smollm2"``, a folder, a
            ``tokenizer.json`` or ``.gguf`` file).
        text_column (``str``, defaults to ``"text"``): the column or JSONL key holding the text.
        clean (``bool``, defaults to ``False``): unescape HTML entities and drop ``<br />`` tags.
        bos_eos (``bool``, defaults to ``False``): add BOS→first and last→EOS edges per document.
        batch_docs (``int``, defaults to 2048): documents tokenized per batch.
        progress (``bool``, defaults to ``True``): show a progress bar.

    Returns:
        ``CorpusCounts``: the counts with the corpus' fingerprint, reading statistics and options.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
        >>> cc = count_corpus(folder / "reviews.txt", tok, progress=False)
        >>> cc.counts.to_csr()[1].toarray()       # "the" is followed by "cat" twice and "dog" once
        array([[0, 0, 2, 1, 0, 0]])
        >>> cc.counts.documents, cc.counts.tokens
        (3, 9)
    """
    files = expand_corpus(corpus)
    tok = load_tokenizer(tokenizer)
    encoder = BatchEncoder(tok, add_bos_eos=bos_eos)
    counted = count_pass(files, encoder, counters(encoder.vocab_size, (), bos_eos=bos_eos, run_entries=RUN_ENTRIES,
                                                   work=None),
                         text_column=text_column, clean=clean, batch_docs=batch_docs, progress=progress)
    keys, counts = counted.counters[2].merged()
    n = encoder.vocab_size
    bigrams = BigramCounts(n, keys.astype(key_dtype(n)), counts, counted.documents, counted.tokens)
    options = {"text_column": text_column, "clean": clean, "bos_eos": bos_eos}
    return CorpusCounts(bigrams, TokenizerIdentity.of(tok), fingerprint(files), asdict(counted.read), options,
                        counted.timings)


def _source_of(cc: CorpusCounts, ngrams: dict[int, NgramCounts] | None, ngram_source: dict | None) -> GraphSource:
    corpus = {"files": cc.files, **cc.read, "options": cc.options, "documents": cc.counts.documents,
              "tokens": cc.counts.tokens}
    tables = {order: (int(t.count_values().sum()), lambda t=t: [(t.keys(), t.count_values())])
              for order, t in (ngrams or {}).items()}
    return GraphSource(cc.tokenizer, corpus, cc.counts.ranges, tables, ngram_source, {"engine": "memory"})


def write_graph(cc: CorpusCounts, graph: str | os.PathLike, *, orders: Sequence[int] = (1,),
                mixture: int | None = None, eps: float = 1e-8, prune: PruneRule = PruneRule(),
                shard_nnz: int = DEFAULT_SHARD_NNZ, overwrite: bool = False, progress: bool = True,
                ngrams: dict[int, NgramCounts] | None = None, ngram_source: dict | None = None) -> Graph:
    """Write the counts ``cc``, their operators and (optionally) n-gram tables as the graph ``graph``.

    ``graph`` is a name (``str``: ``$GRAPHMAX_HOME/graphs/<name>``) or a folder (``pathlib.Path``). The folder is
    committed atomically; an existing graph is replaced only with ``overwrite``, and a folder graphmax did not
    write never is.

    Args:
        cc (``CorpusCounts``): the counts, from :func:`count_corpus`, :func:`load_counts` or a ``merge``.
        graph (``str`` or ``os.PathLike``): a name (under ``$GRAPHMAX_HOME/graphs``) or a folder.
        orders (sequence of ``int``, defaults to ``(1,)``): the powers Ãᵏ to materialise.
        mixture (``int`` or ``None``, defaults to ``None``): also materialise Ã+…+Ãⁿ for this n.
        eps (``float``, defaults to 1e-8): ε in D_ii = Σ_j A_ij + ε.
        prune (``PruneRule``, defaults to ``PruneRule()``): what the higher orders keep of each row.
        shard_nnz (``int``, defaults to 2²⁶): non-zeros per CSR shard file.
        overwrite (``bool``, defaults to ``False``): replace an existing graph graphmax wrote.
        progress (``bool``, defaults to ``True``): show progress bars.
        ngrams (``dict[int, NgramCounts]`` or ``None``, defaults to ``None``): n-gram tables to store with it.
        ngram_source (``dict`` or ``None``, defaults to ``None``): where the tables came from, for the manifest.

    Returns:
        ``Graph``: the written graph, opened at order 1.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
        >>> cc = count_corpus(folder / "reviews.txt", tok, progress=False)
        >>> g = write_graph(cc, folder / "graph", orders=(1, 2), progress=False)
        >>> sorted(g.operators), g.vocab_size
        (['order1', 'order2'], 6)
    """
    options = BuildOptions(orders=orders, mixture=mixture, eps=eps, prune=prune, shard_nnz=shard_nnz)
    target = target_folder(graph, None) if isinstance(graph, str) else target_folder(None, graph)
    with staged_folder(target, overwrite=overwrite, artefact=GRAPH) as tmp:
        write_graph_into(tmp, _source_of(cc, ngrams, ngram_source), name=target.name, options=options,
                         progress=progress)
    return opened_graph(target)


def load_counts(graph: Graph) -> CorpusCounts:
    """The counts of a built graph with their provenance, ready to merge.

    Args:
        graph (``Graph``): a built graph.

    Returns:
        ``CorpusCounts``: its bigram counts, tokenizer, corpus files, reading statistics and options.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
        >>> from pathlib import Path
        >>> from gm_graphs import build_graph
        >>> g = build_graph(folder / "reviews.txt", tok, path=folder / "graph", progress=False)
        >>> cc = load_counts(g)
        >>> cc.counts.total, [Path(f["path"]).name for f in cc.files]
        (6, ['reviews.txt'])
    """
    m = graph.manifest
    corpus = m["corpus"]
    read_keys = ("documents", "empty_skipped", "undecodable_documents", "replaced_sequences", "per_file")
    ident = TokenizerIdentity(**m["tokenizer"])
    counts = BigramCounts.from_csr(graph.counts, corpus["documents"], corpus["tokens"])
    return CorpusCounts(counts, ident, corpus["files"], {k: corpus[k] for k in read_keys}, corpus["options"])


def merge_graphs(graphs: Sequence[Graph | str | os.PathLike], name: str | None = None,
                 path: str | os.PathLike | None = None, **write_options) -> Graph:
    """Merge the counts of graphs built from disjoint parts of a corpus into one graph, as if built at once.

    ``graphs`` are :class:`Graph` objects, names or folders; the result goes to ``name`` or ``path``. n-gram
    tables merge too, exactly. Refused: fewer than two graphs, one graph twice (or a corpus file counted in two of
    them), different tokenizers or counting options, parts storing n-gram tables of different orders (the merge
    could not hold the sum of a table some part lacks).

    Args:
        graphs (sequence of ``Graph``, ``str`` or ``os.PathLike``): the parts, at least two.
        name (``str`` or ``None``, defaults to ``None``): store the merge as ``$GRAPHMAX_HOME/graphs/<name>``.
        path (``str``, ``os.PathLike`` or ``None``, defaults to ``None``): or write it to this folder.
        **write_options: keyword arguments of :func:`write_graph` (``orders``, ``mixture``, ``eps``, ``prune``,
            ``shard_nnz``, ``overwrite``, ``progress``).

    Returns:
        ``Graph``: the merged graph, opened at order 1.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt, more.txt (conftest.py)
        >>> from gm_graphs import build_graph
        >>> a = build_graph(folder / "reviews.txt", tok, path=folder / "a", progress=False)
        >>> b = build_graph(folder / "more.txt", tok, path=folder / "b", progress=False)
        >>> merged = merge_graphs([a, b], path=folder / "merged", progress=False)
        >>> int(merged.counts.sum()), int(a.counts.sum()) + int(b.counts.sum())
        (8, 8)
    """
    if isinstance(graphs, (str, os.PathLike)) or len(graphs) < 2:
        raise MergeError("merge needs at least two graphs (the parts to add up)")
    target = target_folder(name, path)
    BuildOptions(**{k: v for k, v in write_options.items() if k in ("orders", "mixture", "eps", "prune",
                                                                      "shard_nnz")})
    check_replaceable(target, bool(write_options.get("overwrite", False)), GRAPH)  # before reading any part
    with locked(target):
        sources = [g if isinstance(g, Graph) else load_graph(g) for g in graphs]
        seen: set[str] = set()
        for g in sources:
            real = os.path.realpath(g.path)
            if real in seen:
                raise MergeError(f"the graph {g.path} is given twice; merging it with itself would double its counts")
            seen.add(real)
        _check_same_ngram_orders(sources)
        parts = [load_counts(g) for g in sources]
        merged = parts[0]
        for p in parts[1:]:
            merged = merged.merge(p)
        tables = merge_ngrams([g.ngrams for g in sources])
        source = {"merged_from": [str(g.path) for g in sources]} if tables else None
        return write_graph(merged, Path(target), ngrams=tables or None, ngram_source=source, **write_options)


def _ngram_orders(graph: Graph) -> list[int]:
    return sorted(int(order) for order in graph.manifest.get("ngrams", {}).get("orders", {}))


def _listed(orders: list[int]) -> str:
    return ",".join(map(str, orders)) or "none"


def _check_same_ngram_orders(sources: list[Graph]) -> None:
    """Refuse parts whose n-gram tables differ in order: a table some part lacks cannot be summed exactly."""
    first = _ngram_orders(sources[0])
    for g in sources[1:]:
        orders = _ngram_orders(g)
        if orders != first:
            wanted = sorted(set(first) | set(orders))
            raise MergeError(
                f"the graph {g.path} stores n-gram tables of orders {_listed(orders)} but {sources[0].path} stores "
                f"{_listed(first)}; merging would drop the tables not in every part: give every part the same "
                f"tables (build each with --ngrams {_listed(wanted)}, or add_ngrams(graph, corpus, tokenizer, "
                f"{tuple(wanted)!r}) in Python), then merge")
