"""The Ray engine: the same graph as the local engine byte for byte, retried faults, clear failures.

Ray runs locally (``ray.init(num_cpus=2)``), started once for the test session. Tests that start Ray are marked
``ray``: they run as their own step (``python3 -m pytest -q -m ray``; Ray's processes take both cores of the machine
the main suite shares between its two workers). They are skipped where the ``ray`` extra is not installed
(``pip install 'graphmax[ray]'``, which setup.sh does).
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from gm_graphs import build_graph, bundled, load_graph
from gm_graphs.build import ray_engine
from gm_graphs.build.local import build_local
from gm_graphs.build.ray_engine import EngineError, RayOptions
from gm_graphs.errors import CorpusError, OptionError

from .helpers import assert_same_graph, graph_files, make_docs, processes_with_env, write_jsonl

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_local():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, object_store_memory=512 << 20, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.mark.ray
def test_drug_reviews_build_the_same_graph_on_ray(ray_local, smollm2_tokenizer, tmp_path):
    kw = dict(text_column="review", clean=True, orders=(1, 2), ngrams=(3, 4), progress=False)
    local = build_graph(bundled.drug_reviews_zip(), smollm2_tokenizer, path=tmp_path / "local", **kw)
    distributed = build_graph(bundled.drug_reviews_zip(), smollm2_tokenizer, path=tmp_path / "ray", engine="ray", **kw)
    assert_same_graph(local, distributed)
    assert distributed.manifest["corpus"]["documents"] == local.manifest["corpus"]["documents"] > 900


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[Path]:
    """One corpus in every format graphmax reads, with empty rows and documents of one token."""
    root = tmp_path_factory.mktemp("generated")
    docs = make_docs(400, seed=31)
    docs[7] = docs[90] = ""  # skipped and counted
    docs[8] = "film"
    pacsv.write_csv(pa.table({"text": docs[:100]}), root / "a.csv")
    write_jsonl(root / "b.jsonl", docs[100:200])
    (root / "c.txt").write_text("\n".join(docs[200:300]) + "\n")
    pq.write_table(pa.table({"text": docs[300:]}), root / "d.parquet", row_group_size=30)
    return [root / n for n in ("a.csv", "b.jsonl", "c.txt", "d.parquet")]


@pytest.mark.parametrize("bos_eos", [False, True])
@pytest.mark.ray
def test_generated_corpora_build_the_same_graph_on_ray(ray_local, generated, bpe_tokenizer, tmp_path, bos_eos):
    # tiny buffers: every unit sends many pieces to every range, and the local build merges many runs
    kw = dict(orders=(1, 2), ngrams=(3, 4), bos_eos=bos_eos, ngram_run_entries=97, batch_docs=13, progress=False)
    local = build_graph(generated, bpe_tokenizer, path=tmp_path / "local", **kw)
    distributed = build_graph(generated, bpe_tokenizer, path=tmp_path / "ray", engine="ray", **kw)
    assert_same_graph(local, distributed)
    assert distributed.timings["units"] == 4 and distributed.timings["ranges"] >= 8
    assert sum(distributed.timings["sent_bytes"].values()) > 0
    # the n-gram ranges were laid out by the merge tasks beside the graph, and left nothing there
    assert distributed.timings["laid_ranges"] > 0
    assert distributed.timings["received_bytes"] == 16 * distributed.manifest["corpus"]["distinct_bigrams"]
    assert not (tmp_path / "ray" / ".ranges").exists()


@pytest.mark.ray
def test_corpus_paths_are_recorded_as_given_like_the_local_engine(ray_local, generated, bpe_tokenizer, tmp_path,
                                                                 monkeypatch):
    """Relative paths stay relative in the manifest (the files' entries and the per-file counts), as the local
    engine records them, though the workers read them by their absolute paths."""
    monkeypatch.chdir(generated[0].parent)
    names = [p.name for p in generated]
    kw = dict(orders=(1,), ngrams=(3,), progress=False)
    local = build_graph(names, bpe_tokenizer, path=tmp_path / "local", **kw)
    distributed = build_graph(names, bpe_tokenizer, path=tmp_path / "ray", engine="ray", **kw)
    corpus = distributed.manifest["corpus"]
    assert [f["path"] for f in corpus["files"]] == names
    assert sorted(corpus["per_file"]) == sorted(names)
    assert_same_graph(local, distributed)


@pytest.mark.ray
def test_parquet_uris_are_read_by_ray_data(ray_local, generated, bpe_tokenizer, tmp_path):
    parquet = generated[3]
    kw = dict(orders=(1,), ngrams=(3,), progress=False)
    local = build_graph(parquet, bpe_tokenizer, path=tmp_path / "local", **kw)
    distributed = build_graph(parquet.resolve().as_uri(), bpe_tokenizer, path=tmp_path / "ray", engine="ray", **kw)
    a, b = graph_files(local.path), graph_files(distributed.path)
    assert [k for k in a if k != "manifest.json" and a[k] != b.get(k)] == []
    assert distributed.manifest["corpus"]["files"][0]["sha256"] == local.manifest["corpus"]["files"][0]["sha256"]


@pytest.mark.ray
def test_a_task_that_fails_once_is_retried_and_the_graph_is_exact(ray_local, generated, bpe_tokenizer, tmp_path,
                                                                   monkeypatch):
    kw = dict(orders=(1,), ngrams=(3,), progress=False)
    local = build_graph(generated, bpe_tokenizer, path=tmp_path / "local", **kw)
    monkeypatch.setenv("GRAPHMAX_FAULT", "count.batch:raise")
    monkeypatch.setenv("GRAPHMAX_FAULT_ONCE", str(tmp_path / "fired"))
    distributed = build_graph(generated, bpe_tokenizer, path=tmp_path / "ray", engine="ray", **kw)
    assert (tmp_path / "fired").exists()  # the fault did fire, in a worker
    assert_same_graph(local, distributed)


@pytest.mark.ray
def test_a_task_that_keeps_failing_names_its_block_and_writes_nothing(ray_local, generated, bpe_tokenizer, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("GRAPHMAX_FAULT", "count.batch:raise")
    with pytest.raises(EngineError) as failed:
        build_graph(generated[:1], bpe_tokenizer, path=tmp_path / "g", engine="ray", progress=False)
    message = str(failed.value)
    assert "\n" not in message and str(generated[0].resolve()) in message and "documents 0–" in message
    assert "failed 4 times" in message and "InjectedFault" in message
    assert sorted(os.listdir(tmp_path)) == []  # no graph, no staging folder, no lock


@pytest.mark.ray
def test_a_corpus_error_in_a_worker_stays_a_corpus_error(ray_local, generated, bpe_tokenizer, tmp_path):
    with pytest.raises(CorpusError, match="no column 'body'"):
        build_graph(generated[3:], bpe_tokenizer, path=tmp_path / "g", engine="ray", text_column="body",
                    progress=False)
    assert not (tmp_path / "g").exists()


def test_without_ray_the_error_names_the_extra(monkeypatch, csv_corpus, bpe_tokenizer, bpe_tokenizer_file, tmp_path,
                                              home, capsys):
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    path, _ = csv_corpus
    with pytest.raises(OptionError, match=r"graphmax\[ray\]"):
        build_graph(path, bpe_tokenizer, path=tmp_path / "g", engine="ray", progress=False)
    from pipelines.cli import main

    assert main(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "g", "--engine", "ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "graphmax[ray]" in err


@pytest.mark.ray
def test_an_unreachable_address_fails_in_one_line_within_30_s(csv_corpus, bpe_tokenizer_file, tmp_path):
    pytest.importorskip("ray")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path, _ = csv_corpus
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRAPHMAX_HOME": str(tmp_path / "home")}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "build", str(path), "--tokenizer",
                           str(bpe_tokenizer_file), "--name", "g", "--engine", "ray", "--ray-address",
                           f"127.0.0.1:{port}"], env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "cannot reach the Ray cluster" in lines[0] and f"127.0.0.1:{port}" in lines[0]
    assert seconds < 30
    assert not (tmp_path / "home" / "graphs" / "g").exists()


def _cli(args: list[str], home: Path, mark: str, *, code: str | None = None, timeout: float = 300,
         ray_address: str | None = None):
    """``graphmax ARGS`` in a fresh Python (no Ray in it yet), every process it starts marked with ``mark``;
    ``ray_address``: the environment's RAY_ADDRESS."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRAPHMAX_HOME": str(home), "GRAPHMAX_TEST_RUN": mark}
    for name in ("RAY_ADDRESS", "RAY_gcs_server_port_wait_time_s"):
        env.pop(name, None)
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    head = ["-c", code] if code else ["-m", "pipelines.cli"]
    return subprocess.run([sys.executable, *head, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.ray
def test_the_cli_starts_a_local_ray_for_the_whole_build_and_stops_all_of_it(csv_corpus, bpe_tokenizer_file,
                                                                              tmp_path):
    """Without --ray-address the build starts Ray on this machine, in a fresh process: Ray's head processes must
    outlive the call that started them, and none of Ray's processes outlive the command. A Ray of its own, even
    where RAY_ADDRESS names a cluster (here one that is gone, as /tmp/ray's record of a dead `ray start` would)."""
    pytest.importorskip("ray")
    path, _ = csv_corpus
    mark = os.urandom(8).hex()
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{s.getsockname()[1]}"
    proc = _cli(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "g", "--engine", "ray",
                 "--ngrams", "3"], tmp_path / "home", mark, ray_address=gone)
    left = processes_with_env("GRAPHMAX_TEST_RUN", mark)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""  # neither Ray's start nor Ray Data's plans on the console
    assert left == []
    local = build_graph(path, str(bpe_tokenizer_file), path=tmp_path / "local", ngrams=(3,), progress=False)
    assert_same_graph(local, load_graph(tmp_path / "home" / "graphs" / "g"))


@pytest.mark.ray
def test_a_local_ray_that_does_not_answer_fails_in_one_line_naming_the_timeout_and_leaves_no_process(
        csv_corpus, bpe_tokenizer_file, tmp_path):
    """The start's GCS server is stopped (SIGSTOP) as soon as it appears, so the start never answers."""
    pytest.importorskip("ray")
    path, _ = csv_corpus
    mark = os.urandom(8).hex()
    stopped: list[str] = []
    done = threading.Event()

    def stop_the_gcs() -> None:
        while not done.is_set() and not stopped:
            for line in processes_with_env("GRAPHMAX_TEST_RUN", mark):
                if "gcs_server" in line:
                    os.kill(int(line.split()[0]), signal.SIGSTOP)
                    stopped.append(line)
            time.sleep(0.02)

    watcher = threading.Thread(target=stop_the_gcs, daemon=True)
    watcher.start()
    code = ("import sys; from gm_graphs.build import ray_engine; ray_engine.START_TIMEOUT_S = 5; "
            "from pipelines.cli import main; sys.exit(main(sys.argv[1:]))")
    try:
        proc = _cli(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "g", "--engine", "ray"],
                    tmp_path / "home", mark, code=code, timeout=120)
    finally:
        done.set()
        watcher.join()
    left = processes_with_env("GRAPHMAX_TEST_RUN", mark)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert stopped  # the GCS server did start, and never answered
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "Ray did not start on this machine within 5 s" in lines[0] and "--ray-address" in lines[0]
    assert left == []
    assert not (tmp_path / "home" / "graphs" / "g").exists()


def test_ray_address_without_the_ray_engine_is_refused(csv_corpus, bpe_tokenizer_file, home, capsys):
    from pipelines.cli import main

    path, _ = csv_corpus
    assert main(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "g", "--ray-address",
                 "auto"]) == 2
    assert "--engine ray" in capsys.readouterr().err


