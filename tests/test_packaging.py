"""graphmax as its users install it. The wheel built from this checkout holds every module of its three packages
and nothing else, and declares ranges rather than pins. README.md's install line, run into an environment that
cannot see the checkout, gives a graphmax whose every module imports and whose command line runs (``--help``, a
tiny ``build`` with a user's own model's tokenizer, then ``generate`` with that model). An indexed datastore where
faiss is not installed fails in one line that names the fix.

Both builds are made in a copy of the checkout (building in place would leave ``build/`` and ``*.egg-info`` in it).
The environment is a venv that reuses this interpreter's packages (torch and the rest, which meet graphmax's ranges
offline) and gets graphmax only from the install. This interpreter's editable install of the checkout is visible
there too (its finder comes from a ``.pth`` file of the system site-packages), so the test checks where each module
was loaded from.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import numpy as np
import pytest

from gm_graphs import GraphmaxError
from gm_solver.datastore import Datastore

from .own_models import ARCHITECTURES, save_model, sentences

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gm_graphs", "gm_solver", "pipelines")
TIMEOUT_S = 600
INSTALL = "pip install '.[faiss]'"  # README.md's line for installing from a checkout


def not_copied(folder: str, names: list[str]) -> set[str]:
    """What a copy of the checkout leaves out: history, caches, and at the top earlier builds and outputs (not
    ``gm_graphs/build``)."""
    skip = {n for n in names if n in (".git", "__pycache__", ".hypothesis", ".pytest_cache") or n.endswith(".egg-info")}
    return skip | ({"build", "dist", ".venv", "out"} & set(names) if Path(folder) == ROOT else set())


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``cmd``, its output captured; a failure shows the command and the end of what it printed."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)
    assert done.returncode == 0, (f"`{' '.join(map(str, cmd))}` exited with {done.returncode}\n"
                                  f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
    return done


def source_modules() -> set[str]:
    """The checkout's modules of the three packages, as wheel paths (``gm_graphs/build/counts.py``)."""
    return {path.relative_to(ROOT).as_posix() for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            if "__pycache__" not in path.parts}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the checkout: building in it leaves nothing (``build/``, ``*.egg-info``) in the real one."""
    copy = tmp_path_factory.mktemp("checkout") / "graphmax"
    shutil.copytree(ROOT, copy, ignore=not_copied)
    return copy


@pytest.fixture(scope="module")
def wheel(checkout, tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
         str(checkout)])
    (built,) = dist.glob("graphmax-*.whl")
    return built


def test_the_wheel_holds_every_module_and_declares_ranges(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    modules = {n for n in names if not n.startswith(f"{info}/")}
    expected = source_modules()
    assert len(expected) > 60, f"only {len(expected)} modules found under {ROOT}: the packages moved"
    assert modules == expected, (f"{wheel.name}: missing {sorted(expected - modules)}, "
                                 f"not in the packages' sources {sorted(modules - expected)}")
    assert re.search(r"^graphmax = pipelines\.cli:main$", entry_points, re.MULTILINE), entry_points
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata, re.MULTILINE)
    pinned = [r for r in requires if "==" in r.split(";")[0]]  # (a marker reads `extra == "faiss"`)
    assert not pinned, f"pins in the wheel's requirements (constraints.txt holds the exact versions): {pinned}"
    torch = next(r for r in requires if re.match(r"torch\b", r))
    assert ">=" in torch and "<" in torch, f"torch must be a range, got {torch!r}"
    faiss = [r for r in requires if r.startswith("faiss")]
    assert faiss and all('extra == "faiss"' in r for r in faiss), f"faiss-cpu only through the extra: {faiss}"


@pytest.mark.slow  # about 35 s of CPU: every module imported, then four commands, each a fresh interpreter
def test_the_readmes_install_runs_without_the_checkout(checkout, tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"\n{INSTALL}  " in readme, f"README.md no longer shows `{INSTALL}`, the line this test runs"
    env_dir, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python, graphmax = env_dir / "bin" / "python", env_dir / "bin" / "graphmax"
    # the README's line, offline: this interpreter's pip, into the venv, built with the setuptools at hand, every
    # requirement met by this interpreter's packages (a range they fall outside of fails here)
    run([sys.executable, "-m", "pip", "--python", str(python), *shlex.split(INSTALL)[1:], "--no-build-isolation",
         "--no-index", "-q"], cwd=checkout)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_CACHE_DIR")}
    env["GRAPHMAX_HOME"] = str(tmp_path / "home")
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=work,
               env=env).stdout.strip()

    names = sorted(path[:-3].replace("/", ".").removesuffix(".__init__") for path in source_modules())
    check = ("import importlib, json, sys; "
             "print(json.dumps({n: importlib.import_module(n).__file__ for n in sys.argv[1:]}))")
    files = json.loads(run([str(python), "-c", check, *names], cwd=work, env=env).stdout)
    outside = {n: f for n, f in files.items() if not Path(f).resolve().is_relative_to(Path(site).resolve())}
    assert not outside, f"modules not loaded from the install in {site}: {outside}"

    help_text = run([str(graphmax), "--help"], cwd=work, env=env).stdout
    assert all(command in help_text for command in ("build", "generate", "tune")), help_text

    model = save_model(ARCHITECTURES[0], work / "model")  # a Llama with its own byte-level BPE
    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(sentences(60, seed=1)) + "\n")
    built = run([str(graphmax), "build", str(corpus), "--tokenizer", str(model), "--path", str(work / "graph")],
                cwd=work, env=env)
    assert (work / "graph" / "manifest.json").is_file(), f"graphmax build wrote no graph:\n{built.stdout}{built.stderr}"
    # λ = 0: the decoder is the softmax, so its greedy text is the plain one; no decoding kernel compiles here (the
    # build above compiled and cached its kernels inside the venv), which keeps the test short
    generated = run([str(graphmax), "generate", "--model", str(model), "--path", str(work / "graph"), "--prompt",
                     "The patient", "--max-new-tokens", "4", "--lam", "0", "--compare"], cwd=work, env=env).stdout
    texts = re.findall(r"^  (softmax|context graphmax) +: (.*)$", generated, re.MULTILINE)
    assert len(texts) == 2 and texts[0][1] == texts[1][1], f"graphmax generate at λ = 0:\n{generated}"


def test_an_indexed_datastore_without_faiss_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` raises ImportError
    keys = np.random.default_rng(0).standard_normal((10, 6)).astype(np.float32)
    ivf = (keys[[0, 5]], np.array([0, 5, 10]))  # two lists of five keys each
    with pytest.raises(GraphmaxError, match=r"pip install 'graphmax\[faiss\]'.*faiss-gpu") as caught:
        Datastore(keys, np.arange(10), 10, ivf=ivf)
    assert "\n" not in str(caught.value)
