"""A graph's n-gram tables (``gm_graphs.count.ngram_counts.NgramCounts``) from a corpus: counted in one pass (in
memory or in sorted runs on disk), written and read back, and added to a built graph or rewritten in the current
format (``upgrade_graph``), the graph's tables replaced in one manifest commit."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gm_graphs.build.graph_source import WORKERS
from gm_graphs.corpus.read import CorpusSpec, expand_corpus
from gm_graphs.count.ngram_counts import ORDERS, NgramCounts, check_orders, tables_of
from gm_graphs.count.ngram_trie import Level
from gm_graphs.count.onepass import count_pass
from gm_graphs.count.runs import RUN_ENTRIES, SortedRuns
from gm_graphs.errors import GraphmaxError, OptionError
from gm_graphs.format.graph_files import (
    NGRAMS,
    GraphFiles,
    new_ngram_folder,
    read_manifest,
    referenced_folders,
    remove_unreferenced,
    write_manifest,
)
from gm_graphs.format.validate import FORMAT_VERSION
from gm_graphs.format.writer import Hasher, resolve, write_ngrams
from gm_graphs.graph import Graph, load_graph
from gm_graphs.store.faults import fault_point
from gm_graphs.store.folders import (
    disk_errors,
    graph_path,
    locked,
    note_left,
    remove_tree,
    sync_tree,
)
from gm_graphs.tokenize.encoder import BatchEncoder, load_tokenizer


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

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
        >>> from gm_graphs import build_graph
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

        def write(folder: str, hasher: Hasher) -> dict:
            files = expand_corpus(corpus)
            encoder = BatchEncoder(load_tokenizer(tokenizer))
            n = encoder.vocab_size
            work = root / folder / "work"
            runs = {order: SortedRuns(order, n, run_entries, work / str(order)) for order in check_orders(orders, n)}
            count_pass(files, encoder, runs, text_column=text_column, clean=clean, progress=progress,
                       desc="count n-grams")
            fault_point("ngrams.counted")
            tables = write_tables(root, n, runs, folder, hasher)
            shutil.rmtree(work)
            return {"corpus": [str(f) for f in files], "clean": clean, "text_column": text_column, **tables}

        _commit_tables(root, manifest, write, "ngrams")
    graph.refresh()
    return graph.ngrams


def upgrade_graph(graph: str | os.PathLike, *, chunk: int = 1 << 22) -> bool:
    """Convert a format-1 graph in place to format 2 (its n-gram tables as one trie, ~3× smaller); returns whether
    anything was converted (False: it already was format 2).

    The new tables go to a new sub-folder, and the new manifest that refers to them is the commit: a kill before it
    leaves the format-1 graph as it was (its unreferenced new folder is removed by the next writer), a kill after it
    the converted graph. The graph decodes exactly as before: the same n-grams with the same counts.

    Args:
        graph (``str`` or ``os.PathLike``): the graph's name (under ``$GRAPHMAX_HOME/graphs``) or folder.
        chunk (``int``, defaults to 2²²): n-grams converted at a time.

    Returns:
        ``bool``: True when the graph was converted.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
        >>> from gm_graphs import build_graph
        >>> g = build_graph(folder / "reviews.txt", tok, path=folder / "graph", ngrams=(3,), progress=False)
        >>> upgrade_graph(folder / "graph")      # built by this version: already format 2
        False
    """
    root = graph_path(graph)
    with locked(root), disk_errors(root):
        manifest = read_manifest(root, v1_ngrams=True)
        remove_unreferenced(root, manifest)
        if manifest["format_version"] == FORMAT_VERSION:
            return False
        if NGRAMS not in manifest:  # laid out as format 2 already: only the version changes
            write_manifest(root, manifest)
            return True
        n = int(manifest["tokenizer"]["vocab_size"])
        tables = GraphFiles(root, manifest).v1_ngram_tables()
        old = manifest[NGRAMS]

        def write(folder: str, hasher: Hasher) -> dict:
            work = ((order, int(np.sum(t["counts"], dtype=np.int64)), _v1_ranges(t, n, chunk))
                    for order, t in sorted(tables.items()))
            entry = write_ngrams(root, folder, n, work, hasher)
            return {**{k: old[k] for k in ("corpus", "clean", "text_column") if k in old}, **entry}

        _commit_tables(root, manifest, write, "upgrade")
    return True


def _v1_ranges(table: dict[str, np.ndarray], n: int, chunk: int):
    """A format-1 table's (keys, counts) in ranges of whole contexts, about ``chunk`` n-grams each."""
    contexts, indptr, nxt, counts = (table[p] for p in ("contexts", "indptr", "next", "counts"))
    start = 0
    while start < contexts.shape[0]:
        stop = max(start + 1, int(np.searchsorted(indptr, int(indptr[start]) + chunk, side="right")) - 1)
        stop = min(stop, contexts.shape[0])
        a, b = int(indptr[start]), int(indptr[stop])
        ptr = np.asarray(indptr[start:stop + 1], dtype=np.int64)
        keys = np.repeat(np.asarray(contexts[start:stop], dtype=np.int64), np.diff(ptr)) * n + np.asarray(nxt[a:b])
        yield keys, np.asarray(counts[a:b], dtype=np.int64)
        start = stop


