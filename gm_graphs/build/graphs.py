"""Writing graphs: corpus → counts → operators (and n-gram tables) → a graph folder, committed atomically;
merging partial builds; adding n-gram tables to a built graph.

Every writer holds the target's lock and commits in one atomic step (``gm_graphs.store.folders``): a build, overwrite
or merge fills a temporary folder that replaces the target at once; ``add_ngrams`` writes its tables into a new
sub-folder and commits by replacing the manifest. A kill at any point leaves the old graph or the new one.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from gm_graphs.corpus.read import CorpusSpec, expand_corpus, fingerprint
from gm_graphs.count.bigrams import BigramCounts, key_dtype
from gm_graphs.errors import CorpusError, GraphmaxError, MergeError, OptionError
from gm_graphs.store.faults import fault_point
from gm_graphs.store.folders import check_replaceable, disk_errors, locked, remove_tree, staged_folder, sync_tree, target_folder
from gm_graphs.graph import Graph, load_graph
from gm_graphs.count.ngrams import ORDERS, RUN_ENTRIES, NgramCounts, check_orders, merge_ngrams, write_table
from gm_graphs.count.onepass import PassResult, count_pass
from gm_graphs.operators import OperatorSpec, PruneRule, build_operators, square_blocks
from gm_graphs.count.runs import SortedRuns
from gm_graphs.format.graph_files import (
    DEFAULT_SHARD_NNZ,
    NGRAMS,
    GraphFiles,
    new_ngram_folder,
    read_manifest,
    referenced_folders,
    remove_unreferenced,
    write_manifest,
)
from gm_graphs.tokenize.encoder import BatchEncoder, TokenizerIdentity, load_tokenizer
from gm_graphs.format.writer import BigramWriter, Hasher, resolve, write_ngrams, write_operator

ENGINES = ("local", "ray")


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (what each stage's timing records beside its seconds)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
WORKERS = max(1, min(2, os.cpu_count() or 1))  # threads that merge runs and compute Ã² after the pass


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

        >>> import tempfile; from pathlib import Path
        >>> from gm_graphs import word_tokenizer
        >>> tok = word_tokenizer("the cat dog sat ran".split())     # any transformers tokenizer, or "smollm2"
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> _ = (folder / "reviews.txt").write_text("the cat sat\\nthe dog sat\\nthe cat ran\\n")
        >>> _ = (folder / "more.txt").write_text("the dog ran\\n")
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
        if other.tokenizer.vocab_sha256 != self.tokenizer.vocab_sha256 or \
                other.tokenizer.vocab_size != self.tokenizer.vocab_size:
            raise MergeError("cannot merge counts made with different tokenizers "
                             f"({self.tokenizer.name!r} and {other.tokenizer.name!r}); build every part with one "
                             f"tokenizer")
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
        return CorpusCounts(self.counts.merge(other.counts), self.tokenizer,
                            sorted(self.files + other.files, key=lambda f: f["path"]), read, self.options)


def _counters(vocab_size: int, ngrams: Sequence[int], *, bos_eos: bool, run_entries: int,
              work: Path | None) -> dict[int, SortedRuns]:
    """A counter per order: the bigrams (2) and each n-gram order; n-grams never include the BOS/EOS of --bos-eos."""
    return {order: SortedRuns(order, vocab_size, run_entries, None if work is None else work / str(order),
                              inset=1 if bos_eos and order > 2 else 0)
            for order in (2, *ngrams)}


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

        >>> import tempfile; from pathlib import Path
        >>> from gm_graphs import word_tokenizer
        >>> tok = word_tokenizer("the cat dog sat ran".split())     # any transformers tokenizer, or "smollm2"
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> _ = (folder / "reviews.txt").write_text("the cat sat\\nthe dog sat\\nthe cat ran\\n")
        >>> cc = count_corpus(folder / "reviews.txt", tok, progress=False)
        >>> cc.counts.to_csr()[1].toarray()       # "the" is followed by "cat" twice and "dog" once
        array([[0, 0, 2, 1, 0, 0]])
        >>> cc.counts.documents, cc.counts.tokens
        (3, 9)
    """
    files = expand_corpus(corpus)
    tok = load_tokenizer(tokenizer)
    encoder = BatchEncoder(tok, add_bos_eos=bos_eos)
    counted = count_pass(files, encoder, _counters(encoder.vocab_size, (), bos_eos=bos_eos, run_entries=1 << 24,
                                                   work=None),
                         text_column=text_column, clean=clean, batch_docs=batch_docs, progress=progress)
    keys, counts = counted.counters[2].merged()
    n = encoder.vocab_size
    bigrams = BigramCounts(n, keys.astype(key_dtype(n)), counts, counted.documents, counted.tokens)
    options = {"text_column": text_column, "clean": clean, "bos_eos": bos_eos}
    return CorpusCounts(bigrams, TokenizerIdentity.of(tok), fingerprint(files), asdict(counted.read), options,
                        counted.timings)


