"""Graph building at scale: prints tables, not a test.

    python3 benchmarks/build.py                                   # 0.5M documents of the synthetic corpus
    python3 benchmarks/build.py --docs 500000 1000000 2000000 4000000 --ray 500000 4000000   # the whole table

The corpus is the first shards of ``--corpus`` (``benchmarks/synth_corpus.py`` writes it: Parquet shards of 250,000
documents, column ``text``); each size builds ``graphmax build <shards> --tokenizer smollm2 --orders 1,2 --ngrams
3,4`` in a fresh subprocess, so that its peak RSS is its own. Beside each build, in the same run, two baselines
that read the same shards with the same reader (``gm_graphs.count.onepass.encoded_batches``), ids materialised, nothing
counted: the tokenizer alone (``BatchEncoder(tok, word_cache=False)``: the LM's fast tokenizer, ``encode_batch_fast``
on all cores) and graphmax's own encoder alone (``BatchEncoder``: the word cache of ``gm_graphs.tokenize.bytelevel``,
same ids).
Printed per size: tokens/s of each and the build's ratio to both, seconds per stage, CPU seconds (user/sys) of each
process, peak RSS, peak and final disk use of the graph folder and its temporary folders, distinct 2-/3-/4-grams,
and the load average while it ran (other jobs on the machine slow every stage). ``--ray`` sizes are also built
with ``--engine ray`` on a local Ray (``ray.init(num_cpus=2)``), or with ``--ray-nodes P`` on a local cluster of P
worker nodes, with the volume its shuffle moved, what 4, 16 and 64 nodes would move, and what reached the driver.
One build alone, its measurements as JSON: ``GRAPHMAX_BENCH_RAY_NODES=2 python3 benchmarks/build.py --child ray OUT
SHARD…``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = (500_000, 1_000_000, 2_000_000, 4_000_000)
NODES = (4, 16, 64)
NODES_VAR = "GRAPHMAX_BENCH_RAY_NODES"  # --ray-nodes, for the child processes


def _shards(corpus: Path, docs: int) -> list[str]:
    files = sorted(corpus.glob("part-*.parquet"))
    meta = corpus / "graphmax-synth.json"
    per = json.loads(meta.read_text())["shard_docs"] if meta.exists() else 250_000
    need = -(-docs // per)
    if need > len(files):
        raise SystemExit(f"{corpus} has {len(files)} shards of {per:,} documents, fewer than {docs:,} documents; "
                         f"write more with benchmarks/synth_corpus.py")
    return [str(f) for f in files[:need]]


class _Disk:
    """Peak bytes under the graph folder and its temporary siblings (``.<name>.tmp-*``), sampled every 0.5 s."""

    def __init__(self, target: Path):
        self.target, self.peak, self._stop = target, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def size(self) -> int:
        total = 0
        for entry in os.scandir(self.target.parent):
            if entry.name == self.target.name or entry.name.startswith(f".{self.target.name}.tmp-"):
                for folder, _, files in os.walk(entry.path):
                    for f in files:
                        try:
                            total += os.lstat(os.path.join(folder, f)).st_size
                        except FileNotFoundError:
                            pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, self.size())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.size())


def _child(job: str, files: list[str], out: str) -> dict:
    """One measurement in this (fresh) process."""
    sys.path.insert(0, str(REPO))
    from gm_graphs import build_graph, load_tokenizer
    from gm_graphs.build.ray_engine import RayOptions
    from gm_graphs.corpus.read import ReadStats
    from gm_graphs.count.onepass import encoded_batches
    from gm_graphs.tokenize.encoder import BatchEncoder

    load = [os.getloadavg()[0]]
    tok = load_tokenizer("smollm2")
    result: dict = {}
    if job in ("tokenizer", "encoder"):
        encoder = BatchEncoder(tok, word_cache=job == "encoder")
        tokens = 0
        t0 = time.perf_counter()
        for ids, _ in encoded_batches([Path(f) for f in files], encoder, "text", clean=False, batch_docs=2048,
                                      stats=ReadStats()):
            tokens += ids.size
        result = {"seconds": time.perf_counter() - t0, "tokens": tokens}
    else:
        target = Path(out)
        target.parent.mkdir(parents=True, exist_ok=True)
        ray = cluster = address = None
        nodes = int(os.environ.get(NODES_VAR, "0"))
        if job == "ray" and nodes:
            from ray.cluster_utils import Cluster

            # a head without CPUs and ``nodes`` worker nodes sharing this machine's cores: the driver is this
            # process, as on a cluster, and every task runs on a worker node
            cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, object_store_memory=2 << 30,
                                                                         include_dashboard=False))
            for _ in range(nodes):
                cluster.add_node(num_cpus=max(1, (os.cpu_count() or 2) // nodes), object_store_memory=2 << 30)
            cluster.wait_for_nodes()
            address = cluster.address
        elif job == "ray":
            import ray

            ray.init(address="local", num_cpus=2, object_store_memory=2 << 30, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        disk = _Disk(target)
        t0 = time.perf_counter()
        g = build_graph(files, tok, path=target, orders=(1, 2), ngrams=(3, 4), progress=False, overwrite=True,
                        engine="local" if job == "local" else "ray",
                        engine_options=None if job == "local" else RayOptions(address=address))
        seconds = time.perf_counter() - t0
        c, ng = g.manifest["corpus"], g.manifest["ngrams"]["orders"]
        result = {"seconds": seconds, "tokens": c["tokens"], "documents": c["documents"],
                  "distinct": {"2": c["distinct_bigrams"], "3": ng["3"]["entries"], "4": ng["4"]["entries"]},
                  "timings": g.timings, "peak_disk": disk.stop(), "final_disk": disk.size(),
                  "merged_bytes": 16 * (c["distinct_bigrams"] + ng["3"]["entries"] + ng["4"]["entries"])}
        merged = result["merged_bytes"]  # what a driver that receives every merged range receives
        result["received_bytes"] = g.timings.get("received_bytes", merged) if job == "ray" else 0
        result["read_back_bytes"] = g.timings.get("read_back_bytes", 0)
        if ray is not None:
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    load.append(os.getloadavg()[0])
    result["load"] = load
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["peak_rss_mb"] = usage.ru_maxrss / 1024
    result["cpu_s"] = {"user": usage.ru_utime, "sys": usage.ru_stime}  # this process (not Ray's workers)
    return result


def run(job: str, files: list[str], out: str) -> dict:
    cmd = [sys.executable, __file__, "--child", job, out, *files]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{job} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[4:], sys.argv[3])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path("/work/data/synth4m"),
                    help="folder of part-*.parquet shards (benchmarks/synth_corpus.py)")
    ap.add_argument("--docs", type=int, nargs="+", choices=SIZES, default=[SIZES[0]], help="corpus sizes to build")
    ap.add_argument("--ray", type=int, nargs="*", choices=SIZES, default=[],
                    help="sizes to build with --engine ray as well (needs pip install 'graphmax[ray]')")
    ap.add_argument("--ray-nodes", type=int, default=0,
                    help="build the --ray sizes on a local cluster of this many worker nodes (ray.cluster_utils."
                         "Cluster: a head without CPUs, the cores shared out) instead of one local Ray")
    ap.add_argument("--work", type=Path, default=None, help="where graphs are built (default: a temporary folder)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="move the largest size's local graph here instead of deleting it (a new folder, on the "
                         "file system of --work), e.g. to time load_graph on it")
    ap.add_argument("--bracket", action="store_true",
                    help="time the tokenizer alone again after each size's builds and compare the builds with the "
                         "mean of both runs (this machine's speed drifts by up to ±10 %% within minutes)")
    args = ap.parse_args()
    os.environ[NODES_VAR] = str(args.ray_nodes)
    if args.keep and args.keep.exists():
        ap.error(f"--keep {args.keep} exists; name a new folder")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        rows = []
        for docs in sorted(set(args.docs) | set(args.ray)):
            files = _shards(args.corpus, docs)
            jobs = ["local"] * (docs in args.docs) + ["ray"] * (docs in args.ray)
            tok = {job: run(job, files, "") for job in ("tokenizer", "encoder")}
            text = _text_bytes(files)
            builds = []
            for job in jobs:
                builds.append((job, run(job, files, str(Path(tmp) / f"g{docs}-{job}"))))
                if args.keep and job == "local" and docs == max(args.docs):
                    os.rename(Path(tmp) / f"g{docs}-{job}", args.keep)
                shutil.rmtree(Path(tmp) / f"g{docs}-{job}", ignore_errors=True)
            if args.bracket:
                tok = {job: _mean_of(tok[job], run(job, files, "")) for job in tok}
            for job, b in builds:
                b["text_bytes"] = text
                rows.append((docs, job, tok, b))
                _print_row(docs, job, tok, b)
        _print_tables(rows)


def _text_bytes(files: list[str]) -> int:
    """The UTF-8 bytes of the shards' ``text`` column (what the graph's size is measured against)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    return sum(pc.sum(pc.binary_length(pq.read_table(f, columns=["text"])["text"])).as_py() or 0 for f in files)