def test_the_local_engine_takes_no_ray_options_and_the_ray_engine_only_its_own(csv_corpus, bpe_tokenizer, tmp_path):
    path, _ = csv_corpus
    assert "ray_options" not in inspect.signature(build_local).parameters
    with pytest.raises(OptionError, match=r"the local engine takes no engine options, got RayOptions\(address='auto'"):
        build_graph(path, bpe_tokenizer, path=tmp_path / "g", engine_options=RayOptions(address="auto"),
                    progress=False)
    with pytest.raises(OptionError, match="the ray engine's options are a RayOptions, got 'auto'"):
        build_graph(path, bpe_tokenizer, path=tmp_path / "g", engine="ray", engine_options="auto", progress=False)
    for bad, says in ((dict(address=""), "the Ray address is"), (dict(ranges=0), "ranges is an integer >= 1")):
        with pytest.raises(OptionError, match=says):
            RayOptions(**bad)
    assert not (tmp_path / "g").exists()


def test_the_clis_ray_address_reaches_the_ray_engines_connection(csv_corpus, bpe_tokenizer_file, home, monkeypatch,
                                                                  capsys):
    """Without starting Ray: the Ray engine is handed ``RayOptions(address=…)`` and joins the cluster it names."""
    from pipelines.cli import main

    asked = []

    def connect(ray, address):
        asked.append(address)
        raise EngineError("stopped where the build would join the cluster")

    monkeypatch.setattr(ray_engine, "import_ray", lambda: None)
    monkeypatch.setattr(ray_engine, "connect", connect)
    path, _ = csv_corpus
    assert main(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "g", "--engine", "ray",
                 "--ray-address", "10.0.0.1:6379"]) == 2
    assert "stopped where the build would join the cluster" in capsys.readouterr().err
    assert asked == ["10.0.0.1:6379"]
    assert main(["build", str(path), "--tokenizer", str(bpe_tokenizer_file), "--name", "g", "--engine", "ray"]) == 2
    assert asked == ["10.0.0.1:6379", None]  # no address: Ray is started here