def _specs(orders: Iterable[int], mixture: int | None) -> list[OperatorSpec]:
    orders = sorted({int(k) for k in orders} | {1})
    specs = [OperatorSpec("power", k) for k in orders]
    if mixture is not None and int(mixture) > 1:
        specs.append(OperatorSpec("mixture", int(mixture)))
    return specs


MAX_ORDER = 999  # operator names have at most three digits (gm_graphs.format.validate)


def check_options(*, orders: Sequence[int] = (1,), mixture: int | None = None, eps: float = 1e-8,
                  prune: PruneRule = PruneRule(), shard_nnz: int = DEFAULT_SHARD_NNZ) -> None:
    """Refuse out-of-range build options with one line each, before any work."""
    def is_int(v) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    if isinstance(orders, (int, str)) or not all(is_int(k) and 1 <= k <= MAX_ORDER for k in orders):
        raise OptionError(f"orders are integers from 1 to {MAX_ORDER} (powers Ãᵏ), got {orders!r}; e.g. --orders 1,2")
    if mixture is not None and not (is_int(mixture) and 1 <= mixture <= MAX_ORDER):
        raise OptionError(f"mixture is an integer from 1 to {MAX_ORDER} (Ã+…+Ãⁿ), got {mixture!r}")
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0):
        raise OptionError(f"eps is a finite number >= 0 (D_ii = Σ_j A_ij + eps), got {eps!r}")
    if not isinstance(prune, PruneRule):
        raise OptionError(f"prune is a gm_graphs.PruneRule, got {type(prune).__name__}")
    if prune.top_k is not None and not (is_int(prune.top_k) and prune.top_k >= 1):
        raise OptionError(f"prune top_k is an integer >= 1 or None (keep all), got {prune.top_k!r}")
    if not (isinstance(prune.min_value, (int, float)) and math.isfinite(prune.min_value) and prune.min_value >= 0):
        raise OptionError(f"prune min_value is a finite number >= 0, got {prune.min_value!r}")
    if not (is_int(shard_nnz) and shard_nnz >= 1):
        raise OptionError(f"shard_nnz is an integer >= 1, got {shard_nnz!r}")


@dataclass
class GraphSource:
    """What a graph is written from: its bigram counts and n-gram tables as ascending ranges of sorted unique keys
    with their counts (whole rows, whole contexts), and what the manifest records about the corpus."""

    tokenizer: TokenizerIdentity
    corpus: dict  # files, read statistics, options, documents, tokens
    bigrams: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]]
    # per order: how many n-grams were counted (Σ counts, which sets the table's dtypes), and the ranges
    ngrams: dict[int, tuple[int, Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]]]] = field(default_factory=dict)
    ngram_source: dict | None = None
    build: dict = field(default_factory=dict)  # the engine: the only part of the manifest two engines write differently
    timings: dict = field(default_factory=dict)  # seconds per stage (not stored: a rebuild writes the same bytes)


def _higher_blocks(base: sp.csr_matrix, spec: OperatorSpec, prune: PruneRule, workers: int,
                   progress: bool) -> Iterator[tuple[int, sp.csr_matrix, np.ndarray]]:
    if spec.kind == "power" and spec.k == 2:
        yield from square_blocks(base, prune, workers=workers, progress=progress)
        return
    for r0, blocks in build_operators(base, [spec], prune, progress=progress):
        block, frac = blocks[spec.name]
        yield r0, block, frac


