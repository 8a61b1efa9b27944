"""numba's cache of graphmax's kernels: where it goes (even with nowhere writable), when it is reused, and that
no file in it (written by processes racing, damaged, or from other sources) and no failure to write it changes a
result or ends a run."""

from __future__ import annotations

import functools
import importlib
import json
import multiprocessing
import os
import pickle
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numba
import numpy as np
import pytest
from numba.core.dispatcher import Dispatcher

from gm_graphs.format import validate
from gm_graphs.store import kernel_cache as numba_cache

ROOT = Path(__file__).parents[1]
PACKAGES = ("gm_graphs", "gm_solver")
# one graphmax kernel (validate._first_below: the position of the first value below a bound) called with three
# argument types: float64 values against an int bound, int32 values, and float64 values against a float bound.
# The first type's machine code run on the third's arguments takes the bound 2.5 for 2 and answers 2, not 1.
VALUES = np.array([3.0, 2.2, 1.0])
CALLS = [(VALUES, 2), (VALUES.astype(np.int32), 2), (VALUES, 2.5)]
EXPECTED = [validate._first_below.py_func(*call) for call in CALLS]  # [2, 2, 1], by Python itself
DATA_FILE = re.compile(r"\.(\d+)\.\w+$")  # a data file of the cache (kernel.<n>.<suffix>), not its index


def _fresh_kernel(cache: Path) -> Dispatcher:
    """The kernel as a new process has it: nothing compiled in memory, its cache in ``cache``."""
    numba.config.CACHE_DIR = str(cache)
    return numba.njit(cache=True)(validate._first_below.py_func)


def _outputs(kernel: Dispatcher, calls: list[tuple]) -> list:
    """The kernel's answer to each call, or the exception it raised."""
    answers = []
    for call in calls:
        try:
            answers.append(int(kernel(*call)))
        except Exception as e:
            answers.append(f"{type(e).__name__}: {e}")
    return answers


def _in_child(target, *args) -> int:
    child = multiprocessing.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join()
    return child.exitcode


def _copy_packages(site: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))


