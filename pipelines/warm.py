"""Compile graphmax's numba kernels into numba's on-disk cache once, right after installing (``setup.sh``).

Without it the first process that decodes compiles them (about 20 s on 2 CPU cores for the context decoder's
kernels); afterwards each process only loads them from the cache. numba writes the cache beside the sources
(``__pycache__``) or, where that is read-only (an installed package), under the user's cache folder; a kernel is
cached per argument types, so they are compiled on a real graph folder, whose arrays have the types a stored
graph gives (memory-mapped, read-only), not on stand-ins.

    python3 -c "from pipelines.warm import warm_kernels; warm_kernels()"
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from gm_graphs import add_ngrams, count_corpus, load_graph, write_graph
from gm_solver import ContextGraphmaxLogitsProcessor, PaperGraphmaxLogitsProcessor

TEXT = ["This movie was great and the acting was great too.", "The plot was so bad that I left the movie.",
        "I loved the story, and the actors loved it too."]


def warm_kernels(tokenizer: str = "smollm2") -> float:
    """Build a three-sentence graph (Ã and Ã², n-gram tables) in a temporary folder and run one step of each decoder
    on it, which compiles every kernel the build and the decoders use.

    Args:
        tokenizer (``str``, defaults to ``"smollm2"``): anything ``--tokenizer`` accepts; the bundled one by default,
            so that the arrays have the types of the graphs users build for SmolLM2.

    Returns:
        ``float``: the seconds it took.
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="graphmax-warm-") as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(TEXT) + "\n")
        graph = write_graph(count_corpus(corpus, tokenizer, progress=False), Path(tmp) / "graph", orders=(1, 2),
                            progress=False)
        add_ngrams(graph, corpus, tokenizer, progress=False)
        graph = load_graph(graph.path)
        PaperGraphmaxLogitsProcessor(graph).warmup()  # Ãᵏ and mixtures apply the same kernels to the same types
        ContextGraphmaxLogitsProcessor(graph).warmup()
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"graphmax: numba kernels compiled into numba's cache in {warm_kernels():.1f} s")