def _written_base(tmp: Path, shards: list[dict], n: int) -> sp.csr_matrix:
    """Ã as just written (memory-mapped; stacked when it has several shards)."""
    parts = []
    for i, sh in enumerate(shards):
        a = {part: np.load(tmp / f"order1/shard-{i:05d}/{part}.npy", mmap_mode="r") for part in sh["files"]}
        parts.append(sp.csr_matrix((a["data"], a["indices"], a["indptr"]), shape=(sh["rows"][1] - sh["rows"][0], n)))
    return parts[0] if len(parts) == 1 else sp.vstack(parts, format="csr")


def write_graph_into(tmp: Path, src: GraphSource, *, name: str, orders: Sequence[int], mixture: int | None,
                     eps: float, prune: PruneRule, shard_nnz: int, progress: bool, workers: int = WORKERS) -> dict:
    """Write a whole graph into the staging folder ``tmp`` from ``src``: counts, stats, Ã, the higher operators and
    n-gram tables (these two at once, in threads), then the manifest. Returns the manifest."""
    n = src.tokenizer.vocab_size
    timings = src.timings
    hasher = Hasher(workers)
    try:
        t = time.perf_counter()
        bigrams = BigramWriter(tmp, n, eps, shard_nnz, hasher)
        for keys, counts in src.bigrams():
            bigrams.add(keys, counts)
        if bigrams.distinct == 0:
            raise CorpusError(f"the corpus has no bigrams: each of its {src.corpus['documents']:,} documents in the "
                              f"column {src.corpus['options']['text_column']!r} is a single token, so the graph "
                              f"would have no edges; check --text-column (it names the column that holds the text)")
        entries = bigrams.close()
        timings["bigrams_s"] = time.perf_counter() - t
        timings["peak_rss_mb_bigrams"] = peak_rss_mb()
        fault_point("build.counts_written")
        operators = {"order1": entries["order1"]}
        base = _written_base(tmp, entries["order1"]["shards"], n)

        def ngram_tables() -> dict:
            t0 = time.perf_counter()
            tables = {str(order): write_ngrams(tmp, NGRAMS, order, n, ranges(), hasher, total)
                      for order, (total, ranges) in sorted(src.ngrams.items())}
            timings["ngrams_s"] = time.perf_counter() - t0
            timings["peak_rss_mb_ngrams"] = peak_rss_mb()
            return tables

        with ThreadPoolExecutor(1, thread_name_prefix="ngrams") as pool:
            tables = pool.submit(ngram_tables) if src.ngrams else None
            t = time.perf_counter()
            for spec in _specs(orders, mixture):
                if spec.name != "order1":
                    operators[spec.name] = write_operator(
                        tmp, spec.name, n, _higher_blocks(base, spec, prune, workers, progress), shard_nnz, hasher,
                        prune.to_dict(), prune.is_exact)
            timings["operators_s"] = time.perf_counter() - t
            timings["peak_rss_mb_operators"] = peak_rss_mb()
            del base
            fault_point("build.operators_written")
            tables = tables.result() if tables is not None else None
        manifest = {
            "name": name,
            "tokenizer": src.tokenizer.to_dict(),
            "corpus": {**src.corpus, "bigrams": bigrams.total, "distinct_bigrams": bigrams.distinct},
            "eps": eps,
            "counts": entries["counts"],
            "stats": entries["stats"],
            "operators": operators,
            "matrix_free": {"base": "order1",
                            "rule": "order k = apply order1 k times; mixture n = sum of orders 1..n"},
        }
        if tables is not None:
            manifest[NGRAMS] = {**(src.ngram_source or {}), "orders": tables}
            fault_point("build.ngrams_written")
        t = time.perf_counter()
        manifest = resolve(manifest)
        timings["hash_wait_s"] = time.perf_counter() - t
    finally:
        hasher.close()
    manifest["build"] = src.build
    write_manifest(tmp, manifest)
    return manifest


