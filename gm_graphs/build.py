"""Building graphs: corpus → counts → operators → a graph folder; merging partial builds."""

from __future__ import annotations

import os
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
from .errors import GraphExistsError
from .graph import Graph, graph_dir
from .ngrams import merge_ngrams, store_ngrams
from .operators import OperatorSpec, PruneRule, build_operators, normalize
from .storage import (
    DEFAULT_SHARD_NNZ,
    FORMAT_VERSION,
    CSRWriter,
    atomic_folder,
    file_entry,
    write_csr,
    write_edges,
    write_manifest,
)
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

    def merge(self, other: CorpusCounts) -> CorpusCounts:
        if other.tokenizer.vocab_sha256 != self.tokenizer.vocab_sha256:
            raise ValueError("cannot merge counts made with different tokenizers "
                             f"({self.tokenizer.name!r} and {other.tokenizer.name!r}); count both with one tokenizer")
        if other.options != self.options:
            raise ValueError(f"cannot merge counts made with different options ({self.options} vs {other.options})")
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


def write_graph(cc: CorpusCounts, out: str | os.PathLike, *, name: str | None = None, orders: Sequence[int] = (1,),
                mixture: int | None = None, eps: float = 1e-8, prune: PruneRule = PruneRule(),
                shard_nnz: int = DEFAULT_SHARD_NNZ, overwrite: bool = False, progress: bool = True) -> Graph:
    """Write counts and operators of ``cc`` to the graph folder ``out`` atomically."""
    specs = _specs(orders, mixture)
    out = Path(out)
    n = cc.counts.vocab_size
    with atomic_folder(out, overwrite) as tmp:
        t0 = time.perf_counter()
        counts_csr = cc.counts.to_csr()
        src, dst = cc.counts.src_dst()
        pq.write_table(pa.table({"src": src, "dst": dst, "count": cc.counts.counts}), tmp / "counts.parquet",
                       compression="zstd")
        counts_entry = {"parquet": file_entry(tmp, tmp / "counts.parquet"),
                        "shards": write_csr(tmp, "counts", counts_csr, np.int64, shard_nnz)}
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
        manifest = {
            "format_version": FORMAT_VERSION,
            "name": name or out.name,
            "tokenizer": cc.tokenizer.to_dict(),
            "corpus": {"files": cc.files, **{k: v for k, v in cc.read.items()}, "options": cc.options,
                       "documents": cc.counts.documents, "tokens": cc.counts.tokens,
                       "bigrams": cc.counts.total, "distinct_bigrams": cc.counts.distinct},
            "eps": eps,
            "counts": counts_entry,
            "operators": operators,
            "matrix_free": {"base": "order1",
                            "rule": "order k = apply order1 k times; mixture n = sum of orders 1..n"},
        }
        write_manifest(tmp, manifest)
        cc.timings["write_s"] = time.perf_counter() - t0
    return Graph(out)


def _write_operator(root: Path, name: str, matrix, shard_nnz: int, shards, kept,
                    prune: PruneRule | None = None) -> dict:
    if shards is None:
        shards = write_csr(root, name, matrix, np.float32, shard_nnz)
    write_edges(root, root / name / "edges.parquet", shards, shards[-1]["rows"][1], "weight")
    entry = {"shards": shards, "nnz": int(sum(s["nnz"] for s in shards)),
             "edges": file_entry(root, root / name / "edges.parquet"),
             "pruned": False, "prune_rule": None}
    if kept is not None:
        np.save(root / name / "row_mass.npy", kept)
        entry.update(
            row_mass=file_entry(root, root / name / "row_mass.npy"),
            pruned=bool((kept < 1.0 - 1e-6).any()) if not prune.is_exact else False,
            prune_rule=prune.to_dict(),
            row_mass_kept={"min": float(kept.min()), "mean": float(kept.mean()),
                           "p10": float(np.quantile(kept, 0.1))},
        )
    return entry


def build_graph(corpus: CorpusSpec, tokenizer, name: str | None = None, out: str | os.PathLike | None = None, *,
                text_column: str = "text", orders: Sequence[int] = (1,), mixture: int | None = None,
                eps: float = 1e-8, clean: bool = False, bos_eos: bool = False, prune: PruneRule = PruneRule(),
                shard_nnz: int = DEFAULT_SHARD_NNZ, overwrite: bool = False, batch_docs: int = 2048,
                progress: bool = True) -> Graph:
    """Build a graph from ``corpus`` with ``tokenizer`` and write it to ``out`` (or ``$GRAPHMAX_HOME/graphs/name``).

    Example::

        from gm_graphs import build_graph
        g = build_graph("reviews/*.csv.gz", "smollm2", name="amazon", orders=(1, 2))
        g.matrix  # Ã as a memory-mapped scipy CSR matrix
    """
    if name is None and out is None:
        raise ValueError("give a name (stored under $GRAPHMAX_HOME/graphs) or an out folder")
    target = Path(out) if out is not None else graph_dir(name)
    if target.exists() and not overwrite:
        raise GraphExistsError(f"a graph already exists at {target}; choose another name or pass --overwrite")
    cc = count_corpus(corpus, tokenizer, text_column=text_column, clean=clean, bos_eos=bos_eos,
                      batch_docs=batch_docs, progress=progress)
    return write_graph(cc, target, name=name or target.name, orders=orders, mixture=mixture, eps=eps,
                       prune=prune, shard_nnz=shard_nnz, overwrite=overwrite, progress=progress)


def load_counts(graph: Graph) -> CorpusCounts:
    """The counts of a built graph with their provenance, ready to merge."""
    m = graph.manifest
    corpus = m["corpus"]
    read_keys = ("documents", "empty_skipped", "undecodable_documents", "replaced_sequences", "per_file")
    ident = TokenizerIdentity(**m["tokenizer"])
    counts = BigramCounts.from_csr(graph.counts, corpus["documents"], corpus["tokens"])
    return CorpusCounts(counts, ident, corpus["files"], {k: corpus[k] for k in read_keys}, corpus["options"])


def merge_graphs(graphs: Sequence[Graph | str | os.PathLike], name: str | None = None,
                 out: str | os.PathLike | None = None, **write_options) -> Graph:
    """Merge the counts of graphs built from parts of a corpus into one graph, as if built at once.

    n-gram tables merge too, for the orders every part stores.
    """
    if len(graphs) < 2:
        raise ValueError("merge needs at least two graphs")
    sources = [g if isinstance(g, Graph) else Graph(graph_dir(g)) for g in graphs]
    parts = [load_counts(g) for g in sources]
    merged = parts[0]
    for p in parts[1:]:
        merged = merged.merge(p)
    target = Path(out) if out is not None else graph_dir(name)
    graph = write_graph(merged, target, name=name or target.name, **write_options)
    tables = merge_ngrams([g.ngrams for g in sources])
    if tables:
        store_ngrams(graph, tables, {"merged_from": [str(g.path) for g in sources]})
    return graph
