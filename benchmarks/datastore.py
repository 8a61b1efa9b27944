"""What a kNN datastore costs at decoding time: prints tables, not a test.

    python3 benchmarks/datastore.py --graph-path DIR --datastore DIR [--sizes 50000,250000,1000000] [--ivf-lists N]
    python3 benchmarks/datastore.py --graph-path DIR --random-keys 1000000 --sections 2,3

1. The search alone: ms per ``Datastore.neighbours`` call (k = 1,024) at batches of 1, 8 and 48, over datastores
   of each size, with the keys in float32 and in bfloat16 (random keys of the model's width: a search that reads
   every key costs the same whatever they hold).
2. ``generate()``: greedy, 24 new tokens, batch 1 (4 prompts one at a time) and batch 8: plain decoding, context
   graphmax, and context graphmax with the given datastore (default precision, bfloat16); ms per token, their
   ratios to plain, and each processor's median ms per call with the ratio that alone implies.
3. The inverted-file index (``index_datastore``, ``--ivf-lists``, default ~4·√keys) on a copy of the datastore:
   the time to index it; per nprobe, ms per search at batch 1 and 8, the share of the exact 1,024 nearest keys
   found, and the total variation between p_knn (T = 50) and the exact search's, over the model's own states along
   greedy continuations of the prompts; then table 2 again with the indexed datastore (nprobe 32).

``--random-keys N`` times tables 2 and 3 on a datastore of N random keys of the model's width (written to a
temporary folder) instead of ``--datastore``: a search that reads every key costs what a real one does, whatever the
keys hold; an index's lists are more even over random keys than over a model's states, and its recall over them
says nothing of a real datastore's.
"""

from __future__ import annotations

import argparse
import itertools
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gm_graphs import load_graph
from gm_solver import (
    ContextGraphmaxLogitsProcessor,
    Datastore,
    HiddenStateTap,
    KnnContextGraphmaxLogitsProcessor,
    index_datastore,
    load_datastore,
)
from gm_solver.datastore import PRECISIONS
from pipelines.decoding import TimedLogitsProcessor, generate_texts, warm_up
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


def _median_ms(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def model_states(model, tok, new_tokens: int) -> torch.Tensor:
    """The LM head's input at every position of greedy continuations of the prompts: queries as decoding makes."""
    texts, _ = generate_texts(model, tok, PROMPTS, None, max_new_tokens=new_tokens)
    with HiddenStateTap(model) as tap, torch.no_grad():
        states = []
        for text in texts:
            model(**tok(text, return_tensors="pt"))
            states.append(tap.states[0].float())
    return torch.cat(states)


def ivf_table(model, tok, datastore_path: Path, lists: int, new_tokens: int) -> Path:
    exact = load_datastore(datastore_path)
    lists = lists or 1 << round(math.log2(4 * math.sqrt(len(exact))))
    copy = Path(tempfile.mkdtemp()) / "indexed"
    shutil.copytree(datastore_path, copy)
    t0 = time.perf_counter()
    index_datastore(copy, lists)
    print(f"3. inverted-file index: {lists:,} lists over {len(exact):,} keys, indexed in "
          f"{time.perf_counter() - t0:.1f} s")
    states = model_states(model, tok, new_tokens)
    reference = load_datastore(datastore_path, precision="float32")  # recall and TV against float32 distances
    p_exact = reference.distribution(states, 1024, 50.0)
    print(f"{'nprobe':>8} {'batch 1 ms':>11} {'batch 8 ms':>11} {'recall@1024':>12} {'TV(p_knn)':>10}   "
          f"({len(states)} states of the model along greedy continuations)")
    for nprobe in (None, 8, 32, 128):
        store = exact if nprobe is None else load_datastore(copy, nprobe=nprobe)
        ms = [_median_ms(lambda rows=rows, store=store: store.neighbours(states[:rows], 1024)) for rows in (1, 8)]
        tv = _total_variation(p_exact, store.distribution(states, 1024, 50.0), exact.vocab_size)
        print(f"{'all keys' if nprobe is None else nprobe:>8} {ms[0]:>11.2f} {ms[1]:>11.2f} "
              f"{_recall(reference, store, states):>12.3f} {tv:>10.4f}", flush=True)
    return copy


def random_datastore(path: Path, model, tok, keys: int, chunk: int = 100_000) -> Path:
    """A datastore of ``keys`` random keys (normal, the model's width) and random next tokens, for the model."""
    from gm_graphs.format.datastore_files import write_datastore
    from gm_graphs.tokenize.encoder import TokenizerIdentity
    from gm_solver.datastore import model_fingerprint

    identity = TokenizerIdentity.of(tok).to_dict()
    rng = np.random.default_rng(0)
    dim = model.config.hidden_size
    chunks = ((rng.standard_normal((min(chunk, keys - lo), dim), dtype=np.float32),
               rng.integers(0, identity["vocab_size"], min(chunk, keys - lo))) for lo in range(0, keys, chunk))
    return write_datastore(path, chunks, dim=dim, tokenizer=identity, model="smollm2",
                           model_sha256=model_fingerprint(model), positions=64, documents=-(-keys // 64))


def _recall(exact: Datastore, store: Datastore, states: torch.Tensor) -> float:
    """The share of the exact 1,024 nearest distances the index also returns (keys at equal distance count once)."""
    want, _ = exact.neighbours(states, 1024)
    got, _ = store.neighbours(states, 1024)
    kth = want[:, -1:]
    return float(((got <= kth * (1 + 1e-3)) & torch.isfinite(got)).sum() / want.numel())


def _total_variation(p: tuple, q: tuple, vocab: int) -> float:
    def dense(tokens, weights):
        return torch.zeros(tokens.shape[0], vocab, dtype=torch.float64).scatter_add_(1, tokens, weights)
    return float(0.5 * (dense(*p) - dense(*q)).abs().sum(1).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph-path", type=Path, required=True, help="a graph built with SmolLM2's tokenizer")
    p.add_argument("--datastore", type=Path, help="a datastore built with SmolLM2")
    p.add_argument("--random-keys", type=int, default=0,
                   help="instead of --datastore: a datastore of N random keys (tables 2 and 3 measure cost only)")
    p.add_argument("--sizes", default="50000,250000,1000000")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--ivf-lists", type=int, default=0, help="lists of the index in table 3 (default ~4·√keys)")
    p.add_argument("--sections", default="1,2,3")
    args = p.parse_args()
    if (args.datastore is None) == (args.random_keys == 0):
        p.error("give --datastore DIR or --random-keys N (one of them)")
    sections = {int(s) for s in args.sections.split(",")}
    torch.set_num_threads(2)
    model, tok = load_model("smollm2")
    graph = load_graph(args.graph_path)
    if 1 in sections:
        search_table(model.config.hidden_size, [int(s) for s in args.sizes.split(",")])
    with tempfile.TemporaryDirectory(prefix="graphmax-bench-") as tmp:
        datastore = args.datastore
        if args.random_keys:
            t0 = time.perf_counter()
            datastore = random_datastore(Path(tmp) / "random", model, tok, args.random_keys)
            print(f"a datastore of {args.random_keys:,} random keys written in {time.perf_counter() - t0:.1f} s")
        if 2 in sections:
            generate_table(model, tok, graph, load_datastore(datastore), args.new_tokens)
        if 3 in sections:
            copy = ivf_table(model, tok, datastore, args.ivf_lists, args.new_tokens)
            generate_table(model, tok, graph, load_datastore(copy, nprobe=32), args.new_tokens)
            shutil.rmtree(copy.parent)


if __name__ == "__main__":
    main()
