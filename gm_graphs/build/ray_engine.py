"""The graph build on Ray Data (``build_graph(…, engine="ray")``, ``graphmax build … --engine ray``).

The same graph as the local engine, byte for byte (the manifest's ``build`` section aside), counted by a Ray
cluster's workers:

1. *units*: each corpus file is a unit, read in a worker by graphmax's own reader (every format it reads; the
   files must be where every node can read them, e.g. a shared file system). Object-store URIs of Parquet files
   (``s3://…``, ``gs://…``, any URI pyarrow's file systems open) go through Ray Data's ``read_parquet`` instead,
   a block at a time.
2. *count* (``map_batches``, a task per unit or block): tokenize, then count the windows of every order in
   buffers of ``run_entries``; each full buffer is sorted, packed (``gm_graphs.count.bigrams``) and cut at the range
   boundaries into rows (order, range, packed entries). Ranges split the leading token's ids so that each holds
   about as many windows (estimated from a sample of the corpus): a bigram range is a range of rows of A, an
   n-gram range a range of contexts.
3. *merge* (``groupby(order, range).map_groups``, sort-based so that ranges come out in order): each range's
   pieces are concatenated, sorted and summed into unique keys and counts.
4. *write*, here on the driver: the merged ranges stream, in order, into the local engine's writers
   (``gm_graphs.format.writer``): counts, stats, Ã, Ã² (by the fused kernel on this machine) and the n-gram tables, in
   a staging folder committed atomically (``gm_graphs.store.folders``). Where a merge task sees that staging folder
   (storage every node shares; a probe file with a token says so), it lays its n-gram range out there itself
   (``writer.write_range``) and sends the driver a few numbers instead of the range: the driver checks them and the
   kernel copies the files into the tables, so that the driver holds no range of the tables (the bulk of a graph).
   A merge task that does not see the folder sends its range, as every bigram range is sent.

A task that fails is retried by Ray (``TASK_RETRIES`` times); one that keeps failing ends the build with one line
naming the input block (file, and documents or rows), and the staging folder is removed.
"""

from __future__ import annotations

import _thread
import ctypes
import dataclasses
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from gm_graphs.build.graph_source import GraphSource, corpus_entry, opened_graph, write_graph_into
from gm_graphs.build.options import BuildOptions
from gm_graphs.corpus.read import (
    ReadStats,
    check_distinct,
    clean_review_text,
    expand_corpus,
    fingerprint,
    iter_documents,
)
from gm_graphs.corpus.readers.columns import arrow_text
from gm_graphs.count.bigrams import check_ids, count_bits, unpack
from gm_graphs.count.ngram_counts import check_orders
from gm_graphs.count.runs import SortedRuns, feeders
from gm_graphs.errors import CorpusError, GraphmaxError, OptionError
from gm_graphs.format.graph_files import (
    GRAPH,
)
from gm_graphs.format.writer import RANGE_PARTS, LaidOutRange, write_range
from gm_graphs.graph import Graph
from gm_graphs.store.faults import fault_point
from gm_graphs.store.folders import (
    check_replaceable,
    remove_tree,
    staged_folder,
)
from gm_graphs.tokenize.encoder import BatchEncoder, TokenizerIdentity, load_tokenizer

EXTRA = "pip install 'graphmax[ray]'  (Ray Data: ray[data]>=2.60,<3)"
TASK_RETRIES = 3  # attempts after the first, for a failing or dying task
CONNECT_TIMEOUT_S = 10.0  # to reach a cluster's address before Ray is asked to join it
INIT_TIMEOUT_S = 25.0  # for ray.init to return once the address answers
START_TIMEOUT_S = 60.0  # for a local Ray to start: gcs_server, raylet and agents, on a machine that may be busy
GCS_WAIT_VAR = "RAY_gcs_server_port_wait_time_s"  # Ray's own wait for its GCS server's port
STOP_GRACE_S = 5.0  # for a local Ray's processes to end after SIGTERM, before SIGKILL
# once every node with CPUs is gone, how long a build waits for one to join before it ends (an autoscaler takes
# minutes to replace a node; Ray alone would wait without end)
NO_CPU_WAIT_S = 300.0
# Ray's own warnings (no SIGTERM handler in a thread, token authentication on) are not the user's to act on: a
# command's output stays graphmax's lines, and its errors one line
_INIT = dict(log_to_driver=False, include_dashboard=False, configure_logging=True, logging_level=logging.ERROR)
_RUN_MARK = "GRAPHMAX_RAY_RUN"  # in the environment of every process of a Ray a build started
RAY_LOG = logging.getLogger("gm_graphs.ray")  # what Ray reports to the driver during a build
_MARK = "graphmax-block"  # tags a worker's error so the driver can find it in Ray's wrapping
# how Ray says that a node died under a task, or took with it objects it could not rebuild
_NODE_LOST = re.compile(r"NodeDiedError|ObjectLostError|ObjectReconstructionFailed\w*Error|OwnerDiedError|"
                        r"node it was running on is dead")
