"""What both build engines share: the source a graph is written from (its counts as sorted ranges), and the writing
of a whole graph from it into a staging folder."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from gm_graphs.build.options import BuildOptions
from gm_graphs.errors import CorpusError
from gm_graphs.format.graph_files import (
    NGRAMS,
    GraphFiles,
    read_manifest,
    write_manifest,
)
from gm_graphs.format.writer import BigramWriter, Hasher, resolve, write_ngrams, write_operator
from gm_graphs.graph import Graph
from gm_graphs.powers import OperatorSpec, PruneRule, build_operators, square_blocks
from gm_graphs.store.faults import fault_point
from gm_graphs.tokenize.encoder import TokenizerIdentity


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (what each stage's timing records beside its seconds)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
WORKERS = max(1, min(2, os.cpu_count() or 1))  # threads that merge runs and compute Ã² after the pass


def _specs(orders: Iterable[int], mixture: int | None) -> list[OperatorSpec]:
    orders = sorted({int(k) for k in orders} | {1})
    specs = [OperatorSpec("power", k) for k in orders]
    if mixture is not None and int(mixture) > 1:
        specs.append(OperatorSpec("mixture", int(mixture)))
    return specs


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


def write_graph_into(tmp: Path, src: GraphSource, *, name: str, options: BuildOptions, progress: bool,
                     workers: int = WORKERS) -> dict:
    """Write a whole graph into the staging folder ``tmp`` from ``src``: counts, stats, Ã, the higher operators and
    n-gram tables (these two at once, in threads), then the manifest. Returns the manifest."""
    n = src.tokenizer.vocab_size
    eps, prune, shard_nnz = options.eps, options.prune, options.shard_nnz
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
            tables = write_ngrams(tmp, NGRAMS, n, ((order, total, ranges())
                                                   for order, (total, ranges) in sorted(src.ngrams.items())), hasher)
            timings["ngrams_s"] = time.perf_counter() - t0
            timings["peak_rss_mb_ngrams"] = peak_rss_mb()
            return tables

        with ThreadPoolExecutor(1, thread_name_prefix="ngrams") as pool:
            tables = pool.submit(ngram_tables) if src.ngrams else None
            t = time.perf_counter()
            for spec in _specs(options.orders, options.mixture):
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
            manifest[NGRAMS] = {**(src.ngram_source or {}), **tables}
            fault_point("build.ngrams_written")
        t = time.perf_counter()
        manifest = resolve(manifest)
        timings["hash_wait_s"] = time.perf_counter() - t
    finally:
        hasher.close()
    manifest["build"] = src.build
    write_manifest(tmp, manifest)
    return manifest


def opened_graph(target: Path, timings: dict | None = None) -> Graph:
    """The graph just committed, its files recorded as verified (this process hashed them as it wrote them);
    ``graph.timings`` holds the seconds each stage of this build took."""
    GraphFiles(target, read_manifest(target)).trust_written()
    graph = Graph(target)
    graph.timings = timings or {}
    return graph


def corpus_entry(files: list[dict], read: dict, options: dict, documents: int, tokens: int) -> dict:
    """The manifest's corpus section (less the bigram totals the writer adds)."""
    return {"files": files, **read, "options": options, "documents": documents, "tokens": tokens}
