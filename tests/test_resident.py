"""The resident process (pipelines/resident.py): a later model command runs in a child forked from it, on the
command line's streams, in its folder, with its environment, and ends with the same line and status as in its own
process; a Ctrl-C passes on, a command line killed ends its command; a folder, socket or lock that is not what it
says means no resident; a bad request never stops one.

The suite runs with ``GRAPHMAX_RESIDENT=0`` (tests/conftest.py); the commands here set it on, each in a
``GRAPHMAX_HOME`` of the module's own, and the module's resident is stopped at its end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines import resident
from pipelines.cli import main

from .helpers import finishes_within

ROOT = Path(__file__).resolve().parent.parent
# the command line, then on stderr's last line whether torch was imported in its process
CLIENT = ("import sys\nfrom pipelines.cli import main\ncode = main()\n"
          "print('torch in the command line:', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(code)")
pytestmark = pytest.mark.skipif(not resident.supported(), reason="the resident process is Linux's")


def command(env: dict, *argv: str, cwd: Path = ROOT, wait: bool = True):
    run = [sys.executable, "-c", CLIENT, *argv]
    if not wait:
        return subprocess.Popen(run, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(run, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def said(done) -> list[str]:
    """stderr's lines but weight loading's progress bar."""
    return [line for line in done.stderr.splitlines() if line and "Loading weights" not in line]


def same_output(a: str, b: str) -> bool:
    def untimed(text: str) -> list[str]:
        return [x for x in text.splitlines() if not x.startswith(("  warm-up:", "time per token:"))]
    return untimed(a) == untimed(b)


def log_lines(home: Path) -> list[str]:
    return [line for log in sorted((home / "run").glob("*.log")) for line in log.read_text().splitlines()]


def wait_for(what, seconds: float = 90.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {seconds} s")


def serving_pid(home: Path) -> int:
    line = [x for x in log_lines(home) if " serving " in x][-1]
    return int(line.split("(pid ")[1].split(")")[0])


def child_pid(home: Path, name: str) -> int | None:
    lines = [x for x in log_lines(home) if x.endswith(f": graphmax {name}")]
    return int(lines[-1].split()[2].rstrip(":")) if lines else None


def ask(home: Path, payload: bytes, fds: list[int] = ()) -> bytes:
    """Send ``payload`` to the resident's socket as is (with ``fds``); what it answers before it closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(os.fspath(next((home / "run").glob("*.sock"))))
        if fds:
            socket.send_fds(conn, [payload], list(fds))
        elif payload:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)  # all it will send
        data = b""
        try:
            while chunk := conn.recv(64):
                data += chunk
        except ConnectionResetError:  # closed with our bytes unread
            pass
        return data


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model, built):
    """A ``GRAPHMAX_HOME`` whose resident a first command, run in its own process, started."""
    home = tmp_path_factory.mktemp("resident") / "home"
    env = {**os.environ, "GRAPHMAX_HOME": str(home), "GRAPHMAX_RESIDENT": "3", "PYTHONPATH": str(ROOT)}
    argv = ["generate", "--path", str(built), "--model", str(tiny_model), "--prompt", "the movie",
            "--max-new-tokens", "4"]
    first = command(env, *argv)
    assert first.returncode == 0, first.stderr
    assert said(first)[-1] == "torch in the command line: True"
    wait_for(lambda: list((home / "run").glob("*.sock")))
    yield env, home, argv, first
    subprocess.run([sys.executable, "-m", "pipelines.resident", "stop"], env=env, cwd=ROOT, timeout=60)
    wait_for(lambda: not list((home / "run").glob("*.sock")), 30)  # none left listening


def test_a_later_command_runs_in_the_resident_and_prints_what_its_own_process_did(served):
    env, home, argv, first = served
    later = command(env, *argv)
    assert later.returncode == 0, later.stderr
    assert said(later)[-1] == "torch in the command line: False"  # the child imported it, not this process
    assert same_output(later.stdout, first.stdout)
    assert child_pid(home, "generate") is not None


def test_a_refusal_after_the_model_loads_is_the_same_line_and_status(served, tiny_model):
    env, home, argv, _ = served
    too_long = [*argv[:-1], "200"]  # the tiny model reads 128 positions
    there = command(env, *too_long)
    here = command({**env, "GRAPHMAX_RESIDENT": "0"}, *too_long)
    assert (there.returncode, here.returncode) == (2, 2)
    assert said(there)[:-1] == said(here)[:-1]
    assert said(there)[0].startswith("graphmax generate: error: --max-new-tokens 200 and the longest prompt")
    assert (said(there)[-1], said(here)[-1]) == ("torch in the command line: False", "torch in the command line: True")


