"""A user's first minute (issue 56): argument errors before torch loads, the demo's rows timed after each has run
once, and a first decode that does not wait for numba's compiling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    monkeypatch.setattr(backends, "_kernels_cached", lambda: False)
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
    monkeypatch.setattr(backends, "_kernels_cached", lambda: True)
    with backends.compile_in_background([sys.executable, "-c", "raise SystemExit(1)"]):
        assert backends.choose(cpu) == "numba"
    assert capsys.readouterr().err == ""
