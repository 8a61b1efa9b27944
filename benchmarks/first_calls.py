"""Where numba's compile (or cache load) lands: each decoder's first calls in a fresh process, with or without
``warmup()``. Prints a table; not a test.

    find . -name '*.nbi' -o -name '*.nbc' | xargs rm -f     # a fresh clone: no compiled kernels
    python3 benchmarks/first_calls.py [--warmup]            # run it twice: compiling, then loading the cache

Uses the demo's graph (``imdb``, built on first use) and a batch of 4 rows of random logits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gm_solver import GraphmaxLogitsProcessor, PaperGraphmaxLogitsProcessor
from pipelines.demo import ensure_imdb_graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", action="store_true", help="call each decoder's warmup() before timing its calls")
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()
    graph = ensure_imdb_graph()
    procs = {"paper λ=1": PaperGraphmaxLogitsProcessor(graph, lam=1.0),
             "context (from_graph)": GraphmaxLogitsProcessor.from_graph(graph)}
    torch.manual_seed(0)
    ids, scores = torch.randint(0, 1000, (4, 12)), torch.randn(4, graph.vocab_size) * 3
    print(f"{'decoder':<22} {'warmup s':>9} {'1st call ms':>12} {'median of the others ms':>24}")
    for name, proc in procs.items():
        t0 = time.perf_counter()
        if args.warmup:
            proc.warmup()
        warm = time.perf_counter() - t0
        calls = []
        for _ in range(args.calls):
            t = time.perf_counter()
            proc(ids, scores)
            calls.append(1e3 * (time.perf_counter() - t))
        print(f"{name:<22} {warm:>9.2f} {calls[0]:>12.1f} {statistics.median(calls[1:]):>24.1f}", flush=True)


if __name__ == "__main__":
    main()
