"""Writing graphs: corpus → counts → operators (and n-gram tables) → a graph folder, committed atomically;
merging partial builds; adding n-gram tables to a built graph.

Every writer holds the target's lock and commits in one atomic step (``gm_graphs.folders``): a build, overwrite
or merge fills a temporary folder that replaces the target at once; ``add_ngrams`` writes its tables into a new
sub-folder and commits by replacing the manifest. A kill at any point leaves the old graph or the new one.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from .corpus import CorpusSpec, ReadStats, expand_corpus, fingerprint, iter_documents
from .counts import BigramCounts, CountAccumulator
from .errors import CorpusError, GraphmaxError, MergeError, OptionError
from .faults import fault_point
from .folders import check_replaceable, disk_errors, locked, remove_tree, staged_folder, sync_tree, target_folder
from .graph import Graph, load_graph
from .ngrams import RUN_ENTRIES, ORDERS, NgramCounts, check_orders, count_ngrams, merge_ngrams
from .operators import OperatorSpec, PruneRule, build_operators, normalize
from .storage import (DEFAULT_SHARD_NNZ, NGRAMS, CSRWriter, GraphFiles, file_entry, new_ngram_folder, read_manifest,
                      referenced_folders, remove_unreferenced, save_array, write_csr, write_edges, write_manifest,
                      write_ngram_tables, write_stats)
from .tokenize import BatchEncoder, TokenizerIdentity, load_tokenizer


@dataclass
class CorpusCounts:
    """Counts of one corpus (or a merge of several) with what the manifest records about them."""

    counts: BigramCounts
    tokenizer: TokenizerIdentity
    files: list[dict]
    read: dict
    options: dict
    timings: dict = field(default_factory=dict)

    def merge(self, other: "CorpusCounts") -> "CorpusCounts":
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


def count_corpus(corpus: CorpusSpec, tokenizer, *, text_column: str = "text", clean: bool = False,
                 bos_eos: bool = False, batch_docs: int = 2048, progress: bool = True) -> CorpusCounts:
    """Stream ``corpus`` through the tokenizer and count its within-document bigrams.

    Memory stays bounded by the batch size and the number of distinct bigrams,
    whatever the corpus size.
    """
    files = expand_corpus(corpus)
    tok = load_tokenizer(tokenizer)
    encoder = BatchEncoder(tok, add_bos_eos=bos_eos)
    acc = CountAccumulator(encoder.vocab_size)
    stats = ReadStats()
    sizes = {str(f): f.stat().st_size for f in files}
    total_bytes = sum(sizes.values())
    t0 = time.perf_counter()
    encode_s = 0.0
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize+count", disable=not progress) as bar:
        done_files = 0
        for docs in iter_documents(files, text_column, clean=clean, batch_docs=batch_docs, stats=stats):
            t = time.perf_counter()
            ids, offsets = encoder.encode(docs)
            encode_s += time.perf_counter() - t
            acc.add(ids, offsets)
            elapsed = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(docs_s=f"{acc.documents / elapsed:,.0f}", tok_s=f"{acc.tokens / elapsed:,.0f}",
                            refresh=False)
            finished = sum(sizes[f] for f in stats.per_file)
            if finished > done_files:
                bar.update(finished - done_files)
                done_files = finished
        bar.update(total_bytes - done_files)
    counts = acc.result()
    elapsed = time.perf_counter() - t0
    read = asdict(stats)
    options = {"text_column": text_column, "clean": clean, "bos_eos": bos_eos}
    return CorpusCounts(counts, TokenizerIdentity.of(tok), fingerprint(files), read, options,
                        {"count_s": elapsed, "encode_s": encode_s})


def _specs(orders: Iterable[int], mixture: int | None) -> list[OperatorSpec]:
    orders = sorted({int(k) for k in orders} | {1})
    specs = [OperatorSpec("power", k) for k in orders]
    if mixture is not None and int(mixture) > 1:
        specs.append(OperatorSpec("mixture", int(mixture)))
    return specs


MAX_ORDER = 999  # operator names have at most three digits (gm_graphs.validate)


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


def _write_into(tmp: Path, cc: CorpusCounts, *, name: str, orders: Sequence[int], mixture: int | None, eps: float,
                prune: PruneRule, shard_nnz: int, progress: bool, ngrams: dict[int, NgramCounts] | None,
                ngram_source: dict | None) -> None:
    """Write counts, stats, operators, n-gram tables and finally the manifest into the staging folder ``tmp``."""
    specs = _specs(orders, mixture)
    n = cc.counts.vocab_size
    t0 = time.perf_counter()
    counts_csr = cc.counts.to_csr()
    src, dst = cc.counts.src_dst()
    pq.write_table(pa.table({"src": src, "dst": dst, "count": cc.counts.counts}), tmp / "counts.parquet",
                   compression="zstd")
    counts_entry = {"parquet": file_entry(tmp, tmp / "counts.parquet"),
                    "shards": write_csr(tmp, "counts", counts_csr, np.int64, shard_nnz)}
    stats = write_stats(tmp, counts_csr)
    fault_point("build.counts_written")
    base = normalize(counts_csr, eps)
    operators = {"order1": _write_operator(tmp, "order1", base, shard_nnz, None, None)}
    higher = [s for s in specs if s.name != "order1"]
    if higher:
        writers = {s.name: CSRWriter(tmp, s.name, n, np.float32, shard_nnz) for s in higher}
        kept = {s.name: np.empty(n, dtype=np.float32) for s in higher}
        for r0, blocks in build_operators(base, higher, prune, progress=progress):
            for key, (block, frac) in blocks.items():
                writers[key].add(block)
                kept[key][r0:r0 + block.shape[0]] = frac
        for s in higher:
            shards = writers[s.name].close()
            operators[s.name] = _write_operator(tmp, s.name, None, shard_nnz, shards, kept[s.name], prune)
    fault_point("build.operators_written")
    manifest = {
        "name": name,
        "tokenizer": cc.tokenizer.to_dict(),
        "corpus": {"files": cc.files, **{k: v for k, v in cc.read.items()}, "options": cc.options,
                   "documents": cc.counts.documents, "tokens": cc.counts.tokens,
                   "bigrams": cc.counts.total, "distinct_bigrams": cc.counts.distinct},
        "eps": eps,
        "counts": counts_entry,
        "stats": stats,
        "operators": operators,
        "matrix_free": {"base": "order1",
                        "rule": "order k = apply order1 k times; mixture n = sum of orders 1..n"},
    }
    if ngrams:
        manifest[NGRAMS] = {**(ngram_source or {}), **write_ngram_tables(tmp, NGRAMS, ngrams)}
        fault_point("build.ngrams_written")
    write_manifest(tmp, manifest)
    cc.timings["write_s"] = time.perf_counter() - t0


def _write_operator(root: Path, name: str, matrix, shard_nnz: int, shards, kept,
                    prune: PruneRule | None = None) -> dict:
    if shards is None:
        shards = write_csr(root, name, matrix, np.float32, shard_nnz)
    entry = {"shards": shards, "nnz": int(sum(s["nnz"] for s in shards)),
             "edges": write_edges(root, f"{name}/edges.parquet", shards, shards[-1]["rows"][1], "weight"),
             "pruned": False, "prune_rule": None}
    if kept is not None:
        entry.update(
            row_mass=save_array(root, f"{name}/row_mass.npy", kept),
            pruned=bool((kept < 1.0 - 1e-6).any()) if not prune.is_exact else False,
            prune_rule=prune.to_dict(),
            row_mass_kept={"min": float(kept.min()), "mean": float(kept.mean()),
                           "p10": float(np.quantile(kept, 0.1))},
        )
    return entry


def _opened(target: Path) -> Graph:
    """The graph just committed, its files recorded as verified (this process hashed them as it wrote them)."""
    GraphFiles(target, read_manifest(target)).trust_written()
    return Graph(target)


def write_graph(cc: CorpusCounts, graph: str | os.PathLike, *, orders: Sequence[int] = (1,),
                mixture: int | None = None, eps: float = 1e-8, prune: PruneRule = PruneRule(),
                shard_nnz: int = DEFAULT_SHARD_NNZ, overwrite: bool = False, progress: bool = True,
                ngrams: dict[int, NgramCounts] | None = None, ngram_source: dict | None = None) -> Graph:
    """Write the counts ``cc``, their operators and (optionally) n-gram tables as the graph ``graph``.

    ``graph`` is a name (``str``: ``$GRAPHMAX_HOME/graphs/<name>``) or a folder (``pathlib.Path``). The folder is
    committed atomically; an existing graph is replaced only with ``overwrite``, and a folder graphmax did not
    write never is.
    """
    check_options(orders=orders, mixture=mixture, eps=eps, prune=prune, shard_nnz=shard_nnz)
    target = target_folder(graph, None) if isinstance(graph, str) else target_folder(None, graph)
    with staged_folder(target, overwrite=overwrite) as tmp:
        _write_into(tmp, cc, name=target.name, orders=orders, mixture=mixture, eps=eps, prune=prune,
                    shard_nnz=shard_nnz, progress=progress, ngrams=ngrams, ngram_source=ngram_source)
    return _opened(target)


def build_graph(corpus: CorpusSpec, tokenizer, name: str | None = None, path: str | os.PathLike | None = None, *,
                text_column: str = "text", orders: Sequence[int] = (1,), mixture: int | None = None,
                eps: float = 1e-8, clean: bool = False, bos_eos: bool = False, prune: PruneRule = PruneRule(),
                shard_nnz: int = DEFAULT_SHARD_NNZ, overwrite: bool = False, batch_docs: int = 2048,
                ngrams: Sequence[int] = (), ngram_run_entries: int = RUN_ENTRIES, progress: bool = True) -> Graph:
    """Build a graph from ``corpus`` with ``tokenizer`` as ``$GRAPHMAX_HOME/graphs/<name>`` or in the folder ``path``.

    With ``ngrams`` (orders such as ``(3, 4)``) the n-gram tables are counted into the same atomic build: a
    failure or a kill anywhere leaves the previous graph of that name (or none), never a graph without its
    tables. Options are checked and the target's lock taken before the corpus is read.

    Example::

        from gm_graphs import build_graph
        g = build_graph("reviews/*.csv.gz", "smollm2", name="amazon", orders=(1, 2), ngrams=(3, 4))
        g.matrix  # Ã as a memory-mapped scipy CSR matrix
    """
    target = target_folder(name, path)
    check_options(orders=orders, mixture=mixture, eps=eps, prune=prune, shard_nnz=shard_nnz)
    if ngrams:
        check_orders(ngrams)
        if not isinstance(ngram_run_entries, int) or ngram_run_entries < 1:
            raise OptionError(f"ngram_run_entries is an integer >= 1, got {ngram_run_entries!r}")
    tok = load_tokenizer(tokenizer)
    if ngrams:
        check_orders(ngrams, TokenizerIdentity.of(tok).vocab_size)
    with staged_folder(target, overwrite=overwrite) as tmp:
        fault_point("build.started")
        cc = count_corpus(corpus, tok, text_column=text_column, clean=clean, bos_eos=bos_eos,
                          batch_docs=batch_docs, progress=progress)
        if cc.counts.distinct == 0:
            raise CorpusError(f"the corpus has no bigrams: each of its {cc.counts.documents:,} documents in the column "
                              f"{text_column!r} is a single token, so the graph would have no edges; check "
                              f"--text-column (it names the column that holds the text)")
        fault_point("build.counted")
        tables, source = None, None
        if ngrams:
            work = tmp / ".ngram-work"
            tables = count_ngrams(corpus, tok, ngrams, text_column=text_column, clean=clean, progress=progress,
                                  work=work, run_entries=ngram_run_entries)
            source = {"corpus": [str(f) for f in expand_corpus(corpus)], "clean": clean, "text_column": text_column}
            fault_point("build.ngrams_counted")
        _write_into(tmp, cc, name=target.name, orders=orders, mixture=mixture, eps=eps, prune=prune,
                    shard_nnz=shard_nnz, progress=progress, ngrams=tables, ngram_source=source)
        if ngrams:
            del tables  # the memory maps of the work folder, before it goes
            shutil.rmtree(work)
    return _opened(target)


def load_counts(graph: Graph) -> CorpusCounts:
    """The counts of a built graph with their provenance, ready to merge."""
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

    The tables go to a new sub-folder of the graph (sorted runs, when an order outgrows ``run_entries`` distinct
    n-grams, to a work folder inside it), and the new manifest that refers to them is the commit: a kill before
    it leaves the old tables in use, and the next writer removes the unreferenced folder.
    """
    graph = graph if isinstance(graph, Graph) else load_graph(graph)
    orders = check_orders(orders)
    graph.check_tokenizer(tokenizer)
    root = graph.path
    with locked(root), disk_errors(root):
        manifest = read_manifest(root)
        remove_unreferenced(root, manifest)
        folder = new_ngram_folder()
        try:
            tables = count_ngrams(corpus, tokenizer, orders, text_column=text_column, clean=clean, progress=progress,
                                  work=root / folder / "work", run_entries=run_entries)
            fault_point("ngrams.counted")
            entry = {"corpus": [str(f) for f in expand_corpus(corpus)], "clean": clean, "text_column": text_column,
                     **write_ngram_tables(root, folder, tables)}
            del tables
            shutil.rmtree(root / folder / "work")
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
