"""The doctests that ``--doctest-modules`` collects from gm_graphs and gm_solver run in a sandbox: an empty working
folder, with ``$GRAPHMAX_HOME`` and temporary folders under it, so that an example never writes into the user's
graphs, verification cache or working folder.

The examples that build graphs share one set-up, given in their namespace where they use it:

- ``tok``: ``word_tokenizer("the cat dog sat ran".split())`` (ids: 0 ``[UNK]``, then the words 1 … 5);
- ``folder``: a ``pathlib.Path`` in the sandbox holding ``reviews.txt`` (:data:`REVIEWS`) and ``more.txt``
  (:data:`MORE`), the corpora of the examples.

The examples of the corpus readers get ``source(name, content)``: a ``Source`` of a file of that name in the sandbox
holding ``content`` (text; bytes; a pyarrow table, written as Parquet; or a dict of member names and texts, written
as a zip archive).
"""

from __future__ import annotations

import importlib.util
import re
import tempfile
import zipfile
from pathlib import Path

import pytest

# the vLLM plug-in imports vLLM, which lives in its own environment (tests/vllm/setup_venv.sh); elsewhere its module
# is not collected for doctests, and tests/vllm/ is collected only where vLLM is
if importlib.util.find_spec("vllm") is None:
    collect_ignore = ["gm_solver/serving/vllm.py", "tests/vllm"]

WORDS = "the cat dog sat ran".split()
REVIEWS = "the cat sat\nthe dog sat\nthe cat ran\n"
MORE = "the dog ran\n"


def _uses(item, name: str) -> bool:
    """Whether the doctest ``item``'s examples use ``name`` (the tokenizer imports transformers: ~2 s, so only an
    example that uses it gets it)."""
    return any(re.search(rf"\b{name}\b", example.source) for example in item.dtest.examples)


@pytest.fixture(autouse=True)
def _doctest_sandbox(request: pytest.FixtureRequest):
    if isinstance(request.node, pytest.Function):  # a test, not a doctest: its own fixtures decide
        yield
        return
    tmp = request.getfixturevalue("tmp_path")
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.chdir(tmp)
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp / "home"))
    (tmp / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp / "tmp"))
    namespace = request.getfixturevalue("doctest_namespace")
    if _uses(request.node, "folder"):
        folder = tmp / "examples"
        folder.mkdir()
        (folder / "reviews.txt").write_text(REVIEWS)
        (folder / "more.txt").write_text(MORE)
        monkeypatch.setitem(namespace, "folder", folder)
    if _uses(request.node, "source"):
        monkeypatch.setitem(namespace, "source", lambda name, content: _source(tmp / "tmp" / name, content))
    if _uses(request.node, "tok"):
        from gm_graphs import word_tokenizer

        monkeypatch.setitem(namespace, "tok", word_tokenizer(WORDS))
    yield


def _source(path: Path, content):
    from gm_graphs.corpus.source import Source, open_regular

    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, dict):
        with zipfile.ZipFile(path, "w") as zf:
            for member, text in content.items():
                zf.writestr(member, text)
    else:
        import pyarrow.parquet as pq

        pq.write_table(content, path)
    return Source(path.name, str(path), lambda: open_regular(path), path=None if path.suffix == ".gz" else path)
