"""The benchmark scripts cannot rot silently: each answers ``--help``, and every graphmax name each imports (at
module level or inside a function, where ``--help`` never reaches) exists."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def graphmax_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every import of gm_graphs, gm_solver or pipelines in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in ("gm_graphs", "gm_solver", "pipelines"):
            out += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names
                    if a.name.split(".")[0] in ("gm_graphs", "gm_solver", "pipelines")]
    return out


def missing(imports: list[tuple[int, str, str | None]]) -> list[str]:
    found = []
    for line, module, name in imports:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            found.append(f"{line}: {module} ({e})")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                found.append(f"{line}: {module}.{name}")
    return found


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_every_graphmax_name_a_benchmark_imports_exists(script):
    assert missing(graphmax_imports(script)) == []


_HELP = """
import contextlib, io, json, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv, stdout = [script, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            runpy.run_path(script, run_name="__main__")
        code = "returned without exiting"
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # reported to the test, which names the script
        code = f"{type(e).__name__}: {e}"
    out[script] = [code, stdout.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    """Each script's exit code and output for ``--help``, all run in one fresh process (this checkout's packages)."""
    root = BENCHMARKS[0].parents[1]
    run = subprocess.run([sys.executable, "-c", _HELP, *map(str, BENCHMARKS)], capture_output=True, text=True,
                         timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_every_benchmark_answers_help(script, helps):
    code, out = helps[str(script)]
    assert code in (0, None), code
    assert "usage:" in out


def test_a_name_that_is_gone_is_found(tmp_path):
    script = tmp_path / "old.py"
    script.write_text("def main():\n    from gm_graphs.count.ngrams import _fold\n"
                      "    from gm_graphs import load_graph\n")
    assert missing(graphmax_imports(script)) == ["2: gm_graphs.count.ngrams._fold"]
