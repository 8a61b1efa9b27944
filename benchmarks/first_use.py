"""A user's first minute after installing graphmax's wheel: the command line's refusal of a bad argument, the
demo's graph built, the first decode and the later ones, the model's load cold and cached, then the demo's own
table. Prints a table with the machine's load average; not a test.

    python3 benchmarks/first_use.py [--warm 2] [--tokens 24] [--repeat 5] [--errors-only]

The wheel is built from this checkout by this interpreter's pip (offline with its own setuptools where that meets
pyproject.toml's build requirement, else with pip's build isolation) and installed, without its dependencies, into a
fresh venv that sees this interpreter's installed packages (torch and the rest: a ``.pth`` file adds their folders),
so that graphmax itself, its kernel caches beside its sources and every cache it writes start empty. Every command
is a fresh process run from an empty folder, with a fresh ``GRAPHMAX_HOME`` and ``NUMBA_CACHE_DIR``; the wall time
is the user's, interpreter start-up and imports included:

- "argument error": each command refusing a bad argument (:data:`ARGUMENT_ERRORS`), before torch is imported: the
  median of ``--repeat`` runs (``--errors-only`` stops after these rows);
- "demo graph": the bundled movie reviews' graph (``pipelines.demo.ensure_imdb_graph``), built once;
- "generate": ``graphmax generate --graph imdb --prompt P --max-new-tokens N --device cpu``, the default decoder;
  the first run finds no kernel or model cache, the later ones what the earlier ones left (a background compile
  that the first started may still be running, and the resident process it left behind may still be importing);
  then, once that compile has ended, one more ("compiled"), and one with ``GRAPHMAX_RESIDENT=0`` (in its own
  process); the note says where each ran;
- "load_model": ``pipelines.models.load_model("smollm2")`` in a home of its own, converting the GGUF once, then
  from the model cache: the process' wall time, and beside it the seconds of torch's and transformers' imports
  (``import_model_libraries``, as a program that loads a model has done) and of the call after them;
- "demo": ``graphmax demo``, whose rows are printed below the table.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import site
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import venv
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PROMPT = "This movie"
# a refusal of each command, by its arguments alone (the corpus named need not exist: another argument is refused
# first, or the missing file is the refusal)
ARGUMENT_ERRORS = [
    ("graphmax (no command)", []),
    ("build --orders 0", ["build", "reviews.csv", "--tokenizer", "smollm2", "--name", "g", "--orders", "0"]),
    ("build, missing corpus", ["build", "missing.csv", "--tokenizer", "smollm2", "--name", "g"]),
    ("merge --mixture 1", ["merge", "a", "b", "--name", "m", "--mixture", "1"]),
    ("graphs info (no graph named)", ["graphs", "info"]),
    ("datastore --device tpu", ["datastore", "--corpus", "reviews.csv", "--out", "ds", "--device", "tpu"]),
    ("datastore, missing corpus", ["datastore", "--corpus", "missing.csv", "--out", "ds"]),
    ("eval --device mps", ["eval", "--device", "mps"]),
    ("generate --device tpu", ["generate", "--graph", "imdb", "--prompt", PROMPT, "--device", "tpu"]),
    ("generate, missing graph", ["generate", "--graph", "missing", "--prompt", PROMPT]),
    ("eval, missing corpus", ["eval", "--corpus", "missing.csv"]),
    ("tune --docs 0", ["tune", "imdb", "--corpus", "reviews.csv", "--docs", "0"]),
    ("demo --device mps", ["demo", "--device", "mps"]),
]
# torch and transformers imported first (as a program that loads a model has them), then the call: both timed
LOAD = ("import time; from pipelines.models import import_model_libraries, load_model; t0 = time.perf_counter(); "
        "import_model_libraries(); t1 = time.perf_counter(); load_model('smollm2', device='cpu', dtype='float32'); "
        "print(f'{t1 - t0:.2f} {time.perf_counter() - t1:.2f}')")


def _setuptools_builds_it() -> bool:
    """Whether this interpreter's packages meet pyproject.toml's ``[build-system] requires``."""
    requires = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["build-system"]["requires"]
    for requirement in map(Requirement, requires):
        try:
            if not requirement.specifier.contains(version(requirement.name), prereleases=True):
                return False
        except PackageNotFoundError:
            return False
    return True


def build_wheel(dist: Path) -> Path:
    """The checkout's wheel in ``dist``, never built with a base interpreter's setuptools seen from a venv."""
    offline = ["--no-build-isolation", "--no-index"] if _setuptools_builds_it() else []
    with tempfile.TemporaryDirectory(prefix="graphmax-first-use-src-") as tmp:
        src = Path(tmp) / "graphmax"  # a copy: building in place would leave build/ and *.egg-info in the checkout
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        for name in filter(None, files.decode().split("\0")):
            if (REPO / name).is_file():
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                (src / name).write_bytes((REPO / name).read_bytes())
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *offline, "-q", "-w", str(dist), str(src)],
                       check=True)
    (wheel,) = dist.glob("graphmax-*.whl")
    return wheel


def make_venv(env_dir: Path, wheel: Path) -> Path:
    """A venv seeing this interpreter's installed packages after its own, with the wheel installed; its bin/."""
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    folders = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    lines = [f"import site; site.addsitedir({f!r})" for f in dict.fromkeys(folders) if f in sys.path]
    (Path(purelib) / "zz_graphmax_first_use_parent_packages.pth").write_text("\n".join(lines) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True)
    where = subprocess.run([str(python), "-c", "import gm_solver; print(gm_solver.__file__)"], cwd=env_dir,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(Path(purelib).resolve()):
        raise SystemExit(f"graphmax is imported from {where}, not from the wheel installed in {purelib}")
    return env_dir / "bin"


def timed(cmd: list[str], env: dict, cwd: Path, fails: bool = False) -> tuple[float, str, str]:
    """Wall seconds of ``cmd`` and its stdout and stderr; it must succeed, or fail where ``fails``."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if (done.returncode != 0) != fails:
        raise SystemExit(f"`{shlex.join(cmd)}` exited with {done.returncode}\n{done.stdout[-2000:]}"
                         f"{done.stderr[-2000:]}")
    return seconds, done.stdout, done.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", type=int, default=2, help="generate runs after the first (default 2)")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per generate (default 24)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each argument error, the median shown (default 5)")
    ap.add_argument("--errors-only", action="store_true", help="stop after the argument errors")
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="graphmax-first-use-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        wheel = build_wheel(tmp / "dist")
        rows.append(("wheel built (pip wheel)", time.perf_counter() - t0, wheel.name))
        t0 = time.perf_counter()
        bin_ = make_venv(tmp / "venv", wheel)
        rows.append(("fresh venv, wheel installed", time.perf_counter() - t0, "--no-deps --no-index"))
        work = tmp / "work"
        work.mkdir()
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "NUMBA_CACHE_DIR", "GRAPHMAX_HOME", "GRAPHMAX_RESIDENT")}
        # TMPDIR: the background compile's lock (gm_solver.backends.compile_lock) is this run's, not the user's
        (tmp / "tmp").mkdir()
        env |= {"GRAPHMAX_HOME": str(tmp / "home"), "NUMBA_CACHE_DIR": str(tmp / "numba"), "TQDM_DISABLE": "1",
                "TMPDIR": str(tmp / "tmp")}
        graphmax, python = str(bin_ / "graphmax"), str(bin_ / "python")

        for label, argv in ARGUMENT_ERRORS:
            runs = [timed([graphmax, *argv], env, work, fails=True) for _ in range(args.repeat)]
            line = runs[-1][2].strip().splitlines()[-1] if runs[-1][2].strip() else ""
            if not (line.startswith(f"graphmax {argv[0]}" if argv else "graphmax") and ": error: " in line):
                raise SystemExit(f"`graphmax {shlex.join(argv)}` did not refuse its arguments in one line:\n"
                                 f"{runs[-1][2][-2000:]}")
            rows.append((f"argument error: {label}", statistics.median(s for s, _, _ in runs), line[:70]))
        if args.errors_only:
            _print(rows, load_before, os.getloadavg(), args.repeat)
            return
        s, _, _ = timed([python, "-c", "from pipelines.demo import ensure_imdb_graph; ensure_imdb_graph()"], env, work)
        rows.append(("demo graph built (movie reviews)", s, "ensure_imdb_graph()"))
        generate = [graphmax, "generate", "--graph", "imdb", "--prompt", PROMPT, "--max-new-tokens",
                    str(args.tokens), "--device", "cpu"]

        def decode(label: str, resident: bool = True) -> None:
            before = served(tmp / "home")
            s, out, err = timed(generate, env | ({} if resident else {"GRAPHMAX_RESIDENT": "0"}), work)
            said = next((line.strip() for line in (out + err).splitlines() if "warm-up" in line), "")
            where = "in the resident; " if served(tmp / "home") > before else "in its own process; "
            rows.append((f"generate {args.tokens} tokens, {label}", s, where + said[:60]))

        for i in range(1 + args.warm):
            decode("cold" if i == 0 else f"warm {i}")
        rows.append(("background compile: waited for its end", wait_for_compile(tmp / "tmp"), "after the runs above"))
        decode("compiled")
        decode("compiled, no resident", resident=False)

        model_env = env | {"GRAPHMAX_HOME": str(tmp / "home-model")}
        for label in ("cold (converts the GGUF)", "cached"):
            s, out, _ = timed([python, "-c", LOAD], model_env, work)
            imports, call = out.strip().splitlines()[-1].split()
            rows.append((f"load_model smollm2, {label}", s, f"torch+transformers {imports} s, then the call {call} s"))

        s, demo, _ = timed([graphmax, "demo"], env, work)
        rows.append(("graphmax demo (graph built already)", s, ""))
        wait_for_compile(tmp / "tmp")  # one the demo started writes into this folder: it ends before the folder goes
        subprocess.run([python, "-m", "pipelines.resident", "stop"], env=env, cwd=work, check=True,
                       capture_output=True)
    _print(rows, load_before, os.getloadavg(), args.repeat)
    print("\ngraphmax demo printed:")
    print(demo.rstrip())


def served(home: Path) -> int:
    """How many commands the residents of ``home`` have run (their logs' lines)."""
    return sum(line.endswith(": graphmax generate") for log in (home / "run").glob("*.log")
               for line in log.read_text().splitlines())


def wait_for_compile(tmpdir: Path) -> float:
    """Seconds until no background compile holds its lock in ``tmpdir`` (``python -m pipelines.warm --background``
    takes it exclusively while it compiles)."""
    t0 = time.perf_counter()
    for lock in tmpdir.glob("graphmax-warm-*.lock"):
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
    return time.perf_counter() - t0


def _print(rows: list[tuple[str, float, str]], load_before: tuple, load_after: tuple, repeat: int) -> None:
    print(f"graphmax's first use from its wheel: {os.cpu_count()} CPUs, load average (1, 5, 15 min) "
          f"{' '.join(f'{x:.2f}' for x in load_before)} before, {' '.join(f'{x:.2f}' for x in load_after)} after; "
          f"argument errors: the median of {repeat} runs")
    print(f"{'step (fresh process each)':<44} {'wall, s':>8}  note")
    for label, seconds, note in rows:
        print(f"{label:<44} {seconds:8.2f}  {note}")


if __name__ == "__main__":
    main()
