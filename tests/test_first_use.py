"""A user's first minute (issue 56): argument errors before torch loads, the demo's rows timed after each has run
once, and a first decode that does not wait for numba's compiling, where the kernels of its own decoder are not
in the kernel cache (read from graphmax's sealed files, a damaged one a miss)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gm_graphs.format import validate
from gm_graphs.store import kernel_cache
from gm_graphs.store.sealed import seal
from gm_solver import backends
from pipelines import demo

ROOT = Path(__file__).resolve().parents[1]
# runs the CLI, then says on stderr's last line whether torch or transformers had been imported by then
PROBE = ("import atexit, sys\n"
         "atexit.register(lambda: print('imported:', sorted({'torch', 'transformers'} & set(sys.modules)), "
         "file=sys.stderr))\n"
         "from pipelines.cli import main\n"
         "sys.exit(main())\n")


@pytest.mark.parametrize(("argv", "says"), [
    (["demo", "--device", "mps"], "--device 'mps': graphmax runs on 'cpu' or 'cuda' devices"),
    (["demo", "--device", "gpu0"], "--device 'gpu0' is not a device torch knows"),
    (["demo", "--device", "cpu:1"], "--device 'cpu:1': the CPU is one device"),
    (["demo", "--dtype", "nope"], "argument --dtype: invalid choice: 'nope'"),
    (["demo", "--device", "cpu", "--dtype", "float16"], "--dtype float16 on the CPU is slow"),
    (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
    (["demo", "--device", "cuda"], "--device 'cuda' but CUDA is not available here")])
def test_an_argument_error_comes_before_torch_and_transformers_are_imported(argv, says):
    if argv[-1] == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    error, imported = done.stderr.splitlines()
    assert done.returncode == 2 and error.startswith(f"graphmax {argv[0]}: error: ") and says in error, done.stderr
    assert imported == "imported: []", f"{argv}: {imported}"


def test_the_demo_times_every_row_only_after_every_row_has_run_once():
    calls = []

    def run(model, tok, prompts, *, max_new_tokens, processor, do_sample, seed):
        calls.append((processor, do_sample, max_new_tokens))
        return [f"{processor} {do_sample}"] * len(prompts), float(len(calls))

    rows = [(mode, label) for mode in ("greedy", "sampled") for label in ("softmax", "paper", "context")]
    timed = demo.decode_rows(None, None, rows, lambda mode, label: dict(processor=label, do_sample=mode == "sampled",
                                                                        seed=0), 24, run=run)
    every = [(label, mode == "sampled") for mode, label in rows]
    assert [c[:2] for c in calls] == every[::-1] + every  # each row once, last first; then each timed, first first
    assert [c[2] for c in calls] == [2] * len(rows) + [24] * len(rows)
    assert list(timed) == rows and [ms for _, ms in timed.values()] == list(range(len(rows) + 1, 2 * len(rows) + 1))


def test_choose_decodes_with_torch_and_compiles_in_the_background_where_numba_has_not(monkeypatch, tmp_path,
                                                                                      capsys):
    cpu = torch.device("cpu")
    started = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(started)!r}, 'w').close()"]
    monkeypatch.setattr(backends, "_kernels_cached", lambda kernels: False)
    assert backends.choose(cpu) == "numba"  # outside the block: numba, compiled where it is first called
    with backends.compile_in_background(command):
        assert [backends.choose(cpu) for _ in range(3)] == ["torch"] * 3
        assert backends.choose(cpu, "numba") == "numba"  # asked for by name: as asked
    assert backends.choose(cpu) == "numba"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "decodes with torch on the CPU" in err and "compile in the background" in err
    for _ in range(600):  # the detached process, started once
        if started.exists():
            break
        subprocess.run(["sleep", "0.1"])
    assert started.exists()
    monkeypatch.setattr(backends, "_kernels_cached", lambda kernels: True)
    with backends.compile_in_background([sys.executable, "-c", "raise SystemExit(1)"]):
        assert backends.choose(cpu) == "numba"
    assert capsys.readouterr().err == ""


def test_a_run_takes_numba_where_its_own_decoders_kernels_are_cached_whatever_another_decoders_are(
        monkeypatch, capsys):
    from gm_solver.backends import numba as room

    cpu = torch.device("cpu")
    cached = {id(room.context.decode_step)}  # the context decoder's step compiled; the paper decoder's kernels not
    monkeypatch.setattr(kernel_cache, "kernel_cached", lambda kernel: id(kernel) in cached)
    command = [sys.executable, "-c", "pass"]
    with backends.compile_in_background(command, kernels=("context.decode_step",)):
        assert backends.choose(cpu) == "numba"
    assert capsys.readouterr().err == ""
    with backends.compile_in_background(command, kernels=("csr.product", "mirror.start_rows")):
        assert backends.choose(cpu) == "torch"
    assert "decodes with torch on the CPU" in capsys.readouterr().err
    with backends.compile_in_background(command):  # every decoder's kernels, as before
        assert backends.choose(cpu) == "torch"
    cached |= {id(room.csr.product), id(room.mirror.start_rows)}
    with backends.compile_in_background(command):
        assert backends.choose(cpu) == "numba"


@pytest.fixture
def threads():
    """torch's threads set to 2 for the test, and put back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def _held(lock: Path) -> subprocess.Popen:
    """Another process holding ``lock`` as a background compile does (flock, exclusive), until killed."""
    child = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                              f"f = open({str(lock)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                              "print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "held\n"
    return child