def _commit_tables(root: Path, manifest: dict, write, stage: str) -> None:
    """Write new n-gram tables into a new folder of the graph ``root`` (``write(folder, hasher)`` returns the
    manifest's ``ngrams`` entry, its hashes as Futures) and commit them by replacing the manifest; then remove the
    tables it no longer names. A failure before the commit removes the new folder; a kill leaves it to the next
    writer. Call with the graph's lock held; ``stage`` names the fault points (``<stage>.written``,
    ``<stage>.committed``)."""
    folder = new_ngram_folder()
    try:
        hasher = Hasher(WORKERS)
        try:
            entry = resolve(write(folder, hasher))
        finally:
            hasher.close()
        sync_tree(root / folder)
        fault_point(f"{stage}.written")
        manifest[NGRAMS] = entry
        write_manifest(root, manifest)
    except BaseException as error:
        note_left(error, _discard_unreferenced(root, folder))
        raise
    fault_point(f"{stage}.committed")
    GraphFiles(root, manifest).trust_written(NGRAMS)
    try:
        remove_unreferenced(root, manifest)  # the replaced tables
    except OSError:
        pass  # committed all the same; the next writer of this graph removes them


def _discard_unreferenced(root: Path, folder: str) -> Path | None:
    """Remove the tables of a failed write unless the manifest on disk already refers to them; the folder where it
    is left (it could not be removed), else None."""
    path = root / folder
    try:
        # a format-1 manifest names its folders too: a failed upgrade leaves nothing behind either
        if folder in referenced_folders(read_manifest(root, v1_ngrams=True)):
            return None  # committed before the failure: the graph's tables now
        if os.path.lexists(path):
            remove_tree(path)
    except (OSError, GraphmaxError):
        pass  # left for the next writer: unreferenced folders are removed under the lock
    return path if os.path.lexists(path) else None


def count_ngrams(corpus: CorpusSpec, tokenizer, orders: Sequence[int] = ORDERS, *, text_column: str = "text",
                 clean: bool = False, batch_docs: int = 2048, progress: bool = True, work: Path | None = None,
                 run_entries: int = RUN_ENTRIES) -> dict[int, NgramCounts]:
    """Stream ``corpus`` through the tokenizer once and count its within-document n-grams of each order.

    Without ``work`` the tables are built in memory, which grows with the
    distinct n-grams. With a ``work`` folder (the caller's, on a disk with room
    for the tables twice) each order is sorted in runs of ``run_entries``
    n-grams there and merged, and its table is memory-mapped from ``work/<n>/``.

    Args:
        corpus (``str``, ``os.PathLike`` or an iterable of them): corpus files or globs (:func:`expand_corpus`).
        tokenizer: a loaded tokenizer or anything :func:`load_tokenizer` takes.
        orders (sequence of ``int``, defaults to ``NGRAM_ORDERS``, (3, 4)): the n-gram orders, each ≥ 3.
        text_column (``str``, defaults to ``"text"``): the column or JSONL key holding the text.
        clean (``bool``, defaults to ``False``): unescape HTML entities and drop ``<br />`` tags.
        batch_docs (``int``, defaults to 2048): documents tokenized per batch.
        progress (``bool``, defaults to ``True``): show a progress bar.
        work (``pathlib.Path`` or ``None``, defaults to ``None``): a folder for the sorted runs and tables;
            ``None``: in memory.
        run_entries (``int``, defaults to ``NGRAM_RUN_ENTRIES``): n-grams of an order buffered before a sorted run.

    Returns:
        ``dict[int, NgramCounts]``: a table per order.

    Example::

        >>> # tok = word_tokenizer("the cat dog sat ran".split()); folder holds reviews.txt (conftest.py)
        >>> tables = count_ngrams(folder / "reviews.txt", tok, orders=(3,), progress=False)
        >>> nxt, counts = tables[3].successors([1, 2])     # after "the cat": "sat" (4) once, "ran" (5) once
        >>> nxt.tolist(), counts.tolist()
        ([4, 5], [1, 1])
    """
    if not isinstance(run_entries, int) or run_entries < 1:
        raise OptionError(f"run_entries must be an integer >= 1, got {run_entries!r}")
    tok = load_tokenizer(tokenizer)
    encoder = BatchEncoder(tok)
    n = encoder.vocab_size
    orders = check_orders(orders, n)
    runs = {order: SortedRuns(order, n, run_entries, None if work is None else Path(work) / str(order) / "runs")
            for order in orders}
    count_pass(expand_corpus(corpus), encoder, runs, text_column=text_column, clean=clean, batch_docs=batch_docs,
               progress=progress, desc="count n-grams")
    if work is None:
        return {order: NgramCounts.from_keys(order, *runs[order].merged(), n) for order in orders}
    return read_tables(Path(work), n, write_tables(Path(work), n, runs))


def write_tables(root: Path, vocab_size: int, runs: dict[int, SortedRuns], folder: str = ".",
                 hasher: Hasher | None = None) -> dict:
    """Merge each order's ``runs`` into the trie's levels ``root/folder/<d>/*.npy``, deleting an order's runs once its
    table is written; the manifest entry (with a ``hasher``: its hashes as Futures)."""
    def tables():
        for order, r in sorted(runs.items()):
            try:
                yield order, r.windows, r.drain()
            finally:
                r.remove()
                if r.folder is not None and r.folder.is_dir():
                    r.folder.rmdir()
    try:
        return write_ngrams(root, folder, vocab_size, tables(), hasher)
    finally:
        for r in runs.values():
            r.remove()


def read_tables(folder: Path, vocab_size: int, entry: dict) -> dict[int, NgramCounts]:
    """The tables this process just wrote into ``folder`` (``write_tables``' entry), memory-mapped, unchecked."""
    levels = [Level(int(d), e["parents"], {part: np.load(folder / d / f"{part}.npy", mmap_mode="r")
                                           for part in e["files"]})
              for d, e in sorted(entry["levels"].items(), key=lambda kv: int(kv[0]))]
    return tables_of(levels, entry["orders"], vocab_size)