def test_merged_rows_asked_for_out_of_order_raise_instead_of_coming_back_empty():
    """The merged rows arrive by order (2, 3, 4): asking for order 4 first would silently skip the 3-grams."""
    import numpy as np

    from gm_graphs.build.ray_engine import _Stream

    def row(order, key):
        return {"order": order, "meta": '{"sent": {}, "laid": null}', "keys": np.array([key], np.int64).tobytes(),
                "counts": np.array([1], np.int64).tobytes()}

    stream = _Stream([row(2, 5), row(3, 7), row(4, 9)])
    assert [k.tolist() for k, _ in stream.ranges(2)] == [[5]]
    with pytest.raises(AssertionError, match="order 4 asked for before order 3"):
        list(stream.ranges(4))
    assert [k.tolist() for k, _ in stream.ranges(3)] == [[7]]
    assert [k.tolist() for k, _ in stream.ranges(4)] == [[9]]


class _Cpus:
    """A stand-in for ``ray`` as the CPU watch sees it: the cluster's CPUs at each poll, the last one kept."""

    def __init__(self, *cpus: float):
        self.cpus = list(cpus)

    def cluster_resources(self) -> dict:
        return {"CPU": self.cpus.pop(0) if len(self.cpus) > 1 else self.cpus[0]}


