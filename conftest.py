"""The doctests that ``--doctest-modules`` collects from gm_graphs and gm_solver run in a sandbox: an empty working
folder, with ``$GRAPHMAX_HOME`` and temporary folders under it, so that an example never writes into the user's
graphs, verification cache or working folder (tests/test_api.py runs the exported objects' examples the same way)."""

from __future__ import annotations

import tempfile

import pytest


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
    yield