def test_the_command_runs_in_the_command_lines_folder(served, tmp_path):
    env, home, argv, first = served
    graph = os.path.relpath(argv[2], tmp_path)
    done = command(env, *argv[:2], graph, *argv[3:], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert said(done)[-1] == "torch in the command line: False"
    assert same_output(done.stdout, first.stdout.replace(argv[2], graph))


def _datastore(env, tmp_path, tiny_model, corpus_path, ignore: int | None = None):
    """A datastore command paused at its first chunk, in ``tmp_path`` with relative paths; the fault log it writes
    says that the child runs in the command line's folder with the command line's variables. ``ignore``: a signal
    its command line ignores."""
    log = tmp_path / "points.txt"
    run = subprocess.Popen(
        [sys.executable, "-c", CLIENT, "datastore", "--corpus", str(corpus_path), "--out", "ds", "--model",
         str(tiny_model), "--docs", "20"],
        env={**env, "GRAPHMAX_FAULT": "datastore.chunk:pause", "GRAPHMAX_FAULT_LOG": "points.txt"}, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=None if ignore is None else lambda: signal.signal(ignore, signal.SIG_IGN))
    wait_for(lambda: log.exists() and "datastore.chunk" in log.read_text())
    return run, tmp_path / "ds"


@pytest.fixture()
def corpus_path(tmp_path):
    from .helpers import make_docs

    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(make_docs(40, seed=3)) + "\n")
    return path


def test_a_ctrl_c_passes_on_to_the_command_which_says_what_it_left(served, tmp_path, tiny_model, corpus_path):
    env, home, _, _ = served
    run, out = _datastore(env, tmp_path, tiny_model, corpus_path)
    run.send_signal(signal.SIGINT)
    stdout, stderr = run.communicate(timeout=60)
    lines = [x for x in stderr.splitlines() if x and "Loading weights" not in x]
    assert run.returncode == 130, repr(stderr)
    assert "graphmax datastore: interrupted; nothing was written: ds is as it was\n" in stderr  # (after its bar)
    assert lines[-1] == "torch in the command line: False"
    assert not out.exists()


def test_a_signal_the_command_line_ignores_is_ignored_by_its_command(served, tmp_path, tiny_model, corpus_path):
    env, home, _, _ = served
    run, out = _datastore(env, tmp_path, tiny_model, corpus_path, ignore=signal.SIGHUP)  # as under nohup
    run.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert run.poll() is None
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stderr  # interrupted by the Ctrl-C, not ended by the hang-up (129)


def test_a_command_line_killed_ends_its_command(served, tmp_path, tiny_model, corpus_path):
    env, home, _, _ = served
    run, out = _datastore(env, tmp_path, tiny_model, corpus_path)
    pid = child_pid(home, "datastore")
    run.kill()
    run.wait(timeout=30)
    ended = wait_for(lambda: [x for x in log_lines(home) if f" {pid}: ended with status " in x], 60)
    assert ended[0].endswith(" 143")  # SIGTERM, taken as the command's own process takes it: its cleanup ran
    assert not out.exists()


@pytest.mark.parametrize("payload", [
    b"",  # connected, then gone
    struct.pack(">I", 1 << 31),  # a length past the cap
    struct.pack(">I", 5) + b"{oops",  # not JSON
    struct.pack(">I", 2) + b"[]",  # not an object
    struct.pack(">I", 200_000) + b"[" * 200_000,  # nested past the parser's recursion limit
], ids=["nothing", "huge", "garbage", "a list", "nested"])
def test_a_request_it_cannot_read_is_closed_without_an_answer(served, payload):
    env, home, argv, _ = served
    assert finishes_within(30, lambda: ask(home, payload)) == b""
    time.sleep(0.2)
    assert Path(f"/proc/{serving_pid(home)}/stat").read_text().split()[2] != "Z"  # and it serves on


