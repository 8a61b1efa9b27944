"""The Ray engine on a cluster of three nodes on this machine (``ray.cluster_utils.Cluster``, as Ray's own tests
do): a head with no CPUs, so that every task runs on one of two worker nodes of one CPU each. One cluster serves
the module; a test that removes a worker node adds a fresh one after it.

- the graph is the local engine's, byte for byte;
- a worker node removed while the units are counted, or while the ranges are merged: the build completes with the
  exact graph (Ray re-runs the tasks and rebuilds lost blocks from their lineage) or ends in one line saying that a
  node was lost, and the graph that was there before is intact either way;
- the driver killed (SIGKILL) mid-build: no graph, and the next build of that name succeeds.

Fault points (``GRAPHMAX_FAULT_LOG``, which the engine hands on to the workers) say when the build reaches a phase:
a thread removes the node as soon as the log shows it.

The module takes about a minute on 2 cores, so it is deselected by default (``-m 'not cluster'`` in pyproject.toml):
``python -m pytest tests/test_ray_cluster.py -m cluster -n 0`` runs it (in one process: the module shares one
cluster, and two workers would start two on two cores).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gm_graphs import build_graph
from gm_graphs.build import ray_engine
from gm_graphs.build.ray_engine import EngineError, RayOptions

from .helpers import REPO, assert_same_graph, graph_files, make_docs, write_jsonl

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from ray.cluster_utils import Cluster  # noqa: E402 - only where Ray is installed

pytestmark = pytest.mark.cluster

STORE = 80 << 20  # a small object store per node (Ray's least is 75 MiB)
KW = dict(ngrams=(3,), batch_docs=100, progress=False)  # several batches per unit: a unit's task takes a while
# Ray's health checks, quickened so that a removed node is declared dead in about 2 s instead of about 15
HEALTH = {"health_check_initial_delay_ms": 500, "health_check_period_ms": 500, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():  # another module's local Ray: a build joins the cluster only from a fresh driver
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, object_store_memory=STORE,
                                                         include_dashboard=False, _system_config=HEALTH))
    try:
        for _ in range(2):
            c.add_node(num_cpus=1, object_store_memory=STORE)
        c.wait_for_nodes()
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


@pytest.fixture()
def two_workers(cluster):
    """The cluster with two worker nodes; after the test, a fresh node for each one it removed."""
    yield cluster
    while len(cluster.worker_nodes) < 2:
        cluster.add_node(num_cpus=1, object_store_memory=STORE)
    cluster.wait_for_nodes()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("cluster-corpus")
    for i in range(4):
        write_jsonl(root / f"part-{i}.jsonl", make_docs(800, seed=40 + i))
    return sorted(root.glob("*.jsonl"))


@pytest.fixture(scope="module")
def local_graph(corpus, bpe_tokenizer_file, tmp_path_factory):
    return build_graph(corpus, str(bpe_tokenizer_file), path=tmp_path_factory.mktemp("local") / "g", **KW)


def _log(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


# a line of the driver's Ray listener, which printed a "(raylet) Task … failed … node … is dead" paragraph per task
# a lost node took: it starts with the prefix (the nodes' own raylets, this test's children, log to its stderr with
# a time stamp first, as they would on their own machines)
RAY_LINE = re.compile(r"(\x1b\[\d+m)?\(raylet\)")


def _assert_no_ray_lines(capfd) -> None:
    out, err = capfd.readouterr()
    printed = [line for line in (out + err).splitlines() if RAY_LINE.match(line)]
    assert not printed, printed[:3]
    sys.stdout.write(out)  # the build's own lines stay in the test's output


def _build_removing_workers(cluster, points: Path, phase: str, every: bool, target: Path, corpus, tokenizer,
                            join: bool = True):
    """Build ``corpus`` into ``target`` on ``cluster`` in a thread while this thread removes a worker node
    (``every``: all of them, then, if ``join``, adds a fresh one, which Ray starts only from the main thread) as
    soon as the fault log ``points`` shows ``phase``. Returns the graph or the exception, and the fault points seen
    when the nodes were removed (None if the build never reached ``phase``)."""
    result: dict = {}

    def build() -> None:
        try:
            result["graph"] = build_graph(corpus, tokenizer, path=target, overwrite=True, engine="ray",
                                          engine_options=RayOptions(address=cluster.address), **KW)
        except Exception as e:  # noqa: BLE001 - the caller checks which outcome
            result["error"] = e

    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    seen = None
    while builder.is_alive():
        log = _log(points)
        if phase in log:
            seen = log
            for node in list(cluster.worker_nodes)[:None if every else 1]:
                cluster.remove_node(node, allow_graceful=False)
            if every and join:
                cluster.add_node(num_cpus=1, object_store_memory=STORE)
            break
        time.sleep(0.01)
    builder.join(timeout=300)
    assert not builder.is_alive(), "the build still ran 300 s after the nodes were removed"
    return result.get("graph"), result.get("error"), seen


def test_a_two_node_cluster_builds_the_local_graph_byte_for_byte(cluster, corpus, local_graph, bpe_tokenizer_file,
                                                                 tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHMAX_FAULT_LOG", str(tmp_path / "points"))
    distributed = build_graph(corpus, str(bpe_tokenizer_file), path=tmp_path / "g", engine="ray",
                              engine_options=RayOptions(address=cluster.address), **KW)
    assert not ray.is_initialized()  # the build joined the cluster, and left it
    assert_same_graph(local_graph, distributed)
    assert _log(tmp_path / "points").count("count.batch") >= 4 * 8  # every unit counted, batch by batch
    assert distributed.timings["units"] == 4


@pytest.mark.parametrize("phase, every", [("count.batch", False), ("merge.range", False), ("count.batch", True)])
def test_a_worker_node_removed_mid_build_gives_the_exact_graph_or_one_line_and_the_old_graph(
        two_workers, corpus, local_graph, bpe_tokenizer_file, tmp_path, monkeypatch, capfd, phase, every):
    """``every``: all worker nodes go at once and a fresh one joins: every running task and every object the
    workers held is lost."""
    cluster = two_workers
    target = tmp_path / "graphs" / "g"
    old = build_graph(corpus[:1], str(bpe_tokenizer_file), path=target, **KW)  # the graph the build replaces
    before = graph_files(old.path)
    points = tmp_path / "points"
    monkeypatch.setenv("GRAPHMAX_FAULT_LOG", str(points))
    distributed, outcome, at = _build_removing_workers(cluster, points, phase, every, target, corpus,
                                                       str(bpe_tokenizer_file))
    log = _log(points)
    assert at is not None, f"the build never reached {phase}"
    _assert_no_ray_lines(capfd)
    # the node went while the build was in that phase: before the graph was committed, and (while counting)
    # before any range was merged
    assert not any(p.startswith(("stage.filled", "commit.")) for p in at)
    if phase == "count.batch":
        assert "merge.range" not in at
    redone = {p: log.count(p) for p in ("count.batch", "merge.range")}
    what = f"{phase}{', every node' if every else ''}"
    print(f"\n[{what}] removed after {len(at)} fault points ({at.count('count.batch')} count batches, "
          f"{at.count('merge.range')} merges); in all {redone}; outcome: "
          f"{'the exact graph' if outcome is None else repr(str(outcome))}")
    assert sorted(p.name for p in target.parent.iterdir()) == ["g"]  # no staging folder, no lock
    if outcome is None:
        assert_same_graph(local_graph, distributed)
        print(f"[{what}] {sum(len(b) for b in graph_files(target).values()):,} bytes compared with the local build")
    else:
        message = str(outcome)
        assert "\n" not in message and "a Ray node was lost" in message and "nothing was written" in message
        assert graph_files(target) == before


@pytest.mark.parametrize("case, setting, join, expected", [
    ("no retries", ("TASK_RETRIES", 0), True, "a Ray node was lost"),
    ("none joining", ("NO_CPU_WAIT_S", 3.0), False, "none joined within 3 s"),
])
def test_every_worker_node_lost_for_good_ends_in_one_line_and_the_old_graph_stays(two_workers, corpus,
                                                                                   bpe_tokenizer_file, tmp_path,
                                                                                   monkeypatch, capfd, case,
                                                                                   setting, join, expected):
    """The other outcome, forced: every worker node goes, so that some task surely ran there. ``no retries``: a
    fresh node joins, but the tasks that ran on the removed nodes cannot be run again. ``none joining``: Ray would
    wait for CPUs without end; the build waits ``NO_CPU_WAIT_S`` (here 3 s). The build runs in a thread here (the
    watch raises in it); the next test runs one in a driver's main thread."""
    cluster = two_workers
    target = tmp_path / "graphs" / "g"
    old = build_graph(corpus[:1], str(bpe_tokenizer_file), path=target, **KW)
    before = graph_files(old.path)
    points = tmp_path / "points"
    monkeypatch.setenv("GRAPHMAX_FAULT_LOG", str(points))
    monkeypatch.setattr(ray_engine, *setting)
    t0 = time.monotonic()
    graph, failed, at = _build_removing_workers(cluster, points, "count.batch", True, target, corpus,
                                                str(bpe_tokenizer_file), join=join)
    assert at is not None and graph is None and isinstance(failed, EngineError), (graph, failed)
    _assert_no_ray_lines(capfd)
    message = str(failed)
    print(f"\n[{case}] after {time.monotonic() - t0:.1f} s: {message}")
    assert "\n" not in message and expected in message and "nothing was written" in message
    assert sorted(p.name for p in target.parent.iterdir()) == ["g"]
    assert graph_files(target) == before
    assert not ray.is_initialized()


