"""Compile graphmax's numba kernels into numba's on-disk cache once, right after installing (``setup.sh``).

Without it the first process that decodes compiles them; afterwards each process only loads them from the cache.
numba writes the cache beside the sources (``__pycache__``) or, where that is read-only (an installed package),
under the user's cache folder; a kernel is cached per argument types, so they are compiled on a real graph folder,
whose arrays have the types a stored graph gives (memory-mapped, read-only), not on stand-ins.

numba compiles a kernel and everything it calls on one core, so two tasks of disjoint decoders compile at once,
each in its own process, where there are two cores: the context decoder's step (56 s of CPU with its graph, the
larger part) and Ã²'s operators with the paper decoder (38 s); one after the other they took 79 s (2 CPU cores, an
empty ``NUMBA_CACHE_DIR``). The paper decoder's task also runs its solve in float32 (``graphmax(..., dtype=
torch.float32)``, the Python API's other working dtype: the mirror kernels again, for float32 rows; the task alone
35.1 s → 45.3 s) and stays the shorter of the two. Both build a graph, so both compile the counting kernels; the
cache's lock makes the two saves of one kernel safe.

    python3 -c "from pipelines.warm import warm_kernels; warm_kernels()"
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

# gm_graphs and gm_solver (and torch with them) are imported by the tasks, in their own processes: the process that
# hands them out needs none of it
TEXT = ["This movie was great and the acting was great too.", "The plot was so bad that I left the movie.",
        "I loved the story, and the actors loved it too."]


def _graph(folder: Path, tokenizer: str, orders: tuple[int, ...], ngrams: bool):
    """A three-sentence graph in ``folder``, loaded as a stored graph is (memory-mapped, read-only)."""
    from gm_graphs import add_ngrams, count_corpus, load_graph, write_graph

    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(TEXT) + "\n")
    graph = write_graph(count_corpus(corpus, tokenizer, progress=False), folder / "graph", orders=orders,
                        progress=False)
    if ngrams:
        add_ngrams(graph, corpus, tokenizer, progress=False)
    return load_graph(graph.path)


def warm_context(tokenizer: str) -> None:
    """The counting and n-gram kernels, then one step of the context decoder (its types do not depend on Ã²), and
    its reference rows alone (what eval's interpolation rows read)."""
    import torch

    from gm_solver import ContextGraphmaxLogitsProcessor

    with tempfile.TemporaryDirectory(prefix="graphmax-warm-") as tmp:
        decoder = ContextGraphmaxLogitsProcessor(_graph(Path(tmp), tokenizer, (1,), ngrams=True))
        decoder.warmup()
        decoder.reference(torch.zeros((1, 2), dtype=torch.long))


def warm_operators_and_paper(tokenizer: str) -> None:
    """The counting kernels and Ã²'s, then one step of the paper decoder (Ãᵏ and mixtures apply the same kernels to
    the same types), and the same solve in float32 (``graphmax(..., dtype=torch.float32)``, the working dtype the
    Python API offers beside float64: each mirror kernel again, for float32 rows)."""
    import torch

    from gm_solver import PaperGraphmaxLogitsProcessor, graphmax

    with tempfile.TemporaryDirectory(prefix="graphmax-warm-") as tmp:
        graph = _graph(Path(tmp), tokenizer, (1, 2), ngrams=False)
        PaperGraphmaxLogitsProcessor(graph).warmup()
        # scores spread as a model's, a batch of one and one of two, as the decoder's warmup takes them
        scores = torch.randn(graph.vocab_size, generator=torch.Generator().manual_seed(0)) * 4
        for rows in (1, 2):
            graphmax(scores.repeat(rows, 1), graph, 1.0, dtype=torch.float32)


TASKS = (warm_context, warm_operators_and_paper)  # the longest first


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def warm_kernels(tokenizer: str = "smollm2", workers: int | None = None) -> float:
    """Build small graphs (Ã, Ã², n-gram tables) in temporary folders and run one step of each decoder on them,
    which compiles every kernel the build and the decoders use: :data:`TASKS`, each in a process of its own up to
    the cores this process may use, else one after another here.

    Args:
        tokenizer (``str``, defaults to ``"smollm2"``): anything ``--tokenizer`` accepts; the bundled one by default,
            so that the arrays have the types of the graphs users build for SmolLM2.
        workers (``int`` or ``None``, defaults to ``None``): processes at most; ``None``: one a core, up to a task each.

    Returns:
        ``float``: the seconds it took.
    """
    workers = min(len(TASKS), _cores() if workers is None else max(1, workers))
    t0 = time.perf_counter()
    if workers == 1:
        for task in TASKS:
            task(tokenizer)
    else:
        # spawn: a fresh interpreter per task, not a fork of a caller that may hold torch's or numba's threads
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            for done in [pool.submit(task, tokenizer) for task in TASKS]:
                done.result()  # a task's exception is raised here
    return time.perf_counter() - t0


def warm_in_background() -> None:
    """What ``python -m pipelines.warm --background`` runs, started by a command that decodes with torch meanwhile
    (``gm_solver.backends.compile_in_background``): :func:`warm_kernels` in this one process at the lowest priority,
    holding ``compile_lock()`` (the commands beside it then leave it a core); a second one started meanwhile leaves
    at once, and so does one that finds the lock's path taken by anything but a regular file."""
    from gm_solver.backends import holding_compile_lock

    os.nice(19)
    with holding_compile_lock() as held:
        if held:
            warm_kernels(workers=1)


#: the command ``compile_in_background`` starts: this module, by the interpreter running graphmax
BACKGROUND = [sys.executable, "-m", "pipelines.warm", "--background"]


def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.warm [--tokenizer T] [--workers N] [--background]``: its arguments are checked before
    anything compiles, so that a mistyped one is refused at once rather than after minutes of compiling."""
    from .args import ArgumentParser, integer

    parser = ArgumentParser(prog="python -m pipelines.warm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="smollm2", help="anything --tokenizer accepts (default smollm2)")
    parser.add_argument("--workers", type=integer(1), default=None,
                        help="processes at most (default: one a core, up to a task each)")
    parser.add_argument("--background", action="store_true",
                        help="at the lowest priority, in this one process; leave at once if one runs already")
    args = parser.parse_args(argv)
    if args.background:
        warm_in_background()
    else:
        print(f"graphmax: numba kernels compiled into numba's cache in "
              f"{warm_kernels(args.tokenizer, args.workers):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
