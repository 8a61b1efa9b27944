"""Ã² pruned to its top 64 per row: the fused kernel before and after the bounded rows, on a built graph's Ã.
Prints a table; not a test.

    python3 benchmarks/square.py /path/to/synth4m-graph              # every row: square_blocks, as the build runs it
    python3 benchmarks/square.py /path/to/synth4m-graph --blocks 12  # 12 blocks of 256 rows, the heaviest among them

The old kernel is the package's ``gm_graphs/powers.py`` (``gm_graphs/operators.py`` at revisions before that name)
at ``--baseline`` (git), compiled without numba's cache.
Both run on the same Ã (the graph's order1, as the build passes it) in the same process, interleaved (old, new, old,
new, ...) at 1 and 2 threads; the table gives the median of ``--repeat`` runs and old/new. Every run's output is
compared: indices and float32 values must be the same bytes; the mass kept per row may differ at float64 rounding
(rows where the new kernel skipped columns), and the largest relative difference is printed.

``--blocks 0`` (the default) times ``square_blocks`` itself over all rows: threads over blocks of 1,024 rows, the new
kernel's layout of Ã included. ``--blocks N`` times the row kernels on N blocks of 256 rows, threads taking blocks
in turn; they are the block with the most multiply-adds and N-1 others spread over the rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue

import numpy as np
import scipy.sparse as sp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gm_graphs import PruneRule, load_graph, powers  # noqa: E402

BASELINE = "7d30983"  # the last commit with the unbounded kernel
KERNEL_PATHS = ("gm_graphs/powers.py", "gm_graphs/operators.py")  # the kernel's module, by the name it has at a rev


def baseline_module(rev: str):
    """The kernel's module at git revision ``rev``, as the module ``gm_graphs._square_baseline``."""
    path = next(p for p in KERNEL_PATHS if subprocess.run(["git", "cat-file", "-e", f"{rev}:{p}"], cwd=REPO,
                                                           capture_output=True).returncode == 0)
    src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.replace("cache=True", "cache=False")
    spec = importlib.util.spec_from_loader("gm_graphs._square_baseline", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "gm_graphs"
    sys.modules[spec.name] = module
    exec(compile(src, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def multiply_adds(base: sp.csr_matrix) -> np.ndarray:
    """Per row i of Ã²: Σ_k nnz(row k) over its successors k, the products an unpruned kernel sums."""
    pattern = sp.csr_matrix((np.ones(base.nnz), base.indices, base.indptr), shape=base.shape)
    return np.rint(pattern @ np.diff(base.indptr).astype(np.float64)).astype(np.int64)


def sample_blocks(work: np.ndarray, count: int, rows: int) -> list[int]:
    starts = np.arange(0, work.size, rows)
    per_block = np.add.reduceat(work, starts)
    heaviest = int(starts[np.argmax(per_block)])
    spread = [int(s) for s in starts[np.linspace(0, starts.size - 1, count).astype(int)]]
    return sorted({heaviest, *spread[: count - 1]})


def run_blocks(kernel, blocks: list[int], rows: int, n: int, threads: int) -> list[tuple]:
    """Each block of ``rows`` rows through ``kernel(r0, r1, scratch)``, ``threads`` at a time; outputs in order."""
    pool_scratch: Queue = Queue()
    for _ in range(threads):
        pool_scratch.put(kernel.scratch(n))

    def one(r0: int):
        scratch = pool_scratch.get()
        try:
            return kernel(r0, min(n, r0 + rows), scratch)
        finally:
            pool_scratch.put(scratch)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, blocks))


class OldRows:
    def __init__(self, module, base: sp.csr_matrix, rule: PruneRule):
        self.module, self.rule = module, rule
        self.arrays = (np.asarray(base.indptr, np.int64), np.asarray(base.indices, np.int32),
                       np.asarray(base.data, np.float32))

    @staticmethod
    def scratch(n: int) -> tuple:
        return np.zeros(n, np.float64), np.zeros(n, np.uint8), np.empty(n + 1, np.int32)

    def __call__(self, r0: int, r1: int, scratch: tuple) -> tuple:
        return self.module._square_rows(*self.arrays, r0, r1, self.rule.top_k or 0, self.rule.min_value, *scratch)


class NewRows:
    def __init__(self, base: sp.csr_matrix, rule: PruneRule):
        self.rule = rule
        self.layout = powers._SquareLayout.of(base, *powers._bounds_split(base.shape[0]))

    def scratch(self, n: int) -> tuple:
        return self.layout.scratch()

    def __call__(self, r0: int, r1: int, scratch: tuple) -> tuple:
        return self.layout.rows(r0, r1, self.rule, scratch)


def compare(old: list[tuple], new: list[tuple]) -> tuple[bool, float]:
    """(indices and values the same bytes, largest relative difference of the mass kept) over row kernel outputs
    (ptr, idx, val, kept, total) or square_blocks outputs (r0, block, frac)."""
    same, worst = True, 0.0
    for a, b in zip(old, new, strict=True):
        if len(a) == 3:
            same &= a[0] == b[0] and np.array_equal(a[1].indptr, b[1].indptr)
            same &= np.array_equal(a[1].indices, b[1].indices) and a[1].data.tobytes() == b[1].data.tobytes()
            fa, fb = a[2], b[2]
        else:
            same &= np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2].tobytes() == b[2].tobytes()
            same &= a[3].tobytes() == b[3].tobytes()
            with np.errstate(invalid="ignore", divide="ignore"):
                fa, fb = np.where(a[4] > 0, a[3] / a[4], 1.0), np.where(b[4] > 0, b[3] / b[4], 1.0)
        worst = max(worst, float(np.max(np.abs(fa - fb) / np.maximum(np.abs(fa), 1e-300), initial=0.0)))
    return bool(same), worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graph", type=Path, help="a built graph's folder")
    ap.add_argument("--blocks", type=int, default=0, help="blocks of 256 rows to time; 0: all rows (square_blocks)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each kernel per thread count (median)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the old kernel")
    args = ap.parse_args()
    rule = PruneRule(top_k=args.top_k)
    base = load_graph(args.graph).base
    n = base.shape[0]
    old_module = baseline_module(args.baseline)
    work = multiply_adds(base)
    print(f"Ã: {n:,} rows, {base.nnz:,} non-zeros; Ã² unpruned: {work.sum():,} multiply-adds")
    t = time.perf_counter()
    new_rows = NewRows(base, rule)
    layout_s = time.perf_counter() - t
    bounded = new_rows.layout.meta[powers._BOUNDED::powers._FIELDS].astype(bool)
    print(f"new layout: {layout_s:.2f} s (first call compiles), prefix {new_rows.layout.prefix} columns, groups of "
          f"{new_rows.layout.group}; bounded rows {bounded.sum():,} holding {work[bounded].sum() / work.sum():.1%} "
          f"of the multiply-adds")
    if args.blocks:
        blocks = sample_blocks(work, args.blocks, 256)
        share = sum(work[b:b + 256].sum() for b in blocks) / work.sum()
        print(f"{len(blocks)} blocks of 256 rows from row {blocks[0]} to {blocks[-1]}: {share:.1%} of the "
              f"multiply-adds")
        old_rows = OldRows(old_module, base, rule)
        kernels = {"old": lambda threads: run_blocks(old_rows, blocks, 256, n, threads),
                   "new": lambda threads: run_blocks(new_rows, blocks, 256, n, threads)}
    else:
        kernels = {name: (lambda threads, f=f: list(f(base, rule, workers=threads, progress=False)))
                   for name, f in (("old", old_module.square_blocks), ("new", powers.square_blocks))}
    tiny = powers.normalize(sp.random(300, 300, density=0.05, format="csr", random_state=0) * 9 + 0)
    for f in (old_module.square_blocks, powers.square_blocks):  # compile outside the timings
        list(f(tiny.astype(np.float32), rule, workers=1, progress=False))
    print(f"{'threads':>7} {'old s':>8} {'new s':>8} {'old/new':>8} {'runs':>5}  identical  frac max rel diff")
    for threads in (int(x) for x in args.threads.split(",")):
        times = {"old": [], "new": []}
        same, worst = True, 0.0
        for _ in range(args.repeat):
            outputs = {}
            for name in ("old", "new"):
                t = time.perf_counter()
                outputs[name] = kernels[name](threads)
                times[name].append(time.perf_counter() - t)
            ok, diff = compare(outputs["old"], outputs["new"])
            same, worst = same and ok, max(worst, diff)
        old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"{threads:>7} {old_s:>8.2f} {new_s:>8.2f} {old_s / new_s:>7.2f}x {args.repeat:>5}  {str(same):>9}  "
              f"{worst:.1e}", flush=True)


if __name__ == "__main__":
    main()