def _mean_of(before: dict, after: dict) -> dict:
    """A baseline timed before and after the builds, as one measurement: their mean."""
    return {"seconds": (before["seconds"] + after["seconds"]) / 2, "runs_s": [before["seconds"], after["seconds"]],
            "tokens": before["tokens"], "load": before["load"] + after["load"],
            "cpu_s": {k: (before["cpu_s"][k] + after["cpu_s"][k]) / 2 for k in before["cpu_s"]},
            "peak_rss_mb": max(before["peak_rss_mb"], after["peak_rss_mb"])}


def _cpu(job: dict) -> str:
    cpu = job.get("cpu_s")
    return f"{cpu['user']:.0f}/{cpu['sys']:.0f}" if cpu else "-"


def _print_row(docs: int, job: str, tok: dict, b: dict) -> None:
    print(f"# {docs:,} documents, {job}: {json.dumps({'tokenize': tok, 'build': b})}", flush=True)


def _print_tables(rows) -> None:
    print("\nthroughput and memory (tokens/s of the tokenizer alone, of graphmax's encoder alone and of the whole "
          "build, end to end; ratio: the build's tokens/s over the tokenizer's, and over the encoder's)")
    print(f"{'docs':>10} {'engine':<6} {'tokens':>12} {'tokenizer tok/s':>16} {'encoder tok/s':>14} "
          f"{'e2e tok/s':>11} {'ratio':>6} {'/ encoder':>9} {'e2e s':>7} {'CPU user/sys s':>15} "
          f"{'tokenizer CPU':>14} {'encoder CPU':>12} {'peak RSS MB':>12} {'peak disk GB':>13} "
          f"{'final disk GB':>14} {'load avg':>10}")
    for docs, job, tok, b in rows:
        t, e = tok["tokenizer"], tok["encoder"]
        t_rate, c_rate, e_rate = t["tokens"] / t["seconds"], e["tokens"] / e["seconds"], b["tokens"] / b["seconds"]
        loads = t["load"] + e["load"] + b["load"]
        print(f"{docs:>10,} {job:<6} {b['tokens']:>12,} {t_rate:>16,.0f} {c_rate:>14,.0f} {e_rate:>11,.0f} "
              f"{e_rate / t_rate:>6.2f} {e_rate / c_rate:>9.2f} {b['seconds']:>7.1f} {_cpu(b):>15} {_cpu(t):>14} "
              f"{_cpu(e):>12} {b['peak_rss_mb']:>12,.0f} {_gb(b['peak_disk']):>13} {_gb(b['final_disk']):>14} "
              f"{min(loads):>4.1f}-{max(loads):.1f}")
    for docs, job, tok, _ in rows:
        for name, base in tok.items():
            if "runs_s" in base and job == "local":
                print(f"{docs:>10,} {name} alone before / after the builds: {base['runs_s'][0]:.1f} / "
                      f"{base['runs_s'][1]:.1f} s (the ratios use their mean)")
    print("\nseconds per stage (Ã² and the n-gram merge run at the same time, on two threads)")
    print(f"{'docs':>10} {'engine':<6} {'tokenize+count':>15} {'encoder':>9} {'A, stats, Ã':>12} {'Ã²':>7} "
          f"{'n-grams':>8} {'write':>7} {'distinct 2-grams':>17} {'3-grams':>12} {'4-grams':>12}")
    for docs, job, tok, b in rows:
        t = b["timings"]
        count = t.get("count_pass_s", t.get("count_s", 0.0))
        write = t.get("hash_wait_s", 0.0) + t.get("commit_s", 0.0)
        d = b["distinct"]
        print(f"{docs:>10,} {job:<6} {count:>15.1f} {tok['encoder']['seconds']:>9.1f} {t.get('bigrams_s', 0):>12.1f} "
              f"{t.get('operators_s', 0):>7.1f} {t.get('ngrams_s', 0):>8.1f} {write:>7.1f} {d['2']:>17,} "
              f"{d['3']:>12,} {d['4']:>12,}")
    print("\ndisk against the corpus' UTF-8 text (issue 34's goals: final ≤ 1.5×, peak ≤ 3×): the graph folder, "
          "the peak of it and its staging folder during the build, the sorted runs written (compressed), and bytes "
          "per corpus token")
    print(f"{'docs':>10} {'engine':<6} {'text GB':>8} {'final GB':>9} {'final/text':>11} {'peak GB':>8} "
          f"{'peak/text':>10} {'runs GB':>8} {'final B/token':>14}")
    for docs, job, _, b in rows:
        text, runs = b["text_bytes"], b["timings"].get("run_bytes")  # Ray's runs are blocks in its object store
        print(f"{docs:>10,} {job:<6} {_gb(text):>8} {_gb(b['final_disk']):>9} {b['final_disk'] / text:>11.2f} "
              f"{_gb(b['peak_disk']):>8} {b['peak_disk'] / text:>10.2f} "
              f"{_gb(sum(runs.values())) if runs else '-':>8} {b['final_disk'] / b['tokens']:>14.2f}")
    ray_rows = [(docs, b) for docs, job, _, b in rows if job == "ray"]
    if ray_rows:
        print("\nRay shuffle: bytes of sorted counts the count tasks sent to the range merges (S), what one node of "
              "P would send to the others, S/P·(P−1)/P, the merged counts (F), what of them the driver received "
              "(R) and the bytes of laid-out ranges it read back from the shared folder (their indptr, B)")
        print(f"{'docs':>10} {'units':>6} {'S GB':>7} {'largest unit GB':>16} " +
              " ".join(f"{f'P={p} GB/node':>13}" for p in NODES) + f" {'F GB':>7} {'R GB':>7} {'B GB':>7}")
        for docs, b in ray_rows:
            sent = b["timings"]["sent_bytes"]
            s = sum(sent.values())
            print(f"{docs:>10,} {len(sent):>6} {_gb(s):>7} {_gb(max(sent.values())):>16} " +
                  " ".join(f"{_gb(s / p * (p - 1) / p):>13}" for p in NODES) +
                  f" {_gb(b['merged_bytes']):>7} {_gb(b['received_bytes']):>7} {_gb(b['read_back_bytes']):>7}")


if __name__ == "__main__":
    main()