def test_a_request_without_the_streams_or_of_another_environment_is_refused(served):
    env, home, argv, _ = served
    body = {"argv": ["graphmax", *argv], "cwd": str(ROOT), "environ": {}, "umask": 0o22}
    key = next((home / "run").glob("*.sock")).stem
    for request, fds in [({**body, "key": "another"}, [0, 1, 2]),
                         ({**body, "key": key}, []),  # without the streams
                         ({**body, "argv": [], "key": key}, [0, 1, 2]),
                         ({**body, "umask": "022", "key": key}, [0, 1, 2])]:
        data = json.dumps(request).encode()
        assert finishes_within(30, lambda d=data, f=fds: ask(home, struct.pack(">I", len(d)) + d, f)) == b""
    refused = [x for x in log_lines(home) if "refused a request" in x]
    assert len(refused) >= 4
    later = command(env, *argv)  # and it still serves
    assert later.returncode == 0 and said(later)[-1] == "torch in the command line: False", later.stderr


def test_a_killed_resident_is_replaced_and_its_command_runs_meanwhile_in_its_own_process(served, tmp_path,
                                                                                          tiny_model, corpus_path):
    env, home, argv, first = served
    old = serving_pid(home)
    run, out = _datastore(env, tmp_path, tiny_model, corpus_path)
    os.kill(old, signal.SIGKILL)  # the resident and its command with it: the command line cannot know the status
    os.kill(child_pid(home, "datastore"), signal.SIGKILL)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 1
    line = stderr[stderr.index("graphmax datastore: error: "):].splitlines()[0]  # (after the progress bar)
    assert line.endswith("was ended with its resident process, before it could say how it ended; run it again")
    assert list((home / "run").glob("*.sock"))  # the dead resident's socket is left: a connection is refused
    done = command(env, *argv)
    assert done.returncode == 0, done.stderr
    assert said(done)[-1] == "torch in the command line: True"
    assert same_output(done.stdout, first.stdout)
    wait_for(lambda: serving_pid(home) != old)  # the command left a new one, over the dead one's socket
    later = command(env, *argv)
    assert said(later)[-1] == "torch in the command line: False", later.stderr


def test_a_stop_while_a_command_runs_stops_listening_at_once_and_leaves_after_it(served, tmp_path, tiny_model,
                                                                                 corpus_path):
    env, home, argv, _ = served
    resident_pid = serving_pid(home)
    run, out = _datastore(env, tmp_path, tiny_model, corpus_path)
    stopped = subprocess.run([sys.executable, "-m", "pipelines.resident", "stop"], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert stopped.stdout == "graphmax: 1 resident process(es) asked to leave\n"
    wait_for(lambda: not list((home / "run").glob("*.sock")), 10)  # no longer listening: a command now runs in
    assert Path(f"/proc/{resident_pid}").exists()  # its own process; the resident stays while its command runs
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=60)
    assert run.returncode == 130
    wait_for(lambda: not Path(f"/proc/{resident_pid}").exists() or
             Path(f"/proc/{resident_pid}/stat").read_text().split()[2] == "Z", 30)


# --- no resident process needed -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "minutes"), [("", 10.0), ("0", 0.0), ("2.5", 2.5), (" 3 ", 3.0)])
def test_the_variable_gives_the_idle_minutes(text, minutes):
    assert resident.idle_minutes({"GRAPHMAX_RESIDENT": text}) == minutes


@pytest.mark.parametrize("text", ["x", "-1", "inf", "nan", "1e999"])
def test_a_variable_that_is_no_number_of_minutes_is_one_line(text):
    with pytest.raises(resident.GraphmaxError, match=r"GRAPHMAX_RESIDENT=.* is not a number of minutes; give"):
        resident.idle_minutes({"GRAPHMAX_RESIDENT": text})


def test_the_key_follows_what_an_import_reads_not_the_shell_nor_graphmax_variables(tmp_path, monkeypatch):
    base = {"HOME": "/h", "HF_HOME": "/hf", "PWD": "/a", "GRAPHMAX_HOME": "/g"}
    key = resident.environment_key(base)
    assert resident.environment_key({**base, "PWD": "/b", "OLDPWD": "/a", "SHLVL": "3"}) == key
    assert resident.environment_key({**base, "GRAPHMAX_HOME": "/x", "GRAPHMAX_FAULT": "y"}) == key
    assert resident.environment_key({**base, "HF_HOME": "/other"}) != key
    assert resident.environment_key({**base, "OMP_NUM_THREADS": "1"}) != key
    # another confinement of the process is another environment
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
    try:
        assert resident.environment_key(base) != key
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert resident.environment_key(base) == key
    # an edit to graphmax's source is another environment
    (tmp_path / "pipelines").mkdir()
    source = tmp_path / "pipelines" / "x.py"
    source.write_text("x = 1\n")
    monkeypatch.setattr(resident, "ROOT", tmp_path)
    before = resident.environment_key(base)
    source.write_text("x = 22\n")
    assert resident.environment_key(base) != before


