"""What a kNN datastore costs at decoding time: prints tables, not a test.

    python3 benchmarks/datastore.py --graph-path DIR --datastore DIR [--sizes 50000,250000,1000000]

1. The search alone: ms per ``Datastore.neighbours`` call (k = 1,024) at batches of 1, 8 and 48, over datastores
   of each size, with the keys in float32 and in bfloat16 (random keys of the model's width: a search that reads
   every key costs the same whatever they hold).
2. ``generate()``: greedy, 24 new tokens, batch 1 (4 prompts one at a time) and batch 8: plain decoding, context
   graphmax, and context graphmax with the given datastore (default precision, bfloat16); ms per token, their
   ratios to plain, and each processor's median ms per call with the ratio that alone implies.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

from gm_graphs import load_graph
from gm_solver import (
    ContextGraphmaxLogitsProcessor,
    Datastore,
    HiddenStateTap,
    KnnContextGraphmaxLogitsProcessor,
    load_datastore,
)
from gm_solver.datastore import PRECISIONS
from pipelines.generate import TimedLogitsProcessor, generate_texts, warm_up
from pipelines.models import load_model

PROMPTS = ["This medication", "I took this for", "The side effects were", "After two weeks I",
           "My doctor told me", "It worked well but", "I would not recommend", "The first day was"]


def search_table(dim: int, sizes: list[int], repeat: int = 5) -> None:
    print(f"1. search, k = 1,024, keys of width {dim}: ms per call (median of {repeat})")
    print(f"{'precision':>9} {'keys':>10} {'batch 1':>9} {'batch 8':>9} {'batch 48':>9}")
    for precision, n in itertools.product(PRECISIONS, sizes):
        store = Datastore(torch.randn(n, dim), torch.randint(0, 100, (n,)), vocab_size=100, precision=precision)
        cells = []
        for rows in (1, 8, 48):
            h = torch.randn(rows, dim)
            store.neighbours(h, 1024)
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                store.neighbours(h, 1024)
                times.append(time.perf_counter() - t0)
            cells.append(1e3 * statistics.median(times))
        print(f"{precision:>9} {n:>10,} " + " ".join(f"{c:>9.2f}" for c in cells), flush=True)


def generate_table(model, tok, graph, datastore: Datastore, new_tokens: int) -> None:
    ctx = ContextGraphmaxLogitsProcessor(graph, lam=2.0, lam_decay=0.5)
    tap = HiddenStateTap(model)
    knn = KnnContextGraphmaxLogitsProcessor(graph, datastore, tap, lam=2.0, lam_decay=0.5)
    warm_up(model, tok, [ctx, knn])
    print(f"2. generate(), greedy, {new_tokens} new tokens; datastore of {len(datastore):,} keys: ms per token "
          "(ratio to plain); processor ms per call (the ratio it alone implies)")
    print(f"{'batch':>5} {'plain':>8} {'context':>16} {'context + kNN':>16} {'context ms/call':>17} "
          f"{'+ kNN ms/call':>17}")
    for batch in (1, 8):
        groups = [[p] for p in PROMPTS[:4]] if batch == 1 else [PROMPTS[:8]]
        runs = {"plain": [], "context": [], "knn": []}
        timed = {"context": TimedLogitsProcessor(ctx), "knn": TimedLogitsProcessor(knn)}
        for prompts in groups:  # the three alternate prompt by prompt, so drift hits them alike
            runs["plain"].append(generate_texts(model, tok, prompts, None, max_new_tokens=new_tokens)[1])
            for key in ("context", "knn"):
                runs[key].append(generate_texts(model, tok, prompts, timed[key], max_new_tokens=new_tokens)[1])
        plain = statistics.mean(runs["plain"])
        cells = [f"{statistics.mean(runs[k]):8.1f} ({statistics.mean(runs[k]) / plain:.3f})" for k in timed]
        own = [1e3 * statistics.median(timed[k].calls) for k in timed]
        print(f"{batch:>5} {plain:>8.1f} {cells[0]:>16} {cells[1]:>16} "
              + " ".join(f"{o:>8.2f} ({(plain + o) / plain:.3f})" for o in own), flush=True)
    tap.remove()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph-path", type=Path, required=True, help="a graph built with SmolLM2's tokenizer")
    p.add_argument("--datastore", type=Path, required=True, help="a datastore built with SmolLM2")
    p.add_argument("--sizes", default="50000,250000,1000000")
    p.add_argument("--new-tokens", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2")
    search_table(model.config.hidden_size, [int(s) for s in args.sizes.split(",")])
    generate_table(model, tok, load_graph(args.graph_path), load_datastore(args.datastore), args.new_tokens)


if __name__ == "__main__":
    main()
