"""The local engine: one pass over the corpus on this machine, counted into sorted runs in the build's staging
folder, then written as a graph."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from gm_graphs.build.graph_source import WORKERS, GraphSource, corpus_entry, opened_graph, write_graph_into
from gm_graphs.build.options import BuildOptions
from gm_graphs.corpus.read import CorpusSpec, check_distinct, expand_corpus, fingerprint
from gm_graphs.count.ngram_counts import check_orders
from gm_graphs.count.onepass import PassResult, count_pass
from gm_graphs.count.runs import SortedRuns
from gm_graphs.format.graph_files import (
    GRAPH,
)
from gm_graphs.graph import Graph
from gm_graphs.store.faults import fault_point
from gm_graphs.store.folders import (
    staged_folder,
)
from gm_graphs.tokenize.encoder import BatchEncoder, TokenizerIdentity, load_tokenizer


def counters(vocab_size: int, ngrams: Sequence[int], *, bos_eos: bool, run_entries: int,
              work: Path | None) -> dict[int, SortedRuns]:
    """A counter per order: the bigrams (2) and each n-gram order; n-grams never include the BOS/EOS of --bos-eos."""
    return {order: SortedRuns(order, vocab_size, run_entries, None if work is None else work / str(order),
                              inset=1 if bos_eos and order > 2 else 0)
            for order in (2, *ngrams)}


def local_source(counted: PassResult, ident: TokenizerIdentity, files: list[Path], ngrams: Sequence[int],
                 options: BuildOptions) -> GraphSource:
    """The graph source of one local pass: its runs merged range by range as the writer asks for them."""
    runs = counted.counters
    corpus = corpus_entry(fingerprint(files), asdict(counted.read), options.counting, counted.documents,
                          counted.tokens)
    source = {"corpus": [str(f) for f in files], "clean": options.clean,
              "text_column": options.text_column} if ngrams else None
    tables = {order: (runs[order].windows, runs[order].drain) for order in ngrams}
    timings = {**counted.timings, "run_bytes": {str(o): r.bytes_written for o, r in runs.items()}}
    return GraphSource(ident, corpus, lambda: runs[2].drain(workers=WORKERS), tables, source,
                       {"engine": "local"}, timings)


def build_local(corpus: CorpusSpec, tokenizer, target: Path, options: BuildOptions, *, overwrite: bool,
                progress: bool) -> Graph:
    """``build_graph(engine="local")``: one pass over the corpus here; the engine takes no options of its own."""
    tok = load_tokenizer(tokenizer)
    ident = TokenizerIdentity.of(tok)
    ngrams = check_orders(options.ngrams, ident.vocab_size) if options.ngrams else ()
    with staged_folder(target, overwrite=overwrite, artefact=GRAPH) as tmp:
        fault_point("build.started")
        files = expand_corpus(corpus)
        if not options.allow_duplicate_files:
            check_distinct(files)
        work = tmp / ".work"
        # the encoder (its word cache: up to ~90 MB) is dropped when the pass ends, before the merges
        counted = count_pass(files, BatchEncoder(tok, add_bos_eos=options.bos_eos),
                             counters(ident.vocab_size, ngrams, bos_eos=options.bos_eos,
                                      run_entries=options.ngram_run_entries, work=work),
                             text_column=options.text_column, clean=options.clean, batch_docs=options.batch_docs,
                             progress=progress)
        fault_point("build.counted")
        if ngrams:
            fault_point("build.ngrams_counted")
        src = local_source(counted, ident, files, ngrams, options)
        try:
            write_graph_into(tmp, src, name=target.name, options=options, progress=progress)
        finally:
            for c in counted.counters.values():
                c.remove()
        shutil.rmtree(work)
        t = time.perf_counter()
    src.timings["commit_s"] = time.perf_counter() - t
    return opened_graph(target, src.timings)