_STATS = 0  # the order of the rows that carry a unit's read statistics
_RANGES = ".ranges"  # in the staging folder: where merge tasks lay out n-gram ranges
_PROBE = "probe"  # in _RANGES: a token that a merge task must read there to lay out its range


class EngineError(GraphmaxError, RuntimeError):
    """The Ray engine cannot run (no cluster at the address) or an input block keeps failing."""


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """What only the Ray engine takes (``build_graph(…, engine="ray", engine_options=RayOptions(…))``), checked when
    the record is made; the options of the graph itself are :class:`~gm_graphs.build.options.BuildOptions`.

    Args:
        address (``str`` or ``None``, defaults to ``None``): the cluster: ``"auto"`` (the cluster of this node),
            ``"HOST:6379"``, or ``"ray://HOST:10001"`` (Ray Client); ``None``: the Ray already initialised in this
            process, else one started on this machine for the build and stopped after it.
        ranges (``int`` or ``None``, defaults to ``None``): the ranges of leading tokens the counts are merged in,
            a merge task each; ``None``: 16 per CPU of the cluster, from 64 to 1,024.

    Example::

        >>> RayOptions(address="auto").address
        'auto'
        >>> RayOptions(ranges=0)
        Traceback (most recent call last):
        ...
        gm_graphs.errors.OptionError: ranges is an integer >= 1 or None (16 per CPU of the cluster), got 0
    """

    address: str | None = None
    ranges: int | None = None

    def __post_init__(self) -> None:
        if self.address is not None and not (isinstance(self.address, str) and self.address.strip()):
            raise OptionError(f"the Ray address is 'auto', HOST:6379 or ray://HOST:10001 (or None: a local Ray), "
                              f"got {self.address!r}")
        if self.ranges is not None and not (isinstance(self.ranges, int) and not isinstance(self.ranges, bool)
                                            and self.ranges >= 1):
            raise OptionError(f"ranges is an integer >= 1 or None (16 per CPU of the cluster), got {self.ranges!r}")


def import_ray():
    """``ray`` with Ray Data, or an :class:`OptionError` that names the extra to install."""
    try:
        import ray
        import ray.data  # noqa: F401 - Ray without its data extra lacks it
    except ImportError:
        raise OptionError(f"--engine ray needs Ray Data, which is not installed; install it with {EXTRA}, "
                          f"or build with --engine local") from None
    return ray


# ---- connecting ---------------------------------------------------------------------------------------------------

