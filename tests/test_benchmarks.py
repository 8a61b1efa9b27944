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
    script.write_text("def main():\n    from gm_graphs.count.ngram_counts import _fold\n"
                      "    from gm_graphs import load_graph\n")
    assert missing(graphmax_imports(script)) == ["2: gm_graphs.count.ngram_counts._fold"]


def test_the_device_table_runs_on_the_cpu(tmp_path, bpe_tokenizer, monkeypatch, capsys):
    """benchmarks/device.py at its smallest on a tiny random Llama and a graph of its tokenizer: every table printed
    with numbers, none failed, and the same numbers in --out. The script runs in this process, whose imports it
    shares (``helps`` starts it in a fresh one); its start-up table still times a fresh process of its own."""
    import re
    import runpy

    from transformers import LlamaConfig, LlamaForCausalLM

    from gm_graphs import build_graph

    from .helpers import make_docs

    model = tmp_path / "model"
    bpe_tokenizer.save_pretrained(model)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(bpe_tokenizer), hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=256)).save_pretrained(model)
    (tmp_path / "docs.txt").write_text("\n".join(make_docs(300)))
    build_graph(tmp_path / "docs.txt", str(model), path=tmp_path / "graph", ngrams=(3, 4), progress=False)
    script = BENCHMARKS[0].parent / "device.py"
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", "--model", str(model), "--graph",
                                      str(tmp_path / "graph"), "--batches", "1", "--dtypes", "float32",
                                      "--new-tokens", "2", "--rounds", "1", "--knn-keys", "64", "--corpus",
                                      str(tmp_path / "docs.txt"), "--out", str(tmp_path / "out.json")])
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:  # main() exits only on an error, after printing it
        pytest.fail(f"device.py exited with {e.code!r}: {capsys.readouterr().err[-2000:]}")
    stdout = capsys.readouterr().out
    assert "failed" not in stdout, stdout
    tables = {}
    for block in stdout.split("\n\n"):  # a table's title and header line, then its markdown rows
        if re.match(r"[1-4]\. ", block):
            title = block
        elif block.startswith("| ") and re.search(r"\| \d+\.\d+", block.splitlines()[2]):
            tables[title[0]] = block.splitlines()[2]
    assert sorted(tables) == ["1", "2", "3", "4"], stdout
    assert "device cpu" in stdout and "dtype float32" in stdout
    numbers = json.loads((tmp_path / "out.json").read_text())["tables"]
    assert {"decoding", "processors", "datastore", "startup"} <= set(numbers)
    assert numbers["datastore"]["keys"] >= 64
    assert set(numbers["decoding"][0]) == {"dtype", "decoding", "batch", "context", "kNN", "paper"}
