"""numba's cache of graphmax's kernels: where it goes (even with nowhere writable), and when it is reused."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from numba.core.dispatcher import Dispatcher

from gm_graphs.store import kernel_cache as numba_cache

ROOT = Path(__file__).parents[1]
PACKAGES = ("gm_graphs", "gm_solver")


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
    assert cache.parent == tmp_path / "tmp" and any(cache.rglob("*.nbi"))


def test_every_graphmax_kernel_is_stamped_with_all_sources():
    modules = [f"{package}.{path.stem}" for package in PACKAGES for path in sorted((ROOT / package).glob("*.py"))
               if "import numba" in path.read_text()]
    kernels = {}
    for name in modules:
        for kernel in vars(importlib.import_module(name)).values():
            if isinstance(kernel, Dispatcher) and kernel.py_func.__module__ == name and kernel._cache.cache_path:
                kernels[f"{name}.{kernel.__name__}"] = type(kernel._cache._impl.locator).__module__
    assert len(kernels) > 50 and kernels == dict.fromkeys(kernels, "gm_graphs.store.kernel_cache")


def test_a_change_to_any_kernel_module_recompiles_the_kernels_that_call_it(tmp_path):
    # numba alone reuses a kernel's cache while its own file is unchanged: context_kernel's kernels, built against
    # lambert_kernel's, were loaded after lambert_kernel.py changed, and crashed
    site = tmp_path / "site"
    _copy_packages(site)
    other = site / "other_lib.py"  # another library's cached kernel, outside graphmax's packages
    other.write_text("import numba\n\n\n@numba.njit(cache=True)\ndef kernel(x):\n    return x + 1\n")
    (tmp_path / "home").mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("NUMBA_CACHE_DIR", None)  # so the kernels are cached in the copy's __pycache__
    # one small kernel of context_kernel (it compiles in about a second): was it loaded from the cache?
    code = ("import numpy as np, other_lib; from gm_solver import context_kernel as ck; "
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
    with (site / "gm_solver" / "lambert_kernel.py").open("a") as f:
        f.write("# a change to the callee's module only\n")
    assert run()[:2] == ["0", "1"]  # the cache is stale: compiled again


def test_unknown_numba_internals_leave_numbas_own_locators_with_a_warning(monkeypatch):
    monkeypatch.setattr(numba_cache, "caching", None)  # as if numba.core.caching were gone
    with pytest.warns(RuntimeWarning, match="cache locators"):
        numba_cache.ensure_cache_dir()