def _host_port(address: str) -> tuple[str, int] | None:
    """The (host, port) an address names, for a quick reachability check; None for "auto" and the like."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\]\s/]+?)\]?:(\d+)", address.strip())
    return (m.group(1), int(m.group(2))) if m else None


def connect(ray, address: str | None) -> _Session:
    """Join the cluster at ``address`` (or the Ray already running in this process), or start Ray on this machine
    for the build; the session, to close when the build ends. Fails in one line, naming the time it waited, when
    nothing answers."""
    if ray.is_initialized():
        return _Session(ray, joined=False)
    if address is None:
        return _start_local(ray)
    hp = _host_port(address)
    if hp is not None:
        try:
            socket.create_connection(hp, timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise EngineError(f"cannot reach the Ray cluster at {address!r} ({e.strerror or e}); start it with "
                              f"`ray start --head` there, or check --ray-address (the head's host:port, "
                              f"e.g. 10.0.0.1:6379, or 'auto' on a cluster node)") from None
    done: dict[str, Any] = {}

    def init() -> None:
        try:
            ray.init(address=address, **_INIT)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done["error"] = e
        done["ok"] = True

    # joining starts no process, so the thread may end once it has joined
    thread = threading.Thread(target=init, daemon=True, name="graphmax-ray-init")
    thread.start()
    thread.join(INIT_TIMEOUT_S)
    if "ok" not in done:
        raise EngineError(f"the Ray cluster at {address!r} did not accept this driver within {INIT_TIMEOUT_S:.0f} s; "
                          f"check that it runs the same Ray version (2.60) and that the address is its head")
    if "error" in done:
        e = done["error"]
        raise EngineError(f"cannot join Ray at {address!r} ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                          f"check --ray-address") from None
    return _Session(ray, joined=True)


class _Session:
    """The Ray a build runs on. ``joined``: this build connected the driver (and so disconnects it); ``owner``
    is set when the build also started Ray: the thread that started it, which must outlive the build, and the
    mark its processes carry."""

    def __init__(self, ray, joined: bool, owner: _Owner | None = None):
        self.ray, self.joined, self.owner = ray, joined, owner
        self.errors = _RayErrorsLogged()

    def close(self) -> None:
        if self.joined:
            self.ray.shutdown()
        self.errors.restore()
        if self.owner is not None:
            self.owner.release()


class _RayErrorsLogged:
    """While a build runs, the error messages that Ray's listener thread prints on the driver's stdout (a
    ``(raylet) Task … failed … node … is dead`` paragraph for each task a lost node took, whatever
    ``log_to_driver`` says) go to the logger ``gm_graphs.ray`` (level INFO) instead: the build reports a lost node
    in its own one line. Ray looks its printer up in its module at each message, which is where this one goes."""

    def __init__(self):
        self._module = sys.modules.get("ray._private.worker")
        self._printer = getattr(self._module, "print_to_stdstream", None)
        if callable(self._printer):
            self._module.print_to_stdstream = self._route

    def _route(self, data, ignore_prefix):
        if isinstance(data, dict) and data.get("pid") == "raylet":
            for line in data.get("lines") or ():
                RAY_LOG.info("%s", line)
            return None
        return self._printer(data, ignore_prefix)

    def restore(self) -> None:
        if getattr(self._module, "print_to_stdstream", None) == self._route:
            self._module.print_to_stdstream = self._printer


class _Owner:
    """A thread that starts a local Ray and stays alive until the build ends. Ray ties the head's processes
    (gcs_server, raylet) to the thread that forks them (``PR_SET_PDEATHSIG``): started from a thread that then
    returned, they are killed at once and the driver waits for them in vain. Every process of that Ray inherits
    ``_RUN_MARK`` with a value of its own in its environment, which is how :meth:`release` finds the ones that
    outlive ``ray.shutdown()`` (workers and agents orphaned by their raylet)."""

    def __init__(self, ray):
        self.mark = f"{_RUN_MARK}={os.urandom(8).hex()}".encode()
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(ray,), daemon=True, name="graphmax-ray-head")

    def _run(self, ray) -> None:
        name, _, value = self.mark.decode().partition("=")
        env = {name: value}
        # Ray waits for its GCS server's port for 30 s in a call that holds the GIL, so that this thread's timeout
        # could not end the wait sooner: Ray is given the same time instead
        env.setdefault(GCS_WAIT_VAR, os.environ.get(GCS_WAIT_VAR, str(max(1, math.ceil(START_TIMEOUT_S)))))
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            # "local": a Ray of its own, as documented, never a cluster that RAY_ADDRESS or /tmp/ray's record of the
            # last `ray start` names (a record that outlived its cluster made every such build time out)
            ray.init(address="local", **_INIT)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self.ready.set()
        self.stop.wait()

    def release(self) -> None:
        """Let the thread end, and end the processes of this Ray still running: SIGTERM, then SIGKILL."""
        self.stop.set()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = _marked(self.mark)
            for pid in left:
                try:
                    os.kill(pid, sig)
                    os.kill(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + STOP_GRACE_S
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = [pid for pid in left if _alive(pid)]


def _start_local(ray) -> _Session:
    owner = _Owner(ray)
    t0 = time.monotonic()
    owner.thread.start()
    answered = owner.ready.wait(START_TIMEOUT_S)
    if not answered or (owner.error is not None and time.monotonic() - t0 >= START_TIMEOUT_S):
        owner.release()
        raise EngineError(f"Ray did not start on this machine within {START_TIMEOUT_S:g} s; check that "
                          f"`python -c 'import ray; ray.init()'` works here, or start Ray with `ray start --head` "
                          f"and pass --ray-address")
    if owner.error is not None:
        owner.release()
        e = owner.error
        raise EngineError(f"cannot start Ray on this machine ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                          f"check that `python -c 'import ray; ray.init()'` works here, or pass --ray-address") \
            from None
    return _Session(ray, joined=True, owner=owner)


def _marked(mark: bytes) -> list[int]:
    """The processes of this user whose environment holds ``mark`` (none where /proc is missing)."""
    pids = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as fh:
                    if mark in fh.read().split(b"\0"):
                        pids.append(int(name))
            except OSError:  # gone, or another user's
                continue
    return pids


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


# ---- what the workers run -----------------------------------------------------------------------------------------

_TOKENIZERS: dict[str, Any] = {}  # per worker process: the tokenizer of a build, by its object id


@dataclasses.dataclass
class CountSpec:
    """What every counting task needs (shipped with the task)."""

    tokenizer: Any  # an ObjectRef of the loaded tokenizer
    vocab_size: int
    orders: tuple[int, ...]  # 2 (the bigrams) and the n-gram orders
    bounds: list[int]  # leading-token ids where ranges start, after range 0
    text_column: str
    clean: bool
    bos_eos: bool
    batch_docs: int
    run_entries: int


def _encoder(spec: CountSpec) -> BatchEncoder:
    import ray

    key = spec.tokenizer.hex()
    if key not in _TOKENIZERS:
        _TOKENIZERS.clear()
        _TOKENIZERS[key] = BatchEncoder(ray.get(spec.tokenizer), add_bos_eos=spec.bos_eos)
    return _TOKENIZERS[key]


class _RangeRuns(SortedRuns):
    """The sorted runs of one order of one unit, each cut into its pieces by range instead of kept."""

    def __init__(self, pieces: _Pieces, order: int, inset: int):
        super().__init__(order, pieces.spec.vocab_size, pieces.spec.run_entries, inset=inset)
        self.pieces = pieces
        lead = np.uint64(self.vocab_size ** (order - 1))  # the packed entry where each range's leading token starts
        self.edges = np.array([(np.uint64(b) * lead) << np.uint64(self.bits) for b in pieces.spec.bounds],
                              dtype=np.uint64)

    def add_run(self, packed: np.ndarray, windows: int) -> None:
        self.windows += windows
        cuts = [0, *np.searchsorted(packed, self.edges).tolist(), packed.size]
        for r, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            if b > a:
                self.pieces.add_row(self.order, r, packed[a:b].tobytes(), "")


class _Pieces:
    """Counts the windows of every order of one unit as the local build does (``runs.feeders``) and turns each
    sorted run into (order, range) pieces."""

    def __init__(self, spec: CountSpec, unit: int):
        self.spec, self.unit = spec, unit
        self.runs = [_RangeRuns(self, order, 1 if spec.bos_eos and order > 2 else 0) for order in spec.orders]
        self.feed = feeders(self.runs)
        self.rows: dict[str, list] = {"order": [], "range": [], "unit": [], "data": [], "meta": []}

    def add(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        for f in self.feed:
            f.add(ids, offsets)

    def add_row(self, order: int, rng: int, data: bytes, meta: str) -> None:
        for key, value in (("order", order), ("range", rng), ("unit", self.unit), ("data", data), ("meta", meta)):
            self.rows[key].append(value)

    def ready(self) -> Iterator[pa.Table]:
        """The pieces made so far, as one table (so that they leave the task before it ends)."""
        if self.rows["order"]:
            table = pa.table({"order": pa.array(self.rows["order"], pa.int32()),
                              "range": pa.array(self.rows["range"], pa.int32()),
                              "unit": pa.array(self.rows["unit"], pa.int32()),
                              "data": pa.array(self.rows["data"], pa.large_binary()),
                              "meta": pa.array(self.rows["meta"], pa.large_string())})
            self.rows = {key: [] for key in self.rows}
            yield table

    def finish(self, stats: ReadStats, documents: int, tokens: int) -> Iterator[pa.Table]:
        for f in self.feed:
            f.release()
        meta = {"read": asdict(stats), "documents": documents, "tokens": tokens,
                "windows": {str(r.order): r.windows for r in self.runs}}
        self.add_row(_STATS, self.unit, b"", json.dumps(meta))
        yield from self.ready()


def _count_docs(spec: CountSpec, pieces: _Pieces, docs: list[str], where: str) -> int:
    """Encode and count one batch; an error names the block (``where``) for the driver."""
    try:
        fault_point("count.batch")
        ids, offsets = _encoder(spec).encode(docs)
        check_ids(ids, spec.vocab_size)
        pieces.add(ids, offsets)
    except Exception as e:
        raise RuntimeError(f"{_MARK}[{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}]") \
            from e
    return int(ids.size)


def count_unit(batch: pa.Table, spec: CountSpec) -> Iterator[pa.Table]:
    """A task: read one corpus file with graphmax's reader, tokenize and count it into pieces. The file is read by
    its absolute path (a worker's current folder is not the driver's) and named as given, as the local engine
    names it, in the statistics and the errors."""
    unit, path, given = int(batch["unit"][0].as_py()), batch["path"][0].as_py(), batch["given"][0].as_py()
    pieces = _Pieces(spec, unit)
    stats = ReadStats()
    documents = tokens = 0
    try:
        for docs in iter_documents([Path(path)], spec.text_column, clean=spec.clean, batch_docs=spec.batch_docs,
                                   stats=stats):
            tokens += _count_docs(spec, pieces, docs, f"{given}, documents {documents:,}–{documents + len(docs):,}")
            documents += len(docs)
            yield from pieces.ready()
    except CorpusError:
        if documents or path not in stats.per_file:  # only "no documents at all" is for the driver to judge
            raise
    stats.per_file = {given if name == path else name: n for name, n in stats.per_file.items()}
    stats.skipped_members = [given + m[len(path):] if m.startswith(path + "!") else m for m in stats.skipped_members]
    yield from pieces.finish(stats, documents, tokens)


def count_arrow(batch: pa.Table, spec: CountSpec, unit: int) -> Iterator[pa.Table]:
    """A task: count one block of Ray Data's Parquet reader (column ``text`` and the file's ``path``)."""
    stats = ReadStats()
    pieces = _Pieces(spec, unit)
    paths = batch["path"].to_pylist()
    documents = tokens = 0
    column = batch[spec.text_column].combine_chunks()
    for start in range(0, len(column), spec.batch_docs):
        rows = arrow_text(column.slice(start, spec.batch_docs), stats)
        docs = [d for d in rows if d and not d.isspace()]
        stats.empty_skipped += len(rows) - len(docs)
        if spec.clean:
            docs = [clean_review_text(d) for d in docs]
        for p, d in zip(paths[start:start + spec.batch_docs], rows):
            if d and not d.isspace():
                stats.per_file[p] = stats.per_file.get(p, 0) + 1
        stats.documents += len(docs)
        if docs:
            tokens += _count_docs(spec, pieces, docs, f"{paths[start]}, a block of {len(column):,} rows")
            documents += len(docs)
            yield from pieces.ready()
    yield from pieces.finish(stats, documents, tokens)


def _sees(stage: tuple[str, str] | None) -> bool:
    """Whether this task sees the driver's staging folder: its probe holds the build's token."""
    if stage is None:
        return False
    try:
        return (Path(stage[0]) / _PROBE).read_text() == stage[1]
    except (OSError, UnicodeDecodeError):
        return False


def merge_range(group: pa.Table, vocab_size: int, stage: tuple[str, str] | None = None) -> pa.Table:
    """A task: the pieces of one (order, range) merged into unique keys and counts (int64); the rows carrying
    read statistics pass through. ``meta`` says how many bytes of pieces each unit sent here (``sent``) and, for
    an n-gram range laid out in ``stage`` (the ranges' folder and the build's token), what ``write_range`` reported
    (``laid``): its keys and counts are then empty."""
    fault_point("merge.range")
    order, rng = int(group["order"][0].as_py()), int(group["range"][0].as_py())
    if order == _STATS:
        empty = pa.array([b""] * group.num_rows, pa.large_binary())
        return group.select(["order", "range", "unit", "meta"]).append_column("keys", empty).append_column(
            "counts", empty)
    datas = group["data"].to_pylist()
    packed = np.concatenate([np.frombuffer(d, dtype=np.uint64) for d in datas])
    packed.sort()
    keys, counts = unpack(packed, count_bits(order, vocab_size))
    sent: dict[int, int] = {}
    for u, d in zip(group["unit"].to_pylist(), datas):
        sent[u] = sent.get(u, 0) + len(d)
    laid = None
    if order > 2 and _sees(stage):
        laid = write_range(Path(stage[0]), order, rng, vocab_size, keys, counts)
        keys, counts = keys[:0], counts[:0]
    return pa.table({"order": pa.array([order], pa.int32()), "range": pa.array([rng], pa.int32()),
                     "unit": pa.array([-1], pa.int32()),
                     "meta": pa.array([json.dumps({"sent": sent, "laid": laid})], pa.large_string()),
                     "keys": pa.array([keys.tobytes()], pa.large_binary()),
                     "counts": pa.array([counts.tobytes()], pa.large_binary())})


# ---- the driver ---------------------------------------------------------------------------------------------------

def _is_uri(spec) -> bool:
    return isinstance(spec, str) and "://" in spec


def _read_stats(parts: list[dict]) -> dict:
    """The units' read statistics added up in unit order, as one ReadStats would have counted them."""
    out = asdict(ReadStats())
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                out[key].update(value)
            elif isinstance(value, list):
                out[key].extend(value)
            else:
                out[key] += value
    return out


