"""The resident process: torch and transformers imported once, and every later model command forked from it, so that
a command starts with its libraries loaded instead of importing them for three seconds on two cores.

The first model command of an environment runs in its own process, as always, and starts a resident beside it
(:func:`start`): a detached process that imports the model libraries and graphmax's commands, then waits on a Unix
socket, ready by the time that command ends. A later command (:func:`forward`) sends it its arguments, folder,
environment, umask and the signals it ignores, with its stdin, stdout and stderr themselves (``SCM_RIGHTS``); the
resident forks, and the child runs the command on those streams as the command's own process would, and sends its
exit status. The command line waits, passes its signals on to the child's process group (Ctrl-C, SIGTERM, SIGHUP,
SIGQUIT, and Ctrl-Z with ``fg``), and exits with the child's status. A resident serves the environment it was
started from alone (:func:`environment_key`: the interpreter, its flags and path, the installed packages' folders,
graphmax's source files, the environment variables, the process' confines), and leaves after ``GRAPHMAX_RESIDENT``
idle minutes (default 10; ``0``: no resident at all), once that environment changes, or when asked
(``python -m pipelines.resident stop``).

Trust: the socket and its lock live in ``$GRAPHMAX_HOME/run``, a folder of the user's alone (mode 0700); a folder,
socket or lock that is not the user's, or not what its name says, means no resident, and the command runs in its own
process. Each side checks the other's uid (``SO_PEERCRED``); the resident checks every request before it forks, and
a request it cannot read is closed without an answer. A signal before the child has started drops the request and
acts on the command line; once it has started, a lost command line ends the child (SIGTERM). Linux only (fork,
``SCM_RIGHTS``, ``SO_PEERCRED``); elsewhere every command runs in its own process.

Files (per environment key ``K``, in ``$GRAPHMAX_HOME/run``): ``K.lock`` held by the resident for its life, ``K.sock``
its socket (created under another name and renamed into place), ``K.log`` what it served (its last 256 KiB).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import io
import json
import os
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from gm_graphs import GraphmaxError

VARIABLE = "GRAPHMAX_RESIDENT"
IDLE_MINUTES = 10.0
# what a shell changes from one command line to the next; no library reads them while it is imported
VOLATILE = frozenset({"_", "PWD", "OLDPWD", "SHLVL", "COLUMNS", "LINES", "PS1", "PS2", "PS4", "PROMPT_COMMAND",
                      "HISTFILE", "HISTSIZE", "HISTFILESIZE", "PYTEST_CURRENT_TEST"})
PACKAGES = ("gm_graphs", "gm_solver", "pipelines")  # graphmax's source: an edit is another environment
MAX_REQUEST = 1 << 20  # bytes; an environment and a command line are far smaller
LOG_LIMIT = 256 << 10
STARTING_WAIT = 20.0  # seconds a command waits for a resident that is still importing (~3 s on two cores)
SOCKET_PATH_MAX = 100  # sockaddr_un holds 108 bytes
KEY_CHECK_S = 10.0  # how often a resident checks that its environment is still the one it serves
ROOT = Path(__file__).resolve().parent.parent  # where gm_graphs, gm_solver and pipelines are installed
_in_child = False  # set in a command the resident forked: it runs here, and leaves no resident of its own


def idle_minutes(environ=None) -> float:
    """``GRAPHMAX_RESIDENT`` read: the minutes a resident waits for a command before it leaves; 0 for none.

    Raises:
        GraphmaxError: the variable is set to something other than a number of minutes ≥ 0.
    """
    text = (os.environ if environ is None else environ).get(VARIABLE, "").strip()
    if not text:
        return IDLE_MINUTES
    try:
        minutes = float(text)
    except ValueError:
        minutes = float("nan")
    if not minutes >= 0 or minutes == float("inf"):
        raise GraphmaxError(f"{VARIABLE}={text!r} is not a number of minutes; give the minutes a resident process "
                            f"waits for the next command (default {IDLE_MINUTES:g}), or 0 for none")
    return minutes


def supported() -> bool:
    """Whether this platform has what the resident uses (fork, descriptors over a Unix socket, the peer's uid)."""
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds") and hasattr(socket, "SO_PEERCRED")


def environment_key(environ=None, path=None) -> str:
    """What a resident must share with a command to run it: the interpreter, its flags and ``sys.path`` (or
    ``path``), the installed packages' folders (a ``pip install`` changes them), graphmax's source files, the user
    and every environment variable but a shell's own (:data:`VOLATILE`) and graphmax's (which it reads as a command
    runs, never while it is imported; the child runs with the command's own); hex, 20 characters."""
    what = _environment(os.environ if environ is None else environ, sys.path if path is None else path)
    return hashlib.sha256(json.dumps(what, sort_keys=True, ensure_ascii=True).encode("ascii")).hexdigest()[:20]


def _environment(environ, path) -> dict:
    code = []
    for package in PACKAGES:  # (installed side by side; whether each is imported yet does not matter)
        for file in sorted((ROOT / package).rglob("*.py")):
            with contextlib.suppress(OSError):
                st = file.stat()
                code.append((str(file), st.st_mtime_ns, st.st_size))
    installed = []
    for entry in path:
        if Path(entry).name in ("site-packages", "dist-packages"):
            with contextlib.suppress(OSError):
                installed.append((entry, os.stat(entry).st_mtime_ns))
    return {"executable": sys.executable, "version": sys.version, "flags": subprocess._args_from_interpreter_flags(),
            "path": list(path), "uid": os.getuid(), "installed": installed, "code": code, "process": _confines(),
            "environ": sorted((k, v) for k, v in environ.items()
                              if k not in VOLATILE and not k.startswith("GRAPHMAX_"))}


def _confines() -> list:
    """What the kernel confines this process to, which a child forked from a resident has from the resident: its
    groups, resource limits, priority, CPU affinity, cgroup and namespaces (a sandbox's)."""
    import resource

    limits = sorted((name, resource.getrlimit(getattr(resource, name))) for name in dir(resource)
                    if name.startswith("RLIMIT_"))
    found: list = [os.getgid(), os.getegid(), sorted(os.getgroups()), limits, os.getpriority(os.PRIO_PROCESS, 0),
                   sorted(os.sched_getaffinity(0))]
    for name in ("/proc/self/cgroup", *(f"/proc/self/ns/{ns}" for ns in ("mnt", "pid", "net", "user", "ipc", "uts"))):
        with contextlib.suppress(OSError):
            found.append(os.readlink(name) if "/ns/" in name else Path(name).read_text())
    return found


def run_folder() -> Path | None:
    """``$GRAPHMAX_HOME/run``, made if missing; None where it is not a folder of this user's alone (mode 0700)."""
    from gm_graphs import graphmax_home

    folder = graphmax_home() / "run"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        st = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return folder


def _paths(folder: Path, key: str) -> tuple[Path, Path, Path] | None:
    """The socket, lock and log of ``key`` in ``folder``; where the socket's path is too long for a socket address
    (a deep ``$GRAPHMAX_HOME``), the folder is named through a descriptor this process holds open
    (``/proc/self/fd/N``, which the kernel resolves like the folder itself); None where neither fits."""
    if len(os.fsencode(folder / f"{key}.sock")) > SOCKET_PATH_MAX:
        folder = _through_descriptor(folder)
        if folder is None or len(os.fsencode(folder / f"{key}.sock")) > SOCKET_PATH_MAX:
            return None
    return folder / f"{key}.sock", folder / f"{key}.lock", folder / f"{key}.log"


_held_folders: dict[str, int] = {}  # a folder's path → the descriptor that names it for this process' life


def _through_descriptor(folder: Path) -> Path | None:
    fd = _held_folders.get(str(folder))
    if fd is None:
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        _held_folders[str(folder)] = fd
    named = Path(f"/proc/self/fd/{fd}")
    return named if named.is_dir() else None


def _open_lock(path: Path, create: bool) -> int | None:
    """The lock file's descriptor, or None where it is missing or not a regular file of this user's (a FIFO is
    opened without blocking, then refused)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        return None
    return fd


def _held(lock: Path) -> bool:
    """Whether a resident holds ``lock`` (alive: importing or serving)."""
    fd = _open_lock(lock, create=False)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _peer_is_user(conn: socket.socket) -> bool:
    """Whether the process at the other end of ``conn`` runs as this user (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.getuid()


def _framed(message: dict) -> bytes:
    """A message as it goes on the socket: its length (4 bytes, big-endian), then its JSON."""
    body = json.dumps(message, ensure_ascii=True).encode("ascii")
    return struct.pack(">I", len(body)) + body


def _ours(path: Path, kind: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid()


# --- the command's side ---------------------------------------------------------------------------------------------

def _here() -> tuple[Path, str, tuple[Path, Path, Path]] | None:
    """This environment's run folder, key and resident's files; None where no resident is wanted here (in a
    command a resident runs, ``GRAPHMAX_RESIDENT=0``, not Linux) or none can be (:func:`run_folder`,
    :func:`_paths`)."""
    if _in_child or not supported() or idle_minutes() == 0:
        return None
    folder = run_folder()
    if folder is None:
        return None
    key = environment_key()
    paths = _paths(folder, key)
    return None if paths is None else (folder, key, paths)


def forward(argv: list[str]) -> int | None:
    """Run the command ``argv`` in this environment's resident, and return its exit status; None where no resident
    serves it (none, another's, still importing after :data:`STARTING_WAIT` s, or gone before the command started):
    the caller runs the command itself."""
    here = _here()
    if here is None:
        return None
    _, key, (sock_path, lock, _) = here
    while not _ours(sock_path, stat.S_IFSOCK):
        if not _starting(lock):
            return None
        time.sleep(0.05)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(5.0)
        conn.connect(os.fspath(sock_path))
        conn.settimeout(None)
        if not _peer_is_user(conn):
            return None  # not the user's own resident: it gets neither the environment nor the streams
        return _converse(conn, argv, key)
    except OSError:  # refused (a resident that was killed), reset: the command has not started
        return None
    finally:
        conn.close()


def _starting(lock: Path) -> bool:
    """Whether a resident holds ``lock`` and started (wrote it) less than :data:`STARTING_WAIT` s ago: one still
    importing, worth waiting for; one stuck longer is not."""
    if not _held(lock):
        return False
    try:
        return time.time() - os.lstat(lock).st_mtime < STARTING_WAIT
    except OSError:
        return False


def _request(argv: list[str], key: str, ignored: list[int]) -> bytes:
    return _framed({"argv": [sys.argv[0], *argv], "cwd": os.getcwd(), "environ": dict(os.environ), "umask": _umask(),
                    "key": key, "ignored": ignored, "unbuffered": bool(getattr(sys.stdout, "write_through", False))})


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _SignalledEarly(Exception):
    """A signal that came before the child's pid did: the connection is dropped (the resident then ends the child
    if it has started one) and the signal acted on here."""


PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _converse(conn: socket.socket, argv: list[str], key: str) -> int | None:
    """Send the request and wait for the child's end, passing on to the child's process group the command line's
    signals: those it takes (a signal it ignores is ignored by the child too), and Ctrl-Z (the child is stopped with
    it, and continued with it). A signal before the child's pid is known drops the request and acts here, on the
    handlers it would have met."""
    child: list[int] = []
    ignored = [s for s in PASSED_ON if signal.getsignal(s) is signal.SIG_IGN]

    def pass_on(signum, frame):
        if not child:
            raise _SignalledEarly(signum)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child[0], signum)

    def suspend(signum, frame):  # Ctrl-Z: the child stops, then this process, as a terminal's group would
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if child:
                os.killpg(child[0], signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)
        signal.signal(signal.SIGTSTP, suspend)  # (continued here: SIGCONT passes on below)

    def resume(signum, frame):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if child:
                os.killpg(child[0], signal.SIGCONT)
    handlers = {s: pass_on for s in PASSED_ON if s not in ignored} | {signal.SIGTSTP: suspend, signal.SIGCONT: resume}
    before = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    early = None
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()  # what this process printed comes before the child's
        data = _request(argv, key, ignored)
        sent = socket.send_fds(conn, [data[:4096]], [0, 1, 2])  # the streams ride with the first bytes
        conn.sendall(data[sent:])
        started = _receive(conn, b"P", 8)
        if started is None:
            return None  # the resident left before it forked: nothing ran
        child.append(struct.unpack(">q", started)[0])
        status = _receive(conn, b"S", 4)
    except _SignalledEarly as e:
        early = e.args[0]
        conn.close()
        return None
    finally:
        for signum, handler in before.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        if early is not None:
            signal.raise_signal(early)
    if status is None:
        print(f"graphmax {argv[0]}: error: the command (pid {child[0]}) was ended with its resident process, before "
              f"it could say how it ended; run it again", file=sys.stderr)
        return 1
    (code,) = struct.unpack(">i", status)
    if code < 0:  # killed by signal N: so is this process, as a parent of the command's own would see it
        signal.signal(-code, signal.SIG_DFL)
        signal.raise_signal(-code)
        return 128 - code
    return code


def _receive(conn: socket.socket, tag: bytes, size: int) -> bytes | None:
    """One message ``tag`` + ``size`` bytes, or None at the end of the connection (or a reset)."""
    want, data = 1 + size, b""
    while len(data) < want:
        try:
            chunk = conn.recv(want - len(data))
        except InterruptedError:
            continue
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data[1:] if data[:1] == tag else None


def start(entry: str) -> None:
    """Leave a resident for this environment behind, unless one is there, or none is wanted: a detached process
    (its own session, its output to ``K.log``) that serves until idle, running module ``entry``'s ``main`` for each
    command, after its ``preload_resident()``. Never raises: a resident is only ever a shortcut."""
    try:
        _start(entry)
    except (GraphmaxError, OSError, ValueError) as e:
        print(f"graphmax: no resident process was started: {e}", file=sys.stderr)


def _start(entry: str) -> None:
    here = _here()
    if here is None:
        return
    folder, key, (_, lock, log) = here
    if _held(lock):
        return
    with contextlib.suppress(OSError):
        if _ours(log, stat.S_IFREG) and os.lstat(log).st_size > LOG_LIMIT:
            _trim(log)
    try:
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(out).st_mode):
            return
        boot = ("import importlib, json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                "from pipelines.resident import serve; entry = importlib.import_module(sys.argv[4]); "
                "serve(sys.argv[2], float(sys.argv[3]), entry.main, entry.preload_resident)")
        subprocess.Popen([sys.executable, *subprocess._args_from_interpreter_flags(), "-c", boot,
                          json.dumps(sys.path), key, repr(idle_minutes()), entry],
                         stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=folder, env=dict(os.environ),
                         start_new_session=True, close_fds=True)
    except OSError:
        return
    finally:
        os.close(out)


def _trim(log: Path) -> None:
    """Keep the log's last half (written to a temporary file, renamed over it)."""
    with open(log, "rb") as fh:
        fh.seek(-LOG_LIMIT // 2, io.SEEK_END)
        tail = fh.read()
    tmp = log.with_name(f"{log.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:  # (made here: removed if it cannot be finished)
        with os.fdopen(fd, "wb") as fh:
            fh.write(tail)
        os.replace(tmp, log)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --- the resident's side --------------------------------------------------------------------------------------------

def serve(key: str, minutes: float, command, preload=None) -> None:
    """Be the resident of environment ``key``: hold its lock, run ``preload()`` (import what every command needs),
    then fork a child for each request, which runs ``command()`` (the command line's ``main``, reading
    ``sys.argv``, returning the exit status), until ``minutes`` pass with none running and none asked."""
    started = dict(os.environ), list(sys.path)  # as the command line had them (a library may change them)
    folder = run_folder()
    paths = _paths(folder, key) if folder is not None else None
    if paths is None or environment_key(*started) != key:
        _say(f"not serving {key}: the run folder is not the user's alone, or the environment changed")
        return
    sock_path, lock_path, _ = paths
    lock = _open_lock(lock_path, create=True)
    if lock is None:
        _say(f"not serving: {lock_path} is not a file of this user's")
        return
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another resident serves this environment
        os.ftruncate(lock, 0)
        os.write(lock, f"{os.getpid()}\n".encode())  # its time of writing is the resident's start (_starting)
        _RESIDENT_FDS.append(lock)
        _serve(key, minutes, command, preload, sock_path, started)
    finally:
        os.close(lock)


_RESIDENT_FDS: list[int] = []  # the resident's own descriptors, closed in each child (its lock: held by it alone)


def _serve(key: str, minutes: float, command, preload, sock_path: Path, started: tuple[dict, list]) -> None:
    t0 = time.monotonic()
    if preload is not None:
        preload()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a fork after CUDA started breaks CUDA in every child
        _say("not serving: CUDA was initialised while importing; every child would find it broken")
        return
    listener, inode = _listen(sock_path)
    if listener is None:
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # (its socket removed on the way out)
    _say(f"serving {key} (pid {os.getpid()}), ready in {time.monotonic() - t0:.1f} s")
    serving = _Serving(listener, sock_path, inode, key, command)
    try:
        serving.loop(started, minutes * 60)
    finally:
        serving.close_listener()
        _say("left")


def _listen(sock_path: Path) -> tuple[socket.socket | None, int | None]:
    """A listening socket at ``sock_path``: bound under a temporary name, then renamed into place (over a dead
    resident's socket, never over anything else)."""
    if os.path.lexists(sock_path) and not _ours(sock_path, stat.S_IFSOCK):
        _say(f"not serving: {sock_path} is not a socket of this user's")
        return None, None
    tmp = sock_path.with_name(f"{sock_path.stem}.{os.getpid()}.tmp")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mask = os.umask(0o077)  # the socket the user's alone from its first moment
    try:
        listener.bind(os.fspath(tmp))
        os.umask(mask)
        listener.listen(16)
        listener.setblocking(False)
        inode = os.lstat(tmp).st_ino
        os.replace(tmp, sock_path)
    except OSError as e:
        os.umask(mask)
        _say(f"not serving: {e}")
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None, None
    return listener, inode


def _inode(path: Path) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


class _Serving:
    """The resident's loop: its listening socket, its children (pid → the connection of its command line) and the
    pair a child's end (SIGCHLD) writes to, so that the loop wakes and its command line hears at once."""

    def __init__(self, listener, sock_path: Path, inode: int, key: str, command) -> None:
        self.listener, self.sock_path, self.inode, self.key, self.command = listener, sock_path, inode, key, command
        self.children: dict[int, socket.socket] = {}
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ)
        self.wake, self.woken = socket.socketpair()
        for end in (self.wake, self.woken):
            end.setblocking(False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake.fileno(), warn_on_full_buffer=False)
        self.sel.register(self.woken, selectors.EVENT_READ)

    def loop(self, started: tuple[dict, list], idle_seconds: float) -> None:
        """Serve until ``idle_seconds`` pass with no command running, a stop is asked, the environment of the
        variables and ``sys.path`` it was ``started`` with changes (graphmax edited, a package installed) or its
        socket is no longer its own (removed or replaced): no command could reach it any more. Once stopping, it
        stops listening at once (a command then runs in its own process), and leaves when its children have
        ended."""
        served = _environment(*started)
        last = checked = time.monotonic()
        while True:
            if self.listener is not None and time.monotonic() - checked > KEY_CHECK_S:
                checked = time.monotonic()
                changed = [field for field, value in _environment(*started).items() if value != served[field]]
                if changed:
                    _say(f"leaving: its environment changed ({', '.join(changed)})")
                    self.close_listener()
            for ready, _ in self.sel.select(timeout=0.5):
                if ready.fileobj is self.woken:
                    with contextlib.suppress(OSError):
                        self.woken.recv(4096)
                elif ready.fileobj is self.listener:
                    last = time.monotonic()
                    if self._accept():
                        self.close_listener()
                else:
                    self._gone(ready.fileobj)
            self._reap()
            if self.children:
                last = time.monotonic()
            elif self.listener is None or time.monotonic() - last > idle_seconds or \
                    _inode(self.sock_path) != self.inode:
                return

    def close_listener(self) -> None:
        if self.listener is None:
            return
        if _inode(self.sock_path) == self.inode:  # still ours (the lock keeps any other resident from replacing it)
            with contextlib.suppress(OSError):
                os.unlink(self.sock_path)
        self.sel.unregister(self.listener)
        self.listener.close()
        self.listener = None

    def _gone(self, conn: socket.socket) -> None:
        """A command's connection is readable only when its command line has gone (it sends nothing more): its
        command is ended as a kill ends it."""
        with contextlib.suppress(OSError):
            if conn.recv(1):
                return
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn)
        pid = next((p for p, c in self.children.items() if c is conn), None)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def _accept(self) -> bool:
        """Serve one connection; returns whether it asked the resident to stop."""
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return False
        fds: list[int] = []
        try:
            if not _peer_is_user(conn):
                raise ValueError("another user's")
            request, fds = _read_request(conn, deadline=time.monotonic() + REQUEST_WAIT_S)
            if request.get("stop") is True:
                conn.sendall(b"S" + struct.pack(">i", 0))
                conn.close()
                return True
            request = _checked(request, self.key)
            if len(fds) != 3:
                raise ValueError(f"{len(fds)} descriptors, not 3")
            # signals held until the child has its handlers (and the parent has the child's pid): a signal passed
            # on in between is neither lost nor taken by the resident's own handlers
            signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
            try:
                pid = os.fork()
                if pid == 0:
                    _child([self.listener, self.wake, self.woken, *self.children.values()], self.sel, conn,
                           request, fds, self.command)  # never returns
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
        except Exception as e:  # noqa: BLE001 - whatever a request holds (RecursionError: JSON nested past the limit)
            _say(f"refused a request: {type(e).__name__}: {e}")
            conn.close()
            return False
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.children[pid] = conn  # reaped, and its command line told, by _reap
        _say(f"{pid}: graphmax {' '.join(request['argv'][1:2])}")
        try:
            conn.settimeout(None)
            conn.sendall(b"P" + struct.pack(">q", pid))
            self.sel.register(conn, selectors.EVENT_READ)
        except OSError:  # its command line has gone already: end the command as a kill does
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return False

    def _reap(self) -> None:
        """Collect the children that ended and tell their command lines how (read there only where the child
        could not say it itself: killed)."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(OSError):
                conn.sendall(b"S" + struct.pack(">i", os.waitstatus_to_exitcode(status)))
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn)
            conn.close()
            _say(f"{pid}: ended with status {os.waitstatus_to_exitcode(status)}")


REQUEST_WAIT_S = 2.0  # seconds a command line has to send its whole request (it sends it at once)


def _read_request(conn: socket.socket, deadline: float) -> tuple[dict, list[int]]:
    def wait() -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError("a request not sent in time")
        conn.settimeout(left)
    wait()
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    fds = list(fds)
    try:
        while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
            if len(data) >= 4 and struct.unpack(">I", data[:4])[0] > MAX_REQUEST:
                raise ValueError("a request over 1 MiB")
            wait()
            chunk = conn.recv(65536)
            if not chunk:
                raise ValueError("a request cut short")
            data += chunk
        request = json.loads(data[4:4 + struct.unpack(">I", data[:4])[0]])
        if not isinstance(request, dict):
            raise ValueError("a request that is not an object")
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
    return request, fds


def _checked(request: dict, key: str) -> dict:
    """The request, its every field of the type it must have; ValueError otherwise."""
    argv, cwd, environ, umask = request["argv"], request["cwd"], request["environ"], request["umask"]
    ignored, unbuffered = request["ignored"], request["unbuffered"]
    if request.get("key") != key:
        raise ValueError("another environment's request")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv) and isinstance(cwd, str)
            and isinstance(environ, dict) and all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k
                                                  for k, v in environ.items())
            and type(umask) is int and 0 <= umask <= 0o777 and type(unbuffered) is bool
            and isinstance(ignored, list) and all(type(s) is int and s in PASSED_ON for s in ignored)):
        raise ValueError("a malformed request")
    if any("\x00" in s for s in [*argv, cwd, *environ, *environ.values()]):
        raise ValueError("a NUL character in the request")
    return request


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", flush=True)


def _child(resident_sockets, sel, conn, request, fds, command) -> None:
    """In the forked child (the command line's signals held): become the command's process (its streams, folder,
    environment, umask, argv and the signals it ignores), run the command line, and exit with its status, which
    it sends first on its own connection (the resident's word counts only where the child was killed)."""
    global _in_child
    _in_child = True
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sel.close()
        for other in resident_sockets:
            if other is not None:
                other.close()
        for fd in [*_RESIDENT_FDS, *_held_folders.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        for signum in PASSED_ON:  # as the command line's own process would have them
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, signal.SIG_IGN if signum in request["ignored"] else default)
        os.setpgid(0, 0)  # a group of its own: what the command starts gets the command line's signals with it
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["environ"])
        _streams(request["unbuffered"])
        _reseed()
        try:
            os.chdir(request["cwd"])
        except OSError as e:
            print(f"graphmax: error: the current folder {request['cwd']!r} cannot be entered ({e.strerror}); "
                  f"cd to a folder that exists", file=sys.stderr)
            code = 2
        else:
            sys.argv = list(request["argv"])
            try:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
                code = command()
            except KeyboardInterrupt:  # a Ctrl-C before the command line's own handling began
                print(f"graphmax {' '.join(sys.argv[1:2])}: interrupted".rstrip(), file=sys.stderr)
                code = 130
            except SystemExit as e:
                if isinstance(e.code, int) or e.code is None:
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    code = 1
            except BaseException:  # a bug's traceback, as the command's own process prints it
                import traceback

                traceback.print_exc()
                code = 1
        with contextlib.suppress(BaseException):
            threading._shutdown()  # what the interpreter's exit does first: wait for the command's own threads
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    finally:
        for signum in PASSED_ON:  # (process-wide: a mask would leave the command's other threads to take them)
            signal.signal(signum, signal.SIG_IGN)
        with contextlib.suppress(BaseException):  # its status, now that no signal passed on can interrupt its end
            conn.sendall(b"S" + struct.pack(">i", code & 0xFF))
        os._exit(code & 0xFF)


def _streams(unbuffered: bool) -> None:
    """sys.stdin, stdout and stderr anew over descriptors 0–2 (the command line's), set as Python sets them at
    start: line-buffered on a terminal, written through where the command line's were (``-u``,
    ``PYTHONUNBUFFERED``); the resident's were /dev/null and its log."""
    made = []
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
        buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(buffered, encoding=getattr(old, "encoding", None) or "utf-8",
                                  errors=getattr(old, "errors", None) or "strict",
                                  line_buffering=fd == 2 or (fd == 1 and raw.isatty()),
                                  write_through=fd == 2 or (fd == 1 and unbuffered))
        made.append((name, stream))
    for name, stream in made:
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _reseed() -> None:
    """numpy's and torch's global generators seeded anew, as a process of its own would have them (Python's
    ``random`` reseeds itself after a fork); every child would otherwise draw the resident's numbers."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def stop() -> int:
    """Ask every resident of this ``$GRAPHMAX_HOME`` to stop listening and leave once its commands have ended;
    returns how many were asked (``python -m pipelines.resident stop`` says it)."""
    folder = run_folder()
    asked = 0
    for found in sorted(folder.glob("*.sock")) if folder is not None else ():
        paths = _paths(folder, found.stem)  # (a deep home's through a descriptor)
        if paths is None or not _ours(paths[0], stat.S_IFSOCK):
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            try:
                conn.settimeout(5.0)
                conn.connect(os.fspath(paths[0]))
                conn.sendall(_framed({"stop": True}))
                asked += _receive(conn, b"S", 4) is not None
            except OSError:  # a dead resident's socket
                continue
    return asked


if __name__ == "__main__":
    if sys.argv[1:] != ["stop"]:
        sys.exit("usage: python -m pipelines.resident stop   (every resident process of $GRAPHMAX_HOME leaves)")
    print(f"graphmax: {stop()} resident process(es) asked to leave")