def test_torch_and_numba_leave_a_core_to_a_compile_running_beside_and_take_it_back_after(monkeypatch, tmp_path,
                                                                                        threads):
    lock = tmp_path / "warm.lock"
    monkeypatch.setattr(backends, "compile_lock", lambda: lock)
    monkeypatch.setattr(backends, "_kernels_cached", lambda kernels: True)
    fewer = max(1, min(threads, os.cpu_count()) - 1)
    numba_threads = numba.get_num_threads()
    numba_fewer = max(1, min(numba_threads, os.cpu_count()) - 1)
    command = [sys.executable, "-c", "pass"]
    with backends.compile_in_background(command):  # no compile beside: every thread
        assert (torch.get_num_threads(), numba.get_num_threads()) == (threads, numba_threads)
    lock.touch()
    with backends.compile_in_background(command):  # the lock's file left by a compile that has ended
        assert (torch.get_num_threads(), numba.get_num_threads()) == (threads, numba_threads)
    child = _held(lock)
    try:
        with backends.compile_in_background(command):  # an earlier run's compile still running
            assert (torch.get_num_threads(), numba.get_num_threads()) == (fewer, numba_fewer)
            assert backends.choose(torch.device("cpu")) == "numba"  # its kernels cached: decoding beside it
    finally:
        child.kill()
        child.wait()
    assert (torch.get_num_threads(), numba.get_num_threads()) == (threads, numba_threads)
    # this run starts the compile: a core fewer from then on, every thread again after the block
    monkeypatch.setattr(backends, "_kernels_cached", lambda kernels: False)
    with backends.compile_in_background(command):
        assert torch.get_num_threads() == threads
        assert backends.choose(torch.device("cpu")) == "torch"
        assert torch.get_num_threads() == fewer
    assert torch.get_num_threads() == threads