def _bounds(sample: list[str], encoder: BatchEncoder, ranges: int) -> list[int]:
    """Leading-token ids where ranges 1… start: quantiles of the token frequencies of a sample of the corpus
    (every id keeps a little mass, so that ids the sample lacks still spread over the ranges)."""
    n = encoder.vocab_size
    ids, _ = encoder.encode(sample) if sample else (np.zeros(0, np.int32), None)
    freq = np.bincount(ids, minlength=n).astype(np.float64) + max(1.0, ids.size / n) * 1e-2
    cum = np.cumsum(freq) / freq.sum()
    cuts = np.searchsorted(cum, np.arange(1, ranges) / ranges, side="right")
    return sorted({int(c) for c in cuts if 0 < c < n})


def _sample(files: list[Path], uris: list[str], spec_read: dict, ray, limit: int) -> list[str]:
    if files:
        docs: list[str] = []
        for batch in iter_documents(files[:1], spec_read["text_column"], clean=spec_read["clean"],
                                    batch_docs=min(limit, 4096), stats=ReadStats()):
            docs.extend(batch)
            if len(docs) >= limit:
                break
        return docs[:limit]
    # select_columns is pushed down into the Parquet read (read_parquet's columns= is deprecated in Ray 2.60)
    table = ray.data.read_parquet(uris[:1]).select_columns([spec_read["text_column"]]).limit(limit).to_arrow_refs()
    rows = pa.concat_tables(ray.get(table)).column(0).to_pylist() if table else []
    return [clean_review_text(d) if spec_read["clean"] else d for d in rows if d and not d.isspace()]