@contextlib.contextmanager
def _counting_driver(cluster, corpus, tokenizer, home: Path, points: Path, prelude: str = ""):
    """``graphmax build … --engine ray --ray-address`` in a child process (run after ``prelude``, Python), yielded
    once the fault log ``points`` shows that it counts; killed on the way out if it still runs."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRAPHMAX_HOME": str(home), "GRAPHMAX_FAULT_LOG": str(points)}
    code = f"import sys\n{prelude}\nfrom pipelines.cli import main\nsys.exit(main(sys.argv[1:]))"
    driver = subprocess.Popen([sys.executable, "-c", code, "build", *map(str, corpus), "--tokenizer", str(tokenizer),
                               "--name", "g", "--ngrams", "3", "--engine", "ray", "--ray-address", cluster.address],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while "count.batch" not in _log(points) and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert driver.poll() is None, "the build ended before it counted"
        yield driver
    finally:
        driver.kill()
        driver.wait()


def test_a_cli_build_whose_nodes_are_all_lost_ends_in_one_line(two_workers, corpus, bpe_tokenizer_file, tmp_path):
    # the driver's main thread: interrupted as by Ctrl-C, and the error is graphmax's one line, exit status 2
    cluster = two_workers
    home = tmp_path / "home"
    with _counting_driver(cluster, corpus, bpe_tokenizer_file, home, tmp_path / "points",
                          "from gm_graphs.build import ray_engine; ray_engine.NO_CPU_WAIT_S = 3.0") as driver:
        for node in list(cluster.worker_nodes):
            cluster.remove_node(node, allow_graceful=False)
        out, err = driver.communicate(timeout=120)
    print(f"\n[cli, every node, none joining] exit {driver.returncode}: {err.strip()}")
    assert driver.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "none joined within 3 s" in lines[0] and "nothing was written" in lines[0], err
    assert not any(RAY_LINE.match(line) for line in out.splitlines()), out
    assert sorted(os.listdir(home / "graphs")) == []


def test_a_driver_killed_mid_build_leaves_no_graph_and_the_next_build_succeeds(cluster, corpus, local_graph,
                                                                              bpe_tokenizer_file, tmp_path,
                                                                              monkeypatch):
    home = tmp_path / "home"
    points = tmp_path / "points"
    with _counting_driver(cluster, corpus, bpe_tokenizer_file, home, points) as driver:
        driver.kill()
    at = _log(points)
    assert "count.batch" in at and not any(p.startswith("commit.") for p in at)
    graphs = home / "graphs"
    assert not (graphs / "g").exists()
    print(f"\ndriver killed after {len(at)} fault points; left in graphs/: {sorted(os.listdir(graphs))}")
    cluster.wait_for_nodes()  # the cluster lost no node with its driver
    monkeypatch.setenv("GRAPHMAX_HOME", str(home))
    again = build_graph(corpus, str(bpe_tokenizer_file), "g", engine="ray",
                        engine_options=RayOptions(address=cluster.address), **KW)
    assert_same_graph(local_graph, again)
    assert sorted(os.listdir(graphs)) == ["g"]  # the dead build's staging folder and lock are gone
    assert len(cluster.worker_nodes) == 2