def test_a_resident_leaves_once_graphmax_is_edited_not_when_a_library_changes_its_path_or_variables(tmp_path):
    # a resident of its own here, whose graphmax source is a folder of the test's; what it imports first changes
    # its sys.path and environment, as libraries do (torch's inductor sets TORCHINDUCTOR_CACHE_DIR)
    (tmp_path / "pipelines").mkdir()
    source = tmp_path / "pipelines" / "x.py"
    source.write_text("x = 1\n")
    code = ("import os, sys\nfrom pathlib import Path\nfrom pipelines import resident\n"
            "resident.ROOT, resident.KEY_CHECK_S = Path(sys.argv[1]), 0.2\n"
            "def preload():\n    sys.path.append('/elsewhere')\n    os.environ['SET_BY_A_LIBRARY'] = '1'\n"
            "from pipelines.cli import main\nresident.serve(resident.environment_key(), 5, main, preload)\n")
    env = {**os.environ, "GRAPHMAX_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    serving = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: list((tmp_path / "home" / "run").glob("*.sock")), 60)
        time.sleep(1.0)
        assert serving.poll() is None  # it serves while graphmax is unchanged
        source.write_text("x = 22\n")
        serving.wait(timeout=30)
    finally:
        serving.kill()
    said = serving.stdout.read().splitlines()
    assert said[-2].endswith(" leaving: its environment changed (code)") and said[-1].endswith(" left")
    assert not list((tmp_path / "home" / "run").glob("*.sock"))


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GRAPHMAX_RESIDENT", "1")
    return tmp_path / "home"


def _started(monkeypatch) -> list:
    spawned = []
    monkeypatch.setattr(resident.subprocess, "Popen", lambda *a, **k: spawned.append(a))
    return spawned


def test_a_run_folder_open_to_others_or_a_link_means_no_resident(home, tmp_path, monkeypatch):
    spawned = _started(monkeypatch)
    (home / "run").mkdir(parents=True, mode=0o700)
    os.chmod(home / "run", 0o777)
    assert resident.forward(["generate"]) is None
    resident.start("pipelines.cli")
    os.chmod(home / "run", 0o700)
    os.rmdir(home / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, home / "run")
    assert resident.forward(["generate"]) is None
    resident.start("pipelines.cli")
    assert spawned == [] and list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(("where", "what"), [("sock", "a FIFO"), ("sock", "a file"), ("sock", "a link"),
                                             ("lock", "a FIFO"), ("lock", "a link")])
def test_a_socket_or_lock_that_is_not_what_it_says_means_no_resident_and_is_left_as_it_is(home, tmp_path, monkeypatch,
                                                                                       where, what):
    key = resident.environment_key()
    path = resident.run_folder() / f"{key}.{where}"
    if what == "a FIFO":
        os.mkfifo(path)
    elif what == "a file":
        path.write_text("not a resident's")
    else:
        (tmp_path / "target").write_text("")
        os.symlink(tmp_path / "target", path)
    kind = stat.S_IFMT(os.lstat(path).st_mode)
    assert finishes_within(10, lambda: resident.forward(["generate"])) is None  # and no wait on it
    # a resident started now does not serve: it neither locks through it nor replaces it (here, in this process:
    # it returns before it would listen)
    assert finishes_within(10, lambda: resident.serve(key, 0, main)) is None
    assert stat.S_IFMT(os.lstat(path).st_mode) == kind
    assert sorted(p.name for p in path.parent.iterdir()) == sorted({path.name, f"{key}.lock"})


def test_a_deep_home_is_reached_through_a_descriptor(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / ("deep" * 30) / "home"))
    folder = resident.run_folder()
    sock, lock, log = resident._paths(folder, "k" * 20)
    assert len(os.fsencode(folder / sock.name)) > resident.SOCKET_PATH_MAX  # too long for a socket address
    assert str(sock).startswith("/proc/self/fd/") and sock.parent.samefile(folder)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(os.fspath(sock))
        assert stat.S_ISSOCK(os.lstat(folder / sock.name).st_mode)


def test_no_resident_where_the_variable_says_0(home, monkeypatch):
    spawned = _started(monkeypatch)
    monkeypatch.setenv("GRAPHMAX_RESIDENT", "0")
    assert resident.forward(["generate"]) is None
    resident.start("pipelines.cli")
    assert spawned == [] and not (home / "run").exists()
