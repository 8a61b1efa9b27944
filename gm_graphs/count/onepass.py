"""One pass over a corpus: read it, tokenize it once, and feed every counter (bigrams and each n-gram order).

Three stages run at once, joined by small bounded queues: a thread reads batches of documents, the calling thread
encodes them (``BatchEncoder``: for byte-level BPE a numba word cache on one core, else the fast tokenizer's
batch encode in Rust on every core; both without the GIL), and a thread counts them (numba kernels and NumPy's
sort, also without the GIL). Counting thus overlaps the encoding instead of following it; what is left after the
pass is merging the sorted runs.
"""

from __future__ import annotations

import queue
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from gm_graphs.corpus.read import ReadStats, iter_documents, text_bytes
from gm_graphs.corpus.source import Progress
from gm_graphs.count.ahead import END, Worker, ahead, put
from gm_graphs.count.bigrams import check_ids
from gm_graphs.count.runs import SortedRuns, feeders
from gm_graphs.store.faults import fault_point
from gm_graphs.tokenize.encoder import BatchEncoder

_DEPTH = 4  # batches waiting between two stages


def read_batches(files: list[Path], text_column: str, *, clean: bool, batch_docs: int,
                 stats: ReadStats, progress: Progress | None = None) -> Iterator[list[str]]:
    """``iter_documents`` run by a thread ahead of the caller."""
    return ahead(iter_documents(files, text_column, clean=clean, batch_docs=batch_docs, stats=stats,
                                progress=progress), _DEPTH, "graphmax-read")


def encoded_batches(files: list[Path], encoder: BatchEncoder, text_column: str, *, clean: bool, batch_docs: int,
                    stats: ReadStats, timings: dict | None = None,
                    progress: Progress | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(ids, offsets)`` of each batch of documents: read by a thread, encoded here. What a build counts, and
    what the tokenizer-only benchmark times."""
    encode_s = 0.0
    for docs in read_batches(files, text_column, clean=clean, batch_docs=batch_docs, stats=stats,
                             progress=progress):
        t = time.perf_counter()
        ids, offsets = encoder.encode(docs)
        encode_s += time.perf_counter() - t
        yield ids, offsets
    if timings is not None:
        timings["encode_s"] = encode_s


@dataclass
class PassResult:
    """What one pass counted: a :class:`SortedRuns` per order (2 = the bigrams), and what reading saw."""

    counters: dict[int, SortedRuns]
    documents: int
    tokens: int
    read: ReadStats
    timings: dict = field(default_factory=dict)


def count_pass(files: list[Path], encoder: BatchEncoder, counters: dict[int, SortedRuns], *, text_column: str,
               clean: bool, batch_docs: int = 2048, progress: bool = True, desc: str = "tokenize+count") -> PassResult:
    """Read and tokenize ``files`` once, counting every batch into each of ``counters`` in another thread
    (consecutive orders from one sort: ``runs.NestedRuns``)."""
    feed = feeders(counters.values())
    stats = ReadStats()
    timings: dict = {}
    q: queue.Queue = queue.Queue(_DEPTH)
    busy = [0.0]
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is END:
                return
            t = time.perf_counter()
            ids, offsets = item
            fault_point("count.batch")
            for f in feed:
                f.add(ids, offsets)
            busy[0] += time.perf_counter() - t

    counter = Worker(consume, "graphmax-count", stop)
    documents = tokens = 0
    t0 = time.perf_counter()
    try:
        # bytes of text read (inflated), told by the reading thread as it reads: also while a file yields no
        # document (an archive of empty lines)
        with tqdm(total=text_bytes(files) if progress else 0, unit="B", unit_scale=True, desc=desc,
                  disable=not progress) as bar:

            def advance(n: int) -> None:
                bar.update(min(n, bar.total - bar.n))

            for ids, offsets in encoded_batches(files, encoder, text_column, clean=clean, batch_docs=batch_docs,
                                                stats=stats, timings=timings, progress=advance if progress else None):
                check_ids(ids, encoder.vocab_size)
                documents += offsets.size - 1
                tokens += ids.size
                if not put(q, (ids, offsets), stop):
                    counter.check()
                elapsed = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix(docs_s=f"{documents / elapsed:,.0f}", tok_s=f"{tokens / elapsed:,.0f}", refresh=False)
            bar.update(bar.total - bar.n)  # a Parquet file's other columns are never read
            timings["tokenize_s"] = time.perf_counter() - t0
            put(q, END, stop)
            counter.join()
            counter.check()
            for f in feed:
                f.release()
    finally:
        stop.set()
    timings["count_pass_s"] = time.perf_counter() - t0
    timings["count_busy_s"] = busy[0]
    timings["peak_rss_mb_count"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return PassResult(counters, int(documents), int(tokens), stats, timings)
