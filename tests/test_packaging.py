"""graphmax as its users install it. The wheel built from this checkout holds every module of its three packages
and nothing else, and declares ranges rather than pins. README.md's install line, run into an environment that
cannot see the checkout, gives a graphmax whose every module imports and whose command line runs (``--help``, a
tiny ``build`` with a user's own model's tokenizer, then ``generate`` with that model). An indexed datastore where
faiss is not installed fails in one line that names the fix.

The wheel is built once, in a copy of the checkout (building in place would leave ``build/`` and ``*.egg-info`` in
it), by this interpreter's pip: with the setuptools this interpreter imports where it meets pyproject.toml's
``[build-system] requires``, else in pip's isolated build environment (setuptools from pip's cache or index), never
with a base interpreter's setuptools seen from inside a venv. README.md's line is that build and then the install of
its wheel; the test installs the wheel, with the line's extras, offline. The environment is a venv that sees exactly
this interpreter's installed packages (torch and the rest, which meet graphmax's ranges offline), whether this
interpreter is a venv's (with or without ``--system-site-packages``) or not, and gets graphmax only from the
install. This interpreter's editable install of the checkout is visible there too (its finder comes from a ``.pth``
file of those packages), so the test checks where each module was loaded from.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import tomllib
import venv
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement

from gm_graphs import GraphmaxError
from gm_solver.datastore import Datastore

from .own_models import ARCHITECTURES, save_model, sentences

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gm_graphs", "gm_solver", "pipelines")
TIMEOUT_S = 600
INSTALL = "pip install '.[faiss]'"  # README.md's line for installing from a checkout
# plug-ins that import the program hosting them, which graphmax does not depend on: imported where the host is
# installed, else only found (their file, without running them)
HOSTED = {"gm_solver.serving.vllm": "vllm"}
REQUIRES = "import importlib.metadata as m, json; print(json.dumps(m.requires('graphmax')))"
VERSIONS = """
import importlib.metadata as m, json, sys
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print(json.dumps({name: version(name) for name in sys.argv[1:]}))
"""
IMPORT_OR_FIND = """
import importlib, importlib.util, json, sys
hosted = json.loads(sys.argv[1])
def load(name):
    host = hosted.get(name)
    if host is None or importlib.util.find_spec(host) is not None:
        return importlib.import_module(name).__file__
    return importlib.util.find_spec(name).origin