def _opened(target: Path, timings: dict | None = None) -> Graph:
    """The graph just committed, its files recorded as verified (this process hashed them as it wrote them);
    ``graph.timings`` holds the seconds each stage of this build took."""
    GraphFiles(target, read_manifest(target)).trust_written()
    graph = Graph(target)
    graph.timings = timings or {}
    return graph


def _source_of(cc: CorpusCounts, ngrams: dict[int, NgramCounts] | None, ngram_source: dict | None) -> GraphSource:
    corpus = {"files": cc.files, **cc.read, "options": cc.options, "documents": cc.counts.documents,
              "tokens": cc.counts.tokens}
    tables = {order: (int(np.asarray(t.counts).sum()), lambda t=t: [(t.keys(), np.asarray(t.counts))])
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

        >>> import tempfile; from pathlib import Path
        >>> from gm_graphs import word_tokenizer
        >>> tok = word_tokenizer("the cat dog sat ran".split())     # any transformers tokenizer, or "smollm2"
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> _ = (folder / "reviews.txt").write_text("the cat sat\\nthe dog sat\\nthe cat ran\\n")
        >>> cc = count_corpus(folder / "reviews.txt", tok, progress=False)
        >>> g = write_graph(cc, folder / "graph", orders=(1, 2), progress=False)
        >>> sorted(g.operators), g.vocab_size
        (['order1', 'order2'], 6)
    """
    check_options(orders=orders, mixture=mixture, eps=eps, prune=prune, shard_nnz=shard_nnz)
    target = target_folder(graph, None) if isinstance(graph, str) else target_folder(None, graph)
    with staged_folder(target, overwrite=overwrite) as tmp:
        write_graph_into(tmp, _source_of(cc, ngrams, ngram_source), name=target.name, orders=orders,
                         mixture=mixture, eps=eps, prune=prune, shard_nnz=shard_nnz, progress=progress)
    return _opened(target)


def _check_build(orders, mixture, eps, prune, shard_nnz, ngrams, ngram_run_entries, engine) -> None:
    check_options(orders=orders, mixture=mixture, eps=eps, prune=prune, shard_nnz=shard_nnz)
    if engine not in ENGINES:
        raise OptionError(f"engine is one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    if ngrams:
        check_orders(ngrams)
    if not isinstance(ngram_run_entries, int) or isinstance(ngram_run_entries, bool) or ngram_run_entries < 1:
        raise OptionError(f"ngram_run_entries is an integer >= 1, got {ngram_run_entries!r}")


def corpus_entry(files: list[dict], read: dict, options: dict, documents: int, tokens: int) -> dict:
    """The manifest's corpus section (less the bigram totals the writer adds)."""
    return {"files": files, **read, "options": options, "documents": documents, "tokens": tokens}


def build_graph(corpus: CorpusSpec, tokenizer, name: str | None = None, path: str | os.PathLike | None = None, *,
                text_column: str = "text", orders: Sequence[int] = (1,), mixture: int | None = None,
                eps: float = 1e-8, clean: bool = False, bos_eos: bool = False, prune: PruneRule = PruneRule(),
                shard_nnz: int = DEFAULT_SHARD_NNZ, overwrite: bool = False, batch_docs: int = 2048,
                ngrams: Sequence[int] = (), ngram_run_entries: int = RUN_ENTRIES, progress: bool = True,
                engine: str = "local", ray_address: str | None = None) -> Graph:
    """Build a graph from ``corpus`` with ``tokenizer`` as ``$GRAPHMAX_HOME/graphs/<name>`` or in the folder ``path``.

    The corpus is read and tokenized once; the bigrams and every n-gram order (``ngrams``, such as ``(3, 4)``) are
    counted from that one pass into sorted runs of ``ngram_run_entries`` entries in the build's temporary folder,
    which bound memory whatever the corpus size. Everything goes into one atomic build: a failure or a kill anywhere
    leaves the previous graph of that name (or none), never a graph without its tables. Options are checked and
    the target's lock taken before the corpus is read.

    ``engine="ray"`` runs the same build on Ray Data (``pip install 'graphmax[ray]'``): the workers read, tokenize
    and count blocks of the corpus and merge ranges of the counts; this process writes the graph, byte for byte the
    one the local engine writes (the manifest's ``build`` section aside). ``ray_address`` is the cluster
    (``"auto"``, ``"ray://host:10001"``, …); without it, a Ray already initialised in this process, else a local one.

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
        ray_address (``str`` or ``None``, defaults to ``None``): the Ray cluster (``engine="ray"`` only).

    Returns:
        ``Graph``: the built graph, opened at order 1.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> from gm_graphs import word_tokenizer
        >>> tok = word_tokenizer("the cat dog sat ran".split())     # any transformers tokenizer, or "smollm2"
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> _ = (folder / "reviews.txt").write_text("the cat sat\\nthe dog sat\\nthe cat ran\\n")
        >>> g = build_graph(folder / "reviews.txt", tok, path=folder / "graph", orders=(1, 2), ngrams=(3,),
        ...                 progress=False)
        >>> [round(p, 3) for p in g.matrix[1].toarray()[0].tolist()]      # Ã's row of "the"
        [0.0, 0.0, 0.667, 0.333, 0.0, 0.0]
        >>> sorted(g.operators), sorted(g.ngrams)
        (['order1', 'order2'], [3])
    """
    target = target_folder(name, path)
    _check_build(orders, mixture, eps, prune, shard_nnz, ngrams, ngram_run_entries, engine)
    if engine == "ray":
        from gm_graphs.build.ray_engine import build_on_ray

        return build_on_ray(corpus, tokenizer, target, text_column=text_column, orders=orders, mixture=mixture,
                            eps=eps, clean=clean, bos_eos=bos_eos, prune=prune, shard_nnz=shard_nnz,
                            overwrite=overwrite, batch_docs=batch_docs, ngrams=ngrams, progress=progress,
                            ray_address=ray_address, run_entries=ngram_run_entries)
    tok = load_tokenizer(tokenizer)
    ident = TokenizerIdentity.of(tok)
    ngrams = check_orders(ngrams, ident.vocab_size) if ngrams else ()
    with staged_folder(target, overwrite=overwrite) as tmp:
        fault_point("build.started")
        files = expand_corpus(corpus)
        work = tmp / ".work"
        # the encoder (its word cache: up to ~90 MB) is dropped when the pass ends, before the merges
        counted = count_pass(files, BatchEncoder(tok, add_bos_eos=bos_eos),
                             _counters(ident.vocab_size, ngrams, bos_eos=bos_eos, run_entries=ngram_run_entries,
                                       work=work),
                             text_column=text_column, clean=clean, batch_docs=batch_docs, progress=progress)
        fault_point("build.counted")
        if ngrams:
            fault_point("build.ngrams_counted")
        src = local_source(counted, ident, files, ngrams, text_column=text_column, clean=clean, bos_eos=bos_eos)
        try:
            write_graph_into(tmp, src, name=target.name, orders=orders, mixture=mixture, eps=eps, prune=prune,
                             shard_nnz=shard_nnz, progress=progress)
        finally:
            for c in counted.counters.values():
                c.remove()
        shutil.rmtree(work)
        t = time.perf_counter()
    src.timings["commit_s"] = time.perf_counter() - t
    return _opened(target, src.timings)


def local_source(counted: PassResult, ident: TokenizerIdentity, files: list[Path], ngrams: Sequence[int], *,
                 text_column: str, clean: bool, bos_eos: bool) -> GraphSource:
    """The graph source of one local pass: its runs merged range by range as the writer asks for them."""
    runs = counted.counters
    options = {"text_column": text_column, "clean": clean, "bos_eos": bos_eos}
    corpus = corpus_entry(fingerprint(files), asdict(counted.read), options, counted.documents, counted.tokens)
    source = {"corpus": [str(f) for f in files], "clean": clean, "text_column": text_column} if ngrams else None
    tables = {order: (runs[order].windows, lambda r=runs[order]: r.ranges()) for order in ngrams}
    timings = {**counted.timings, "run_bytes": {str(o): r.bytes_written for o, r in runs.items()}}
    return GraphSource(ident, corpus, lambda: runs[2].ranges(workers=WORKERS), tables, source, {"engine": "local"},
                       timings)


def load_counts(graph: Graph) -> CorpusCounts:
    """The counts of a built graph with their provenance, ready to merge.

    Args:
        graph (``Graph``): a built graph.

    Returns:
        ``CorpusCounts``: its bigram counts, tokenizer, corpus files, reading statistics and options.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> from gm_graphs import word_tokenizer
        >>> tok = word_tokenizer("the cat dog sat ran".split())     # any transformers tokenizer, or "smollm2"
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> _ = (folder / "reviews.txt").write_text("the cat sat\\nthe dog sat\\nthe cat ran\\n")
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
    tables merge too, for the orders every part stores. Refused: fewer than two graphs, one graph twice (or a
    corpus file counted in two of them), different tokenizers or counting options.

    Args:
        graphs (sequence of ``Graph``, ``str`` or ``os.PathLike``): the parts, at least two.
        name (``str`` or ``None``, defaults to ``None``): store the merge as ``$GRAPHMAX_HOME/graphs/<name>``.
        path (``str``, ``os.PathLike`` or ``None``, defaults to ``None``): or write it to this folder.
        **write_options: keyword arguments of :func:`write_graph` (``orders``, ``mixture``, ``eps``, ``prune``,
            ``shard_nnz``, ``overwrite``, ``progress``).

    Returns:
        ``Graph``: the merged graph, opened at order 1.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> from gm_graphs import word_tokenizer
        >>> tok = word_tokenizer("the cat dog sat ran".split())     # any transformers tokenizer, or "smollm2"
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> _ = (folder / "reviews.txt").write_text("the cat sat\\nthe dog sat\\nthe cat ran\\n")
        >>> _ = (folder / "more.txt").write_text("the dog ran\\n")
        >>> a = build_graph(folder / "reviews.txt", tok, path=folder / "a", progress=False)
        >>> b = build_graph(folder / "more.txt", tok, path=folder / "b", progress=False)
        >>> merged = merge_graphs([a, b], path=folder / "merged", progress=False)
        >>> int(merged.counts.sum()), int(a.counts.sum()) + int(b.counts.sum())
        (8, 8)
    """
    if isinstance(graphs, (str, os.PathLike)) or len(graphs) < 2:
        raise MergeError("merge needs at least two graphs (the parts to add up)")
    target = target_folder(name, path)
    check_options(**{k: v for k, v in write_options.items() if k in ("orders", "mixture", "eps", "prune",
                                                                      "shard_nnz")})
    check_replaceable(target, bool(write_options.get("overwrite", False)))  # before reading any part
    with locked(target):
        sources = [g if isinstance(g, Graph) else load_graph(g) for g in graphs]
        seen: set[str] = set()
        for g in sources:
            real = os.path.realpath(g.path)
            if real in seen:
                raise MergeError(f"the graph {g.path} is given twice; merging it with itself would double its counts")
            seen.add(real)
        parts = [load_counts(g) for g in sources]
        merged = parts[0]
        for p in parts[1:]:
            merged = merged.merge(p)
        tables = merge_ngrams([g.ngrams for g in sources])
        source = {"merged_from": [str(g.path) for g in sources]} if tables else None
        return write_graph(merged, Path(target), ngrams=tables or None, ngram_source=source, **write_options)


def add_ngrams(graph: Graph | str | os.PathLike, corpus: CorpusSpec, tokenizer, orders: Sequence[int] = ORDERS, *,
               text_column: str = "text", clean: bool = False, progress: bool = True,
               run_entries: int = RUN_ENTRIES) -> dict[int, NgramCounts]:
    """Count ``corpus``'s n-grams with ``tokenizer`` (the graph's own) and store them in the built ``graph``,
    replacing the tables it had; returns the stored tables (memory-mapped).

    The tables go to a new sub-folder of the graph (their sorted runs of ``run_entries`` n-grams to a work folder
    inside it), and the new manifest that refers to them is the commit: a kill before it leaves the old tables in
    use, and the next writer removes the unreferenced folder.

    Args:
        graph (``Graph``, ``str`` or ``os.PathLike``): the built graph, opened or by name or folder.
        corpus (``str``, ``os.PathLike`` or an iterable of them): corpus files or globs (:func:`expand_corpus`).
        tokenizer: the graph's tokenizer (loaded, or anything :func:`load_tokenizer` takes); another vocabulary
            is refused.
        orders (sequence of ``int``, defaults to ``NGRAM_ORDERS``, (3, 4)): the n-gram orders, each ≥ 3.
        text_column (``str``, defaults to ``"text"``): the column or JSONL key holding the text.
        clean (``bool``, defaults to ``False``): unescape HTML entities and drop ``<br />`` tags.
        progress (``bool``, defaults to ``True``): show a progress bar.
        run_entries (``int``, defaults to ``NGRAM_RUN_ENTRIES``): n-grams of an order buffered before a sorted run.

    Returns:
        ``dict[int, NgramCounts]``: the stored tables by order, memory-mapped.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> from gm_graphs import word_tokenizer
        >>> tok = word_tokenizer("the cat dog sat ran".split())     # any transformers tokenizer, or "smollm2"
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> _ = (folder / "reviews.txt").write_text("the cat sat\\nthe dog sat\\nthe cat ran\\n")
        >>> g = build_graph(folder / "reviews.txt", tok, path=folder / "graph", progress=False)
        >>> tables = add_ngrams(g, folder / "reviews.txt", tok, orders=(3,), progress=False)
        >>> nxt, counts = tables[3].successors([1, 2])     # after "the cat": "sat" (4) once, "ran" (5) once
        >>> nxt.tolist(), counts.tolist(), sorted(g.ngrams)
        ([4, 5], [1, 1], [3])
    """
    graph = graph if isinstance(graph, Graph) else load_graph(graph)
    orders = check_orders(orders)
    if not isinstance(run_entries, int) or isinstance(run_entries, bool) or run_entries < 1:
        raise OptionError(f"run_entries is an integer >= 1, got {run_entries!r}")
    graph.check_tokenizer(tokenizer)
    root = graph.path
    with locked(root), disk_errors(root):
        manifest = read_manifest(root)
        remove_unreferenced(root, manifest)
        folder = new_ngram_folder()
        try:
            files = expand_corpus(corpus)
            encoder = BatchEncoder(load_tokenizer(tokenizer))
            n = encoder.vocab_size
            orders = check_orders(orders, n)
            work = root / folder / "work"
            runs = {order: SortedRuns(order, n, run_entries, work / str(order)) for order in orders}
            count_pass(files, encoder, runs, text_column=text_column, clean=clean, progress=progress,
                       desc="count n-grams")
            fault_point("ngrams.counted")
            hasher = Hasher(WORKERS)
            try:
                tables = resolve({str(o): write_table(root, o, n, runs[o], folder, hasher) for o in orders})
            finally:
                hasher.close()
            entry = {"corpus": [str(f) for f in files], "clean": clean, "text_column": text_column,
                     "orders": tables}
            shutil.rmtree(work)
            sync_tree(root / folder)
            fault_point("ngrams.written")
            manifest[NGRAMS] = entry
            write_manifest(root, manifest)
        except BaseException:
            _discard_unreferenced(root, folder)
            raise
        fault_point("ngrams.committed")
        GraphFiles(root, manifest).trust_written(NGRAMS)
        try:
            remove_unreferenced(root, manifest)  # the replaced tables
        except OSError:
            pass  # committed all the same; the next writer of this graph removes them
    graph.refresh()
    return graph.ngrams


def _discard_unreferenced(root: Path, folder: str) -> None:
    """Remove the tables of a failed ``add_ngrams`` unless the manifest on disk already refers to them."""
    try:
        if folder not in referenced_folders(read_manifest(root)) and (root / folder).exists():
            remove_tree(root / folder)
    except (OSError, GraphmaxError):
        pass  # left for the next writer: unreferenced folders are removed under the lock