def _uri_fingerprint(uri: str) -> dict:
    """Path, size and SHA-256 of an object-store file, streamed through the hash where the task runs."""
    import hashlib

    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(uri)
    h = hashlib.sha256()
    size = 0
    with fs.open_input_stream(path) as fh:
        while True:
            block = fh.read(1 << 22)
            if not block:
                break
            h.update(block)
            size += len(block)
    return {"path": uri, "bytes": size, "sha256": h.hexdigest()}


def _block_error(e: BaseException) -> GraphmaxError:
    """One line for a failure that Ray reports wrapped in its own exceptions."""
    text = str(e)
    m = re.search(re.escape(_MARK) + r"\[(.*?)\]", text)
    if m is None:
        first = next((line for line in text.splitlines() if line.strip()), type(e).__name__)
        lost = _NODE_LOST.search(text)
        if lost:
            what = lost.group(0) if lost.group(0).endswith("Error") else "NodeDiedError"
            node = re.search(r"node ID: ([0-9a-f]{12})", text)
            return EngineError(f"a Ray node was lost during the build and Ray could not redo its work ({what}"
                               f"{f', node {node.group(1)}…' if node else ''}); nothing was written: check the "
                               f"cluster's nodes (`ray status`) and build again")
        return EngineError(f"the Ray build failed ({type(e).__name__}: {first.strip()[:200]}); nothing was written")
    where, _, cause = m.group(1).partition(": ")
    kind = CorpusError if cause.startswith("CorpusError") else EngineError
    return kind(f"the input block {where} failed {TASK_RETRIES + 1} times ({cause}); nothing was written: fix or "
                f"remove that input and build again")


