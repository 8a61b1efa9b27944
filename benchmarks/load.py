"""What checking a graph costs at load: prints a table, not a test.

    python3 benchmarks/load.py            # the movie-reviews graph `imdb` (built by `graphmax demo` if absent)

Each row opens the graph in a fresh process and takes what context-aware decoding reads at start-up (the counts,
the stats, the n-gram tables) and what the paper's decoder reads (Ã), every array checked before use:

- first load: nothing in the verification cache: SHA-256 of every file and the structure checks;
- structure only: ``verify=False`` (no SHA-256), nothing cached;
- cached load: the same files again: their identities are in the cache, nothing is hashed or scanned (what a
  graph gets right after its build too: the build records what it wrote).

Times are from ``load_graph`` to the last array, in the child process; imports are not counted, nor numba's
start-up in a process (loading the checks' compiled code from numba's cache, which initialises numba's CPU target:
about a second, paid once per process by whichever numba kernel runs first, the solver's otherwise), shown apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _child(folder: str, verify: str) -> dict:
    import numpy as np

    from gm_graphs import load_graph
    from gm_graphs.format import validate

    t0 = time.perf_counter()
    for index in (np.int32, np.int64):  # the checks' signatures, loaded from numba's cache
        validate._csr_problem(np.zeros(1, index), np.zeros(0, index), 1)
    for values in (np.zeros(1, np.int64), np.zeros(1, np.float32)):
        validate._first_below(values, 0)
        validate._first_not_finite_or_negative(values)
    validate._first_not_ascending(np.zeros(1, np.int64), 1)
    numba_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = load_graph(Path(folder), verify=verify == "1")
    counts, stats, ngrams = g.counts, g.stats, g.ngrams
    matrix = g.matrix
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "numba_start": numba_start, "nnz": int(counts.nnz + matrix.nnz),
            "ngram_entries": sum(t.entries for t in ngrams.values()), "stats": len(stats)}


def _run(folder: Path, home: Path, verify: bool) -> dict:
    env = {**os.environ, "GRAPHMAX_HOME": str(home), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__, "--child", str(folder), "1" if verify else "0"], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="runs per row (default 3; the table shows each)")
    args = ap.parse_args()
    from gm_graphs import graph_path, load_tokenizer
    from pipelines.demo import ensure_imdb_graph

    source = graph_path("imdb")
    if not (source / "manifest.json").is_file():
        ensure_imdb_graph(tokenizer=load_tokenizer("smollm2"))
    with tempfile.TemporaryDirectory(dir=source.parent) as tmp:
        folder = Path(tmp) / "imdb"
        shutil.copytree(source, folder)  # new inodes: nothing of it is in any cache
        files = [p for p in folder.rglob("*") if p.is_file()]
        print(f"graph imdb: {len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:,.0f} MB on disk "
              f"(page cache warm: the files were just copied)")
        print(f"{'load':<34} {'seconds per run':>30}   numba start-up (apart)")
        rows = []
        for label, verify, fresh in (("first load (SHA-256 + structure)", True, True),
                                     ("structure only (verify=False)", False, True),
                                     ("cached load (same identities)", True, False)):
            times, starts = [], []
            home = Path(tmp) / "home-cached"
            if not fresh:
                _run(folder, home, verify)  # fills the cache
            for _ in range(args.repeat):
                if fresh:
                    home = Path(tmp) / f"home-{time.perf_counter_ns()}"  # an empty verification cache
                r = _run(folder, home, verify)
                times.append(r["seconds"])
                starts.append(r["numba_start"])
            rows.append((label, times, r))
            print(f"{label:<34} {'  '.join(f'{t:7.3f}' for t in times):>30}   "
                  f"{'  '.join(f'{t:.2f}' for t in starts)}")
        r = rows[0][2]
        print(f"(counts + Ã: {r['nnz']:,} non-zeros; n-gram entries: {r['ngram_entries']:,}; "
              f"{r['stats']} stats arrays)")


if __name__ == "__main__":
    main()