def test_import_falls_back_to_a_temporary_cache_folder(tmp_path):
    site = tmp_path / "site"
    _copy_packages(site)
    for folder in {path.parent for path in site.rglob("*.py")}:
        (folder / "__pycache__").write_text("")  # a file where numba would make its folder: not writable
    home = tmp_path / "home"
    home.write_text("")  # nor is ~/.cache under it
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1",
           "TMPDIR": str(tmp_path / "tmp")}
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("XDG_CACHE_HOME", None)
    (tmp_path / "tmp").mkdir()
    # importing decorates every cached kernel (which raised without the fallback); one product compiles one
    code = ("import numba, scipy.sparse as sp, torch; from gm_solver.operator import TransitionOperator; "
            "TransitionOperator(sp.eye(3, format='csr')).matvec(torch.ones(1, 3, dtype=torch.float64)); "
            "print(numba.config.CACHE_DIR)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    cache = Path(out.stdout.strip())
    assert cache.parent == tmp_path / "tmp" and any(cache.rglob("*.gmi"))


def test_every_graphmax_kernel_is_stamped_with_all_sources_and_sealed():
    modules = [".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
               if "import numba" in path.read_text() and "__pycache__" not in path.parts]
    kernels = {}
    for name in modules:
        for kernel in vars(importlib.import_module(name)).values():
            if isinstance(kernel, Dispatcher) and kernel.py_func.__module__ == name and kernel._cache.cache_path:
                kernels[f"{name}.{kernel.__name__}"] = (type(kernel._cache._impl.locator).__module__,
                                                        type(kernel._cache._cache_file).__name__)
    assert len(kernels) > 50 and kernels == dict.fromkeys(kernels, ("gm_graphs.store.kernel_cache",
                                                                    "_SealedCacheFile"))


def test_a_change_to_any_kernel_module_recompiles_the_kernels_that_call_it(tmp_path):
    # numba alone reuses a kernel's cache while its own file is unchanged: backends/numba/context.py's kernels, built
    # against lambert.py's, were loaded after lambert.py changed, and crashed
    site = tmp_path / "site"
    _copy_packages(site)
    other = site / "other_lib.py"  # another library's cached kernel, outside graphmax's packages
    other.write_text("import numba\n\n\n@numba.njit(cache=True)\ndef kernel(x):\n    return x + 1\n")
    (tmp_path / "home").mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("NUMBA_CACHE_DIR", None)  # so the kernels are cached in the copy's __pycache__
    # one small kernel of backends/numba/context.py (it compiles in about a second): was it loaded from the cache?
    code = ("import numpy as np, other_lib; from gm_solver.backends.numba import context as ck; "
            "ck.count_stats(np.array([0, 1, 2]), np.array([1, 0]), np.ones(2), 2); "
            "print(sum(ck.count_stats.stats.cache_hits.values()), sum(ck.count_stats.stats.cache_misses.values()), "
            "type(other_lib.kernel._cache._impl.locator).__module__)")

    def run() -> list[str]:
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert run() == ["0", "1", "numba.core.caching"]  # compiled and cached; other_lib keeps numba's own locator
    with other.open("a") as f:
        f.write("# a change outside graphmax's packages\n")
    assert run()[:2] == ["1", "0"]  # loaded from the cache
    with (site / "gm_solver" / "backends" / "numba" / "lambert.py").open("a") as f:
        f.write("# a change to the callee's module only\n")
    assert run()[:2] == ["0", "1"]  # the cache is stale: compiled again


def test_unknown_numba_internals_leave_numbas_own_locators_with_a_warning(monkeypatch):
    monkeypatch.setattr(numba_cache, "caching", None)  # as if numba.core.caching were gone
    with pytest.warns(RuntimeWarning, match="cache locators"):
        numba_cache.ensure_cache_dir()


def _compile_on_a_slow_disk(i: int, cache: Path, sync: Path) -> None:
    # child i compiles CALLS[i] into the shared cache. The children start saving together (once all have compiled),
    # on a file system whose writes land late: the last child's index and the first child's data files last
    children = len(CALLS)
    kernel = _fresh_kernel(cache)
    save, replace = kernel._cache.save_overload, os.replace

    def save_together(sig, data):
        (sync / f"at-{i}").touch()
        deadline = time.monotonic() + 10  # (a child that never comes: the others go on)
        while len(list(sync.glob("at-*"))) < children and time.monotonic() < deadline:
            time.sleep(0.005)
        save(sig, data)

    def slow_replace(source, target):
        data = DATA_FILE.search(os.fspath(target))
        time.sleep((0.3 if i == 0 else 0.0) if data else (0.2 if i == children - 1 else 0.1))
        replace(source, target)

    kernel._cache.save_overload, os.replace = save_together, slow_replace
    kernel(*CALLS[i])


def _report(cache: Path, calls: list[tuple], out: Path) -> None:
    kernel = _fresh_kernel(cache)
    answers = _outputs(kernel, calls)
    out.write_text(json.dumps([answers, sum(kernel.stats.cache_hits.values())]))


def test_processes_compiling_a_kernel_for_other_types_at_once_never_swap_its_machine_code(tmp_path):
    # numba saves a kernel's index and data files apart and unlocked: here its index ended mapping the float bound's
    # type to the data file holding the int bound's code, and a new process answered 2 for 1
    cache = tmp_path / "cache"
    children = [multiprocessing.get_context("fork").Process(target=_compile_on_a_slow_disk, args=(i, cache, tmp_path))
                for i in range(len(CALLS))]
    for child in children:
        child.start()
    for child in children:
        child.join()
    assert [child.exitcode for child in children] == [0] * len(CALLS)
    assert _in_child(_report, cache, CALLS, tmp_path / "report.json") == 0
    answers, hits = json.loads((tmp_path / "report.json").read_text())
    assert answers == EXPECTED
    assert hits == len(CALLS)  # the saves took turns: each process's signature is in the index, with its own code


@pytest.fixture(scope="module")
def pristine_cache(tmp_path_factory) -> Path:
    """A cache of the kernel for CALLS[0] (data file 1) and CALLS[2] (data file 2) in ours/, and one for CALLS[0]
    compiled from other sources (another digest of graphmax's modules) in theirs/, and by another numba in old/."""
    root = tmp_path_factory.mktemp("kernel-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(numba.config, "CACHE_DIR", None)
        kernel = _fresh_kernel(root / "ours")
        kernel(*CALLS[0]), kernel(*CALLS[2])
        with pytest.MonkeyPatch.context() as other_numba:
            other_numba.setattr(numba, "__version__", "0.58.1")
            _fresh_kernel(root / "old")(*CALLS[0])
        patch.setattr(numba_cache, "_sources_digest", lambda: "0" * 64)
        _fresh_kernel(root / "theirs")(*CALLS[0])
    return root


def _cache_file(cache: Path, number: int | None) -> Path:
    """Data file ``number`` of the kernel's cache, or its index (None)."""
    files = [path for path in cache.rglob("*") if path.is_file() and not path.name.endswith(".lock")]
    return next(path for path in files if (match := DATA_FILE.search(path.name)) and int(match[1]) == number
                or number is None and not match)


def _swap(first: Path, second: Path) -> None:
    first_bytes = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(first_bytes)


DAMAGE = {  # each takes the folder of the cache to damage and the folder holding the other caches
    "truncated": lambda ours, other: (f := _cache_file(ours, 1)).write_bytes(f.read_bytes()[:5000]),
    "emptied": lambda ours, other: _cache_file(ours, 1).write_bytes(b""),
    "garbled": lambda ours, other: _cache_file(ours, 1).write_bytes(b"\x80\x05\x95" + b"\xff" * 8 + b"x" * 99),
    "swapped": lambda ours, other: _swap(_cache_file(ours, 1), _cache_file(ours, 2)),
    "from other sources": lambda ours, other: shutil.copyfile(_cache_file(other / "theirs", 1), _cache_file(ours, 1)),
    "from another numba": lambda ours, other: shutil.copyfile(_cache_file(other / "old", 1), _cache_file(ours, 1)),
    "garbled index": lambda ours, other: _cache_file(ours, None).write_bytes(b"\x80\x05\x95" + b"\xff" * 8),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_or_foreign_cache_file_is_compiled_again_never_run(damage, pristine_cache, tmp_path, monkeypatch):
    # numba unpickled any file: a truncated or emptied one raised UnpicklingError or EOFError, a garbled one
    # OverflowError, on every run; a swapped one ran the other type's code (answering 2 for 1), and one compiled
    # from other sources or by another numba was loaded as if current
    monkeypatch.setattr(numba.config, "CACHE_DIR", None)
    shutil.copytree(pristine_cache, tmp_path, dirs_exist_ok=True)
    DAMAGE[damage](tmp_path / "ours", tmp_path)
    kernel = _fresh_kernel(tmp_path / "ours")
    assert _outputs(kernel, [CALLS[2], CALLS[0]]) == [EXPECTED[2], EXPECTED[0]]
    damaged = [CALLS[0], CALLS[2]] if damage in ("swapped", "garbled index") else [CALLS[0]]
    assert all(kernel.stats.cache_misses[tuple(numba.typeof(a) for a in call)] == 1 for call in damaged)
    healed = _fresh_kernel(tmp_path / "ours")  # the compiled code replaced the damaged file
    assert _outputs(healed, [CALLS[2], CALLS[0]]) == [EXPECTED[2], EXPECTED[0]]
    assert sum(healed.stats.cache_hits.values()) == 2


def _run_where_no_file_can_be_written(cache: Path, out: Path) -> None:
    # as on a full disk: a file-size limit of 0 makes every write of a byte fail (EFBIG); the limit is lifted
    # to write the report
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answers = _outputs(_fresh_kernel(cache), CALLS)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out.write_text(json.dumps([answers, [str(w.message) for w in caught]]))


def test_a_cache_that_cannot_be_written_means_an_uncached_run_and_one_warning(tmp_path):
    # numba's save raised the OSError, and `graphmax generate` ended in "no space left on device"
    cache = tmp_path / "cache"
    assert _in_child(_run_where_no_file_can_be_written, cache, tmp_path / "report.json") == 0
    answers, messages = json.loads((tmp_path / "report.json").read_text())
    assert answers == EXPECTED
    assert len(messages) == 1 and messages[0].startswith("graphmax cannot write its kernel cache in ")
    assert "NUMBA_CACHE_DIR" in messages[0] and "\n" not in messages[0]
    # nothing half-written, no temporary file left: only the (empty) lock file
    assert [path.name for path in cache.rglob("*") if path.is_file()] == ["graphmax-kernels.lock"]


def test_with_no_folder_writable_the_kernels_run_uncached_with_one_warning(tmp_path):
    # numba refused to decorate a cached kernel when every folder it would cache in was read-only, so importing
    # graphmax failed: "RuntimeError: cannot cache function '_first_below': no locator available"
    site = tmp_path / "site"
    _copy_packages(site)
    for folder in {path.parent for path in site.rglob("*.py")}:
        (folder / "__pycache__").write_text("")  # a file where numba would make its folder: not writable
    (tmp_path / "home").write_text("")  # nor is ~/.cache under it, nor the NUMBA_CACHE_DIR the user chose
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1",
           "NUMBA_CACHE_DIR": str(tmp_path / "home" / "numba")}
    env.pop("XDG_CACHE_HOME", None)
    code = ("import numpy as np; from gm_graphs.format import validate; v = np.array([3.0, 2.2, 1.0]); "
            "print([validate._first_below(*call) for call in [(v, 2), (v.astype(np.int32), 2), (v, 2.5)]])")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == str(EXPECTED)
    warnings_shown = [line for line in out.stderr.splitlines() if "Warning" in line]
    assert len(warnings_shown) == 1
    assert f"graphmax cannot write its kernel cache in {tmp_path / 'home' / 'numba'}" in warnings_shown[0]


NESTED = '''
import numba
import numpy as np

from gm_graphs.store.kernel_cache import ensure_cache_dir

ensure_cache_dir()


@numba.njit(cache=True, parallel=True)
def inner(x):
    out = np.zeros(x.size)
    for i in numba.prange(x.size):
        out[i] = x[i] * 2
    return out


@numba.njit(cache=True)
def outer(x):
    return inner(x).sum()
'''


def test_a_kernel_cached_after_loading_its_parallel_callee_from_the_cache_runs_from_the_cache(tmp_path):
    # context_kernel.reference_rows (serial) calls _fill_rows (parallel): a process that loaded _fill_rows from the
    # cache and compiled reference_rows cached it without the step that launches numba's threads, and every later
    # process that loaded it from the cache died of SIGSEGV in _fill_rows' parallel region (numba issue 8578)
    site = tmp_path / "site"
    _copy_packages(site)
    (site / "gm_graphs" / "store" / "nested_probe.py").write_text(NESTED)  # a module that imports no torch
    (tmp_path / "home").mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    prelude = "import numpy as np; from gm_graphs.store import nested_probe as m; x = np.arange(5, dtype=np.float32); "
    steps = ["print(m.inner(x).sum())",  # the callee compiled and cached
             "print(m.outer(x), sum(m.inner.stats.cache_hits.values()))",  # callee loaded, caller compiled
             "print(m.outer(x), sum(m.outer.stats.cache_hits.values()))"]  # the caller loaded
    outputs = []
    for step in steps:
        out = subprocess.run([sys.executable, "-c", prelude + step], env=env, cwd=tmp_path, capture_output=True,
                             text=True)
        assert out.returncode == 0, (step, out.returncode, out.stderr[-2000:])
        outputs.append(out.stdout.split())
    assert outputs == [["20.0"], ["20.0", "1"], ["20.0", "1"]]


# ---- cache folders another user could write (issue 57, item 2): each case run as another user -----------------------

VICTIM, ATTACKER = 65534, 65533  # the user graphmax runs as, and another local user


class _Payload:
    """What a planted index unpickles to: it runs ``os.mkdir(marker)``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture()
def shared(tmp_path_factory):
    """A folder under /tmp that another user can reach (pytest's own are root's alone), with ``reports/`` and
    ``markers/`` that anyone may write; removed afterwards."""
    if os.getuid() != 0:
        pytest.skip("running as another user needs root")
    import tempfile

    for call in CALLS:  # numba's lazy imports done here: the other user may not read this Python's folder
        numba.njit(validate._first_below.py_func)(*call)
    base = Path(tempfile.mkdtemp(prefix="gm-cache-trust-"))
    base.chmod(0o755)
    for name in ("reports", "markers"):
        (base / name).mkdir(mode=0o777)
        (base / name).chmod(0o777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _fork_as_user(uid: int, run) -> int:
    """The pid of a forked child that becomes user ``uid`` and runs ``run()``: exit code 0 when it returned."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            run()
            code = 0
        except BaseException:  # noqa: BLE001 - reported on the child's stderr
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _as_user(uid: int, run, seconds: float = 120) -> int | None:
    """``run()`` as user ``uid`` (:func:`_fork_as_user`): its exit code, or None when it was still running after
    ``seconds`` (then killed)."""
    pid = _fork_as_user(uid, run)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _victim_runs(report: Path, make_kernel, calls: list[tuple], setup=None):
    """What the victim's process does: graphmax's once-per-process state as a new process has it, then the kernel
    made and called; its answers, cache hits and warnings written to ``report``."""
    from gm_graphs.store import sealed

    def run():
        numba_cache._distrust_warned = False
        numba_cache._unwritable = set()
        sealed._warned = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if setup is not None:
                setup()
            kernel = make_kernel()
            answers = _outputs(kernel, calls)
        report.write_text(json.dumps([answers, sum(kernel.stats.cache_hits.values()),
                                      [str(w.message) for w in caught]]))
    return run


def _probe(cache: Path) -> tuple[Path, tuple]:
    """Where the index of validate._first_below goes under NUMBA_CACHE_DIR=cache, and its seal's identity."""
    numba.config.CACHE_DIR = str(cache)
    probe = numba.njit(cache=True)(validate._first_below.py_func)._cache
    return Path(probe._cache_path) / f"{probe._impl.filename_base}.gmi", probe._cache_file._identity


def _planted(path: Path, identity: tuple, marker: Path) -> None:
    from gm_graphs.store.sealed import seal

    path.write_bytes(seal(identity, pickle.dumps(_Payload(marker))))  # anyone can compute a seal
    path.chmod(0o644)


def _kernel_cached_in(cache: Path):
    """The probe kernel, cached in ``cache`` (what each victim's process compiles and calls)."""
    numba.config.CACHE_DIR = str(cache)
    return numba.njit(cache=True)(validate._first_below.py_func)


def test_a_world_writable_numba_cache_dir_is_never_read_not_even_a_root_owned_index_hard_linked_into_it(
        shared, monkeypatch):
    # a file's own check passed (root's, not writable by others), so the planted index ran its pickle: another
    # user hard-links a root-owned file where graphmax looks (fs.protected_hardlinks=0 allows it)
    monkeypatch.setattr(numba.config, "CACHE_DIR", None)
    cache = shared / "numba"
    cache.mkdir()
    index, identity = _probe(cache)
    cache.chmod(0o777)
    index.parent.chmod(0o777)
    marker = shared / "markers" / "payload-ran"
    root_owned = shared / "root-owned.bin"
    _planted(root_owned, identity, marker)
    os.link(root_owned, index)
    report = shared / "reports" / "victim.json"

    kernel = functools.partial(_kernel_cached_in, cache)

    assert _as_user(VICTIM, _victim_runs(report, kernel, CALLS)) == 0
    answers, hits, messages = json.loads(report.read_text())
    assert answers == EXPECTED and hits == 0 and not marker.exists()
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert messages[0].startswith(f"graphmax does not cache its kernels in {index.parent}: ")
    assert "every user may write it (mode 0777)" in messages[0] and "NUMBA_CACHE_DIR" in messages[0]
    assert sorted(p.name for p in index.parent.iterdir()) == [index.name]  # nothing written there either


def test_a_kernel_subfolder_another_user_made_a_symlink_is_not_followed(shared, monkeypatch):
    # in a shared (sticky) NUMBA_CACHE_DIR another user made the kernel's subfolder a symlink to the victim's own
    # folder, and graphmax wrote its cache there; without the link the victim caches in a subfolder of its own
    monkeypatch.setattr(numba.config, "CACHE_DIR", None)
    cache = shared / "numba"
    cache.mkdir()
    index, _ = _probe(cache)
    shutil.rmtree(index.parent)
    cache.chmod(0o1777)
    victims = shared / "victims-folder"
    victims.mkdir()
    os.chown(victims, VICTIM, VICTIM)
    index.parent.symlink_to(victims)
    os.lchown(index.parent, ATTACKER, ATTACKER)
    report = shared / "reports" / "victim.json"

    kernel = functools.partial(_kernel_cached_in, cache)

    assert _as_user(VICTIM, _victim_runs(report, kernel, CALLS)) == 0
    answers, hits, messages = json.loads(report.read_text())
    assert answers == EXPECTED and list(victims.iterdir()) == []
    assert len(messages) == 1 and "symlink that another user could have made" in messages[0], messages
    index.parent.unlink()  # a sticky folder anyone may write, and no attack: cached in the victim's own subfolder
    for _ in range(2):
        assert _as_user(VICTIM, _victim_runs(report, kernel, CALLS)) == 0
    answers, hits, messages = json.loads(report.read_text())
    assert answers == EXPECTED and hits == len(CALLS) and messages == []
    st = os.lstat(index.parent)
    assert st.st_uid == VICTIM and stat.S_IMODE(st.st_mode) == 0o755
    assert stat.S_IMODE(os.stat(index.parent / numba_cache._LOCK).st_mode) == 0o600  # no one else may lock it


def _hold_forever(lock: Path, held: Path) -> None:
    import fcntl

    fd = os.open(lock, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.write_text("")
    time.sleep(3600)


def test_a_lock_another_user_holds_forever_is_waited_for_a_bounded_time_then_the_kernels_run_uncached(
        shared, monkeypatch):
    # _locked took LOCK_EX with no timeout: another user holding graphmax-kernels.lock blocked every save forever
    monkeypatch.setattr(numba.config, "CACHE_DIR", None)
    monkeypatch.setattr(numba_cache, "_LOCK_WAIT_S", 0.5)
    cache = shared / "numba"
    cache.mkdir()
    index, _ = _probe(cache)
    lock = index.parent / numba_cache._LOCK
    lock.write_text("")
    lock.chmod(0o644)  # as an older graphmax made it (0666 under a umask of 022): others could open it
    for path in (cache, index.parent, lock):
        os.chown(path, VICTIM, VICTIM)
    held = shared / "markers" / "held"
    holder = _fork_as_user(ATTACKER, lambda: _hold_forever(lock, held))
    try:
        deadline = time.monotonic() + 30
        while not held.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.exists()
        report = shared / "reports" / "victim.json"

        kernel = functools.partial(_kernel_cached_in, cache)

        assert _as_user(VICTIM, _victim_runs(report, kernel, CALLS), seconds=60) == 0, "blocked on the lock"
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    answers, hits, messages = json.loads(report.read_text())
    assert answers == EXPECTED
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert messages[0].startswith(f"graphmax cannot write its kernel cache in {index.parent} (another process has "
                                  f"held {numba_cache._LOCK} there for over 0.5 s")
    assert not [p for p in index.parent.iterdir() if p.suffix in (".gmi", ".gmc", ".tmp")]


PROBE = '''
import numba


@numba.njit(cache=True)
def first_below(values, bound):
    for i in range(values.size):
        if values[i] < bound:
            return i
    return -1
'''


def test_a_pycache_others_may_write_is_never_read_and_said_once(shared, monkeypatch):
    # graphmax checked that the sources' __pycache__ was writable, not that others could write it too: a planted
    # index there ran its pickle (and Python runs another user's .pyc from there at import)
    import importlib.util

    monkeypatch.setattr(numba.config, "CACHE_DIR", None)
    source = shared / "src"
    source.mkdir(mode=0o755)
    (source / "probe_kernels.py").write_text(PROBE)
    monkeypatch.setattr(numba_cache, "_PACKAGES", (*numba_cache._PACKAGES, source))  # a graphmax kernel folder
    spec = importlib.util.spec_from_file_location("probe_kernels", source / "probe_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    probe = module.first_below._cache
    assert Path(probe._cache_path) == source / "__pycache__"
    (source / "__pycache__").chmod(0o777)
    marker = shared / "markers" / "payload-ran"
    _planted(source / "__pycache__" / f"{probe._impl.filename_base}.gmi", probe._cache_file._identity, marker)
    report = shared / "reports" / "victim.json"
    calls = [(VALUES, 2), (VALUES, 2.5)]

    def setup():  # (in the child: monkeypatch's undoing stays in the parent)
        sys.dont_write_bytecode = True
        numba_cache._PACKAGES = (source,)  # its only sources: the __pycache__ numba would cache in is writable
        numba_cache._pycache_checked = False
        numba_cache.ensure_cache_dir()  # as each kernel module calls it at import

    assert _as_user(VICTIM, _victim_runs(report, lambda: numba.njit(cache=True)(module.first_below.py_func), calls,
                                         setup)) == 0
    answers, hits, messages = json.loads(report.read_text())
    assert answers == [2, 1] and hits == 0 and not marker.exists()
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert messages[0].startswith(f"graphmax does not cache its kernels in {source / '__pycache__'}: it every user "
                                  f"may write it (mode 0777)")
    assert ".pyc" in messages[0]
    assert not [p for p in (source / "__pycache__").iterdir() if p.suffix == ".gmc"]