class _NoCpus(BaseException):
    """Raised in the build's thread by :class:`_CpuWatch` (a BaseException, as KeyboardInterrupt is, so that Ray
    Data's iterator shuts its executor down on the way out and no ``except Exception`` holds it)."""


class _CpuWatch:
    """Ends a build that waits for CPUs in vain. Ray waits without end for a node to run a task (an autoscaler may
    add one): with every worker node lost and none joining, a build waited for ever. Once the cluster, which had
    CPUs, has had none for ``wait_s`` while the merged ranges still have to come, the build's thread is
    interrupted: the main thread as by Ctrl-C (``KeyboardInterrupt``, which Ray's waits heed), another thread by
    :class:`_NoCpus` raised in it at its next Python line (Ray Data's wait for blocks polls). :meth:`done` ends
    the watch, under the lock that an interruption takes, so that none comes after the ranges have all come."""

    def __init__(self, ray, wait_s: float, poll_s: float = 1.0):
        self.ray, self.wait_s, self.poll_s = ray, wait_s, poll_s
        self.target = threading.current_thread()
        self.fired = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="graphmax-ray-cpus")
        self._thread.start()

    def _cpus(self) -> float | None:
        try:
            return float(self.ray.cluster_resources().get("CPU", 0))
        except Exception:  # noqa: BLE001 - Ray going down with the build: nothing to watch
            return None

    def _watch(self) -> None:
        seen, since = False, None
        while not self._stop.wait(self.poll_s):
            cpus = self._cpus()
            if cpus is None or cpus > 0:
                seen, since = seen or cpus is not None, None
                continue
            since = time.monotonic() if since is None else since
            if seen and time.monotonic() - since >= self.wait_s:
                with self._lock:
                    if not self._stop.is_set():
                        self.fired = True
                        self._interrupt()
                return

    def _interrupt(self) -> None:
        if self.target is threading.main_thread():
            _thread.interrupt_main()
        else:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.target.ident), ctypes.py_object(_NoCpus))

    def done(self) -> None:
        with self._lock:
            self._stop.set()

    def error(self) -> EngineError:
        return EngineError(f"every Ray node with CPUs was lost during the build and none joined within "
                           f"{self.wait_s:g} s; nothing was written: add nodes to the cluster (`ray status` shows "
                           f"them) and build again")


