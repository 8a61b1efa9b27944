"""Importing graphmax where numba can cache neither beside the sources nor in the user's cache folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_import_falls_back_to_a_temporary_cache_folder(tmp_path):
    site = tmp_path / "site"
    for package in ("gm_graphs", "gm_solver"):
        shutil.copytree(ROOT / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))
        (site / package / "__pycache__").write_text("")  # a file where numba would make its folder: not writable
    home = tmp_path / "home"
    home.write_text("")  # nor is ~/.cache under it
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1",
           "TMPDIR": str(tmp_path / "tmp")}
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("XDG_CACHE_HOME", None)
    (tmp_path / "tmp").mkdir()
    # importing decorates every cached kernel (which raised without the fallback); one product compiles one
    code = ("import numba, scipy.sparse as sp, torch; from gm_solver import TransitionOperator; "
            "TransitionOperator(sp.eye(3, format='csr')).matvec(torch.ones(1, 3, dtype=torch.float64)); "
            "print(numba.config.CACHE_DIR)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    cache = Path(out.stdout.strip())
    assert cache.parent == tmp_path / "tmp" and any(cache.rglob("*.nbi"))