def test_a_core_is_left_once_when_a_compile_runs_and_this_run_starts_another(monkeypatch, tmp_path):
    lock = tmp_path / "warm.lock"
    monkeypatch.setattr(backends, "compile_lock", lambda: lock)
    monkeypatch.setattr(backends, "_kernels_cached", lambda kernels: False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    child = _held(lock)
    try:
        with backends.compile_in_background([sys.executable, "-c", "pass"]):
            assert torch.get_num_threads() == 7  # an earlier run's compile holds the lock
            assert backends.choose(torch.device("cpu")) == "torch"  # and this run starts one (which leaves at once)
            assert torch.get_num_threads() == 7  # one core for the compiles, not two
        assert torch.get_num_threads() == 8
    finally:
        child.kill()
        child.wait()
        torch.set_num_threads(before)


@pytest.mark.parametrize("taken_by", ["fifo", "link", "folder"])
def test_a_lock_path_taken_by_something_else_is_no_compile_and_never_waited_on(monkeypatch, tmp_path, threads,
                                                                                taken_by):
    from pipelines import warm

    lock = tmp_path / "warm.lock"
    if taken_by == "fifo":
        os.mkfifo(lock)  # opened without O_NONBLOCK, a FIFO with no writer would hang the command
    elif taken_by == "link":
        (tmp_path / "elsewhere").touch()
        lock.symlink_to(tmp_path / "elsewhere")
    else:
        lock.mkdir()
    monkeypatch.setattr(backends, "compile_lock", lambda: lock)
    monkeypatch.setattr(backends, "_kernels_cached", lambda kernels: True)
    with backends.compile_in_background([sys.executable, "-c", "pass"]):
        assert torch.get_num_threads() == threads
    compiled = []
    monkeypatch.setattr(os, "nice", lambda n: 0)
    monkeypatch.setattr(warm, "warm_kernels", lambda workers: compiled.append(workers))
    warm.warm_in_background()  # the background compile leaves without compiling, and without waiting
    assert compiled == []


def test_one_background_compile_at_a_time(monkeypatch, tmp_path):
    from pipelines import warm

    lock = tmp_path / "warm.lock"
    monkeypatch.setattr(backends, "compile_lock", lambda: lock)
    compiled = []
    monkeypatch.setattr(os, "nice", lambda n: 0)
    monkeypatch.setattr(warm, "warm_kernels", lambda workers: compiled.append(backends._compiling()))
    warm.warm_in_background()  # no compile running: this one compiles, holding the lock meanwhile
    assert compiled == [True] and lock.is_file() and not backends._compiling()
    child = _held(lock)
    try:
        warm.warm_in_background()  # another is running: this one leaves
    finally:
        child.kill()
        child.wait()
    assert compiled == [True]


@pytest.mark.parametrize(("kernels", "says"), [
    (("context",), "kernels are named 'module.kernel'"),
    (("context.decode_stp",), "'context.decode_stp' is not a kernel of gm_solver.backends.numba"),
    (("lambert.nope",), "'lambert.nope' is not a kernel")])
def test_a_kernel_name_that_is_not_one_is_refused(kernels, says):
    with pytest.raises(ValueError, match=says):
        with backends.compile_in_background([sys.executable, "-c", "pass"], kernels=kernels):
            backends.choose(torch.device("cpu"))


def _kernel_cached_in(cache: Path):
    """A graphmax kernel (validate._first_below) as a new process has it, its cache in ``cache``."""
    numba.config.CACHE_DIR = str(cache)
    return numba.njit(cache=True)(validate._first_below.py_func)


# what a cache file may become: bytes of any kind, a sealed file holding anything, another's permissions, no file
SCALARS = st.none() | st.integers() | st.text(max_size=8) | st.binary(max_size=8)
KEYS = st.integers() | st.text(max_size=4) | st.tuples(SCALARS, SCALARS)  # hashable: what a dict may be keyed by
PAYLOADS = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                        max_leaves=8)
DAMAGE = st.one_of(
    st.tuples(st.just("bytes"), st.binary(max_size=256)),
    st.tuples(st.just("truncated"), st.integers(0, 200)),
    st.tuples(st.just("sealed"), PAYLOADS),
    st.tuples(st.just("mode"), st.sampled_from([0o666, 0o646, 0o000])),
    st.tuples(st.just("gone"), st.none()),
    st.tuples(st.just("folder"), st.none()))


def _restore(good: dict[Path, bytes]) -> None:
    for f, blob in good.items():
        if f.is_dir():
            f.rmdir()
        f.unlink(missing_ok=True)
        f.write_bytes(blob)


def test_a_damaged_or_foreign_cache_is_a_miss_never_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(numba.config, "CACHE_DIR", None)
    assert kernel_cached(_kernel_cached_in(tmp_path / "numba")) is False  # nothing compiled yet
    _kernel_cached_in(tmp_path / "numba")(np.array([3.0, 2.2, 1.0]), 2)  # compiled and saved
    kernel = _kernel_cached_in(tmp_path / "numba")
    assert kernel_cached(kernel) is True
    sealed = kernel_cache._caches[kernel.py_func]._cache_file  # the probe's sealed files
    (key,) = sealed._index()
    index, data = (Path(sealed._path(name)) for name in (f"{sealed._base}.gmi", sealed._index()[key]))
    identities = {index: sealed._identity, data: (*sealed._identity, repr(key))}
    good = {f: f.read_bytes() for f in (index, data)}

    @given(which=st.sampled_from([index, data]), damage=DAMAGE)
    def check(which, damage):
        _restore(good)  # the whole cache, then one of its files damaged
        how, value = damage
        if how == "bytes":
            which.write_bytes(value)
        elif how == "truncated":
            which.write_bytes(good[which][:value])
        elif how == "sealed":  # sealed as graphmax seals (anyone can compute one), holding anything
            which.write_bytes(seal(identities[which], pickle.dumps(value)))
        elif how == "mode":
            which.chmod(value)
        elif how == "gone":
            which.unlink()
        else:
            which.unlink()
            which.mkdir()
        found = kernel_cached(kernel)
        if how == "sealed" and which == data:  # the data file is checked by its seal, not unpickled: a kernel
            assert found in (True, False)       # that fails to load from it compiles when called, as numba does
        else:
            assert found is (how == "mode" and value == 0o000 and os.geteuid() == 0), (how, value, which.name)

    check()
    _restore(good)
    assert kernel_cached(kernel) is True  # each miss above was the damage's, not the check's


def kernel_cached(kernel) -> bool | None:
    """``kernel_cache.kernel_cached``, looked up when called (a test may replace it)."""
    return kernel_cache.kernel_cached(kernel)