print(json.dumps({name: load(name) for name in sys.argv[2:]}))
"""


def not_copied(folder: str, names: list[str]) -> set[str]:
    """What a copy of the checkout leaves out: history, caches, and at the top earlier builds and outputs (not
    ``gm_graphs/build``) and venvs (``.venv``, CI's ``.venv-vllm``: any folder holding a ``pyvenv.cfg``)."""
    skip = {n for n in names if n in (".git", "__pycache__", ".hypothesis", ".pytest_cache") or n.endswith(".egg-info")}
    if Path(folder) != ROOT:
        return skip
    venvs = {n for n in names if (ROOT / n / "pyvenv.cfg").is_file()}
    return skip | venvs | ({"build", "dist", ".venv", "out"} & set(names))


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


def unmet_build_requirements() -> list[str]:
    """pyproject.toml's ``[build-system] requires`` that this interpreter's installed packages do not meet. A venv
    made by ``python -m venv`` carries its own setuptools (65.5 with Python 3.11), which refuses pyproject's SPDX
    ``project.license``; with ``--system-site-packages`` it shadows the base interpreter's newer one."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["build-system"]["requires"]
    unmet = []
    for requirement in map(Requirement, requires):
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            found = version(requirement.name)  # the first on sys.path: the one a build would import
        except PackageNotFoundError:
            found = None
        if found is None or not requirement.specifier.contains(found, prereleases=True):
            unmet.append(f"{requirement} (found {found})")
    return unmet


def site_folders() -> list[str]:
    """The folders this interpreter imports installed packages from, in its order: a venv's own, then (with
    ``--system-site-packages``) the base interpreter's, and the user's."""
    folders = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    return [f for f in dict.fromkeys(folders) if f in sys.path]


def venv_seeing_these_packages(env_dir: Path) -> Path:
    """A venv in ``env_dir`` whose interpreter sees this interpreter's installed packages after its own; returns
    its python. ``--system-site-packages`` would not do: made from inside a venv, it sees the base interpreter's
    packages, not the venv's. A ``.pth`` file in the new venv adds each of :func:`site_folders` with
    ``site.addsitedir``, so their own ``.pth`` files (an editable install's finder among them) run too. Nothing is
    built in it: pip's isolated build would not strip folders added this way."""
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    own = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    lines = [f"import site; site.addsitedir({folder!r})" for folder in site_folders()]
    (Path(own) / "zz_graphmax_test_parent_packages.pth").write_text("\n".join(lines) + "\n")
    return python


@pytest.fixture(scope="module")
def wheel(checkout, tmp_path_factory) -> Path:
    """The wheel of the checkout's copy, built by this interpreter's pip: offline with the setuptools this
    interpreter imports where it meets the build requirement, else with pip's build isolation."""
    dist = tmp_path_factory.mktemp("dist")
    offline = [] if unmet_build_requirements() else ["--no-build-isolation", "--no-index"]
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", *offline, "-q", "-w", str(dist), str(checkout)])
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
def test_the_readmes_install_runs_without_the_checkout(wheel, tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"\n{INSTALL}  " in readme, f"README.md no longer shows `{INSTALL}`, the line this test runs"
    command, target = shlex.split(INSTALL)[1:]
    assert command == "install" and target.startswith(".["), f"`{INSTALL}` is no longer `pip install .[extras]`"
    env_dir, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    python, graphmax = venv_seeing_these_packages(env_dir), env_dir / "bin" / "graphmax"
    # the README's line, offline: the checkout's wheel (pip install . builds it as the fixture did), by this
    # interpreter's pip into the venv. Without pip's resolver, which would also ask this environment's other packages
    # to agree among themselves (torch's setuptools>=77.0.3 is not met in a --system-site-packages venv, whose own
    # setuptools shadows the base's); graphmax's requirements, with the line's extras, are checked below
    run([sys.executable, "-m", "pip", "--python", str(python), command, str(wheel), "--no-deps", "--no-index", "-q"],
        cwd=work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_CACHE_DIR")}
    env["GRAPHMAX_HOME"] = str(tmp_path / "home")
    extras = Requirement(f"graphmax{target[1:]}").extras
    requires = [Requirement(r) for r in json.loads(run([str(python), "-c", REQUIRES], cwd=work, env=env).stdout)]
    wanted = [r for r in requires if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras)]
    found = json.loads(run([str(python), "-c", VERSIONS, *(r.name for r in wanted)], cwd=work, env=env).stdout)
    assert len(wanted) > 10 and any(r.marker for r in wanted), f"{extras}'s requirements not read: {requires}"
    unmet = {str(r): found[r.name] for r in wanted
             if found[r.name] is None or not r.specifier.contains(found[r.name], prereleases=True)}
    assert not unmet, (f"graphmax's requirements that this interpreter's packages do not meet (found): {unmet}; "
                       f"install them as setup.sh does (pip install -c constraints.txt -e '.[faiss,test]')")
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=work,
                  env=env).stdout.strip()

    names = sorted(path[:-3].replace("/", ".").removesuffix(".__init__") for path in source_modules())
    assert set(HOSTED) <= set(names), f"hosted plug-ins not among the modules: {sorted(set(HOSTED) - set(names))}"
    files = json.loads(run([str(python), "-c", IMPORT_OR_FIND, json.dumps(HOSTED), *names], cwd=work, env=env).stdout)
    outside = {n: f for n, f in files.items() if not Path(f).resolve().is_relative_to(Path(purelib).resolve())}
    assert not outside, f"modules not loaded from the install in {purelib}: {outside}"

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