class _Stream:
    """The merged rows, in (order, range) order, handed out order by order."""

    def __init__(self, rows, folder: Path | None = None, watch: _CpuWatch | None = None):
        self._rows = iter(rows)
        self._watch = watch
        self._next = self._pull()
        self.folder = folder  # where merge tasks lay out n-gram ranges
        self.sent: dict[int, int] = {}  # bytes of pieces each unit sent to the merges
        self.received = 0  # bytes of merged keys and counts that came to the driver
        self.read_back = 0  # bytes of laid-out ranges' files the driver read (their indptr)
        self.laid = 0  # ranges laid out by the merge tasks

    def _pull(self):
        row = next(self._rows, None)
        if row is None and self._watch is not None:
            self._watch.done()  # every range has come: no more CPUs are needed
        return row

    def take(self, order: int):
        if self._next is not None and self._next["order"] < order:  # the rows of a lower order would be skipped
            raise AssertionError(f"order {order} asked for before order {self._next['order']}: the merged rows "
                                 f"come in ascending order")
        while self._next is not None and self._next["order"] == order:
            yield self._next
            self._next = self._pull()

    def ranges(self, order: int):
        for row in self.take(order):
            meta = json.loads(row["meta"])
            for unit, size in meta["sent"].items():
                self.sent[int(unit)] = self.sent.get(int(unit), 0) + size
            if meta["laid"] is not None:
                laid = LaidOutRange(self.folder, meta["laid"])
                yield laid
                self.read_back += laid.read_back
                self.laid += 1
                for part in RANGE_PARTS:  # in the table now: the disk holds each range once, not twice
                    laid.path(part).unlink(missing_ok=True)
                continue
            self.received += len(row["keys"]) + len(row["counts"])
            yield np.frombuffer(row["keys"], dtype=np.int64), np.frombuffer(row["counts"], dtype=np.int64)


def build_on_ray(corpus, tokenizer, target: Path, options: BuildOptions, ray_options: RayOptions, *, overwrite: bool,
                 progress: bool) -> Graph:
    """``build_graph(engine="ray", engine_options=ray_options)``; see the module's docstring."""
    text_column, clean, bos_eos, batch_docs = options.text_column, options.clean, options.bos_eos, options.batch_docs
    ray = import_ray()
    tok = load_tokenizer(tokenizer)
    ident = TokenizerIdentity.of(tok)
    ngrams = check_orders(options.ngrams, ident.vocab_size) if options.ngrams else ()
    specs = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    uris = [s for s in specs if _is_uri(s)]
    local = [s for s in specs if not _is_uri(s)]
    if uris and local:
        raise OptionError("give either local corpus files or object-store URIs, not both in one build")
    if uris and any(not u.lower().endswith((".parquet", ".pq")) for u in uris):
        raise OptionError(f"object-store inputs are read by Ray Data's Parquet reader: give .parquet URIs, got "
                          f"{next(u for u in uris if not u.lower().endswith(('.parquet', '.pq')))!r}")
    files = expand_corpus(local) if local else []
    if not options.allow_duplicate_files:
        check_distinct(files)
    check_replaceable(target, overwrite, GRAPH)
    session = connect(ray, ray_options.address)
    watch = None
    timings: dict = {}
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.shuffle_strategy, ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    # Ray Data's console lines (each plan, a failed task's traceback) stay in its log in Ray's session folder: on
    # the console a build says what graphmax says, and an error is one line
    console = [h for h in logging.getLogger("ray.data").handlers if isinstance(h, logging.StreamHandler)]
    levels = [h.level for h in console]
    for h in console:
        h.setLevel(logging.CRITICAL + 1)
    try:
        with staged_folder(target, overwrite=overwrite, artefact=GRAPH) as tmp:
            fault_point("build.started")
            t0 = time.perf_counter()
            encoder = BatchEncoder(tok, add_bos_eos=bos_eos)
            read = {"text_column": text_column, "clean": clean}
            cpus = int(ray.cluster_resources().get("CPU", 1))
            # small merges: a range is ~1/64 of the counts
            n_ranges = ray_options.ranges or min(1024, max(64, 16 * cpus))
            spec = CountSpec(ray.put(tok), ident.vocab_size, (2, *ngrams),
                             _bounds(_sample(files, uris, read, ray, 4 * batch_docs), encoder, n_ranges),
                             text_column, clean, bos_eos, batch_docs, options.ngram_run_entries)
            folder = tmp / _RANGES
            folder.mkdir()
            token = os.urandom(16).hex()
            (folder / _PROBE).write_text(token)
            try:
                watch = _CpuWatch(ray, NO_CPU_WAIT_S)
                stream, file_entries = _run(ray, spec, files, uris, (str(folder.resolve()), token), watch)
                meta = [json.loads(r["meta"]) for r in stream.take(_STATS)]
                timings["count_s"] = time.perf_counter() - t0  # the first merged rows: every count has finished
                documents = sum(m["documents"] for m in meta)
                if documents == 0:
                    raise CorpusError(f"the corpus has no documents: every row of {[str(s) for s in specs]} was "
                                      f"empty (text column {text_column!r}); check the files and --text-column")
                fault_point("build.counted")
                if ngrams:
                    fault_point("build.ngrams_counted")
                entry = corpus_entry(file_entries, _read_stats([m["read"] for m in meta]), options.counting, documents,
                                     sum(m["tokens"] for m in meta))
                source = {"corpus": [str(f) for f in (files or uris)], "clean": clean,
                          "text_column": text_column} if ngrams else None
                src = GraphSource(ident, entry, lambda: stream.ranges(2),
                                  {o: (sum(m["windows"][str(o)] for m in meta), lambda o=o: stream.ranges(o))
                                   for o in ngrams}, source,
                                  {"engine": "ray"}, timings)
                write_graph_into(tmp, src, name=target.name, options=options, progress=progress)
                remove_tree(folder)  # the laid-out ranges are in the tables now
            except GraphmaxError:
                raise
            except Exception as e:
                if type(e).__module__.startswith("ray") or _MARK in str(e):
                    raise _block_error(e) from None
                raise
            timings.update(ranges=n_ranges, units=len(meta), sent_bytes=stream.sent, received_bytes=stream.received,
                           read_back_bytes=stream.read_back, laid_ranges=stream.laid, wall_s=time.perf_counter() - t0)
    except (_NoCpus, KeyboardInterrupt):
        if watch is None or not watch.fired:
            raise  # the user's Ctrl-C
        raise watch.error() from None
    finally:
        if watch is not None:
            watch.done()
        ctx.shuffle_strategy, ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
        for h, level in zip(console, levels):
            h.setLevel(level)
        session.close()
    return opened_graph(target, timings)