@pytest.mark.parametrize("cpus, done_early, fires", [
    ((2, 1, 0), False, True),  # had CPUs, then none for the wait: the build thread is interrupted
    ((0,), False, False),  # never had any (an autoscaler's cluster starting from zero): waits as Ray does
    ((1, 0, 1), False, False),  # none at one look, then a node joined: the wait starts again
    ((1, 0), True, False),  # every range had come (done) before the wait ran out
])
def test_the_cpu_watch_interrupts_the_build_only_after_its_cpus_were_all_gone_for_the_wait(cpus, done_early,
                                                                                            fires):
    from gm_graphs.build.ray_engine import _CpuWatch, _NoCpus

    outcome: dict = {}

    def build() -> None:  # waits in Python, as Ray Data's iterator does for blocks
        watch = _CpuWatch(_Cpus(*cpus), wait_s=0.05, poll_s=0.01)
        outcome["watch"] = watch
        if done_early:
            watch.done()
        try:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                time.sleep(0.005)
            outcome["ended"] = "waited"
        except _NoCpus:
            outcome["ended"] = "interrupted"
        watch.done()

    thread = threading.Thread(target=build)
    thread.start()
    thread.join(5)
    assert outcome["ended"] == ("interrupted" if fires else "waited")
    assert outcome["watch"].fired is fires
    if fires:
        assert "none joined within 0.05 s" in str(outcome["watch"].error())