def _run(ray, spec: CountSpec, files: list[Path], uris: list[str], stage: tuple[str, str], watch: _CpuWatch):
    """Plan and start the count and merge (n-gram ranges laid out in ``stage`` where a merge task sees it); the
    merged rows as a stream (which ends ``watch`` when the last has come), and the inputs' manifest entries."""
    from ray.data.context import DataContext, ShuffleStrategy

    env = {k: v for k, v in os.environ.items() if k.startswith("GRAPHMAX_FAULT")}  # fault tests reach the workers
    task: dict[str, Any] = {"max_retries": TASK_RETRIES, "retry_exceptions": True}
    if env:
        task["runtime_env"] = {"env_vars": env}
    ctx = DataContext.get_current()
    ctx.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED  # ranges come out of the merge in order
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # max_retries and retry_exceptions as ray_remote_args: deprecated in 2.60
        if files:
            units = ray.data.from_items([{"unit": i, "path": str(f.resolve()), "given": str(f)}
                                         for i, f in enumerate(files)],
                                        override_num_blocks=len(files))
            counted = units.map_batches(count_unit, batch_size=1, batch_format="pyarrow", fn_kwargs={"spec": spec},
                                        **task)
            entries = fingerprint(files)
        else:
            blocks = ray.data.read_parquet(uris, include_paths=True).select_columns([spec.text_column, "path"])
            counted = blocks.map_batches(_count_arrow_block, batch_size=None, batch_format="pyarrow",
                                         fn_kwargs={"spec": spec}, **task)
            remote = ray.remote(max_retries=TASK_RETRIES, retry_exceptions=True)(_uri_fingerprint)
            entries = ray.get([remote.remote(u) for u in uris])
        merged = counted.groupby(["order", "range"]).map_groups(
            merge_range, batch_format="pyarrow", fn_kwargs={"vocab_size": spec.vocab_size, "stage": stage}, **task)
    return _Stream(merged.iter_rows(), Path(stage[0]), watch), entries


def _count_arrow_block(batch: pa.Table, spec: CountSpec) -> Iterator[pa.Table]:
    # a block's id (for its statistics row and the shuffle accounting): a checksum of where it starts
    first = f"{batch['path'][0].as_py()}|{batch.num_rows}|{batch[spec.text_column][0].as_py()}" if batch.num_rows \
        else ""
    yield from count_arrow(batch, spec, zlib.crc32(first.encode("utf-8", "replace")) >> 1)
