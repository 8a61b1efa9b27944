"""The documentation checked against the code: README.md's size and commands, docs/reliability.md's tests, and
docs/format.md's versions.

- Every row of docs/reliability.md's tables names the test function that exercises it, or says ``untested``; every
  test name cited there must be defined (``def name(``) in some ``tests/**/*.py`` file, found by name, not by path,
  so that tests can move between files.
- README.md is a user guide of at most 250 lines, every ``graphmax <command>`` it shows is a sub-command of the
  real parser (``pipelines.cli.make_parser``), and it holds no dated results (those are benchmarks/RESULTS.md's).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RELIABILITY = ROOT / "docs" / "reliability.md"
FORMAT = ROOT / "docs" / "format.md"
MAX_README_LINES = 250

_TEST_NAME = re.compile(r"`(test_\w+)`")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_SEPARATOR = re.compile(r"\|(\s*:?-{3,}:?\s*\|)+")


# ---- parsing --------------------------------------------------------------------------------------------------------

def table_rows(text: str) -> list[tuple[int, list[str], list[str]]]:
    """The data rows of every Markdown table in ``text``: (line number, the table's header cells, the row's cells)."""
    lines = text.splitlines()
    rows, header = [], None
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            header = None
            continue
        if i + 1 < len(lines) and _SEPARATOR.fullmatch(lines[i + 1].strip()):
            header = cells(line)
        elif _SEPARATOR.fullmatch(line.strip()):
            continue
        elif header is not None:
            rows.append((i + 1, header, cells(line)))
    return rows


def cells(line: str) -> list[str]:
    """A table line's cells (a ``\\|`` inside a cell is not a border)."""
    return [c.strip() for c in _CELL_SPLIT.split(line.strip())[1:-1]]


def defined_tests() -> set[str]:
    """The names of the functions defined in any file under tests/ (top level or in a class)."""
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.update(re.findall(r"^\s*(?:async\s+)?def (test_\w+)\(", path.read_text(encoding="utf-8"), re.MULTILINE))
    return names


def shown_commands(markdown: str) -> list[tuple[str, ...]]:
    """Each ``graphmax WORD [WORD]`` the Markdown shows as code: in fenced blocks (less their # comments) and in
    inline code spans that start with ``graphmax ``."""
    code = []
    in_block = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            code.append(re.split(r"\s#\s", line, maxsplit=1)[0])
        else:
            code += [span for span in re.findall(r"``?\s?([^`]+?)\s?``?", line) if span.startswith("graphmax ")]
    found = []
    for chunk in code:
        for m in re.finditer(r"(?:^|[\s;&|(])graphmax ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", chunk):
            found.append(tuple(w for w in m.groups() if w))
    return found


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's sub-commands by name (empty if it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


# ---- docs/reliability.md ------------------------------------------------------------------------------------------

def test_every_reliability_row_names_a_test_or_says_untested():
    rows = table_rows(RELIABILITY.read_text(encoding="utf-8"))
    assert len(rows) >= 100, f"only {len(rows)} table rows parsed from {RELIABILITY}: the tables moved or broke"
    bad = []
    for line, header, row in rows:
        assert header[-1] == "test", f"docs/reliability.md:{line}: the table's last column must be 'test'"
        assert len(row) == len(header), f"docs/reliability.md:{line}: {len(row)} cells under {len(header)} headers"
        last = row[-1]
        if not (_TEST_NAME.search(last) or last.startswith("untested")):
            bad.append(f"docs/reliability.md:{line}: {last!r}")
    assert not bad, "rows that name no test and do not say 'untested':\n" + "\n".join(bad)


def test_every_test_cited_in_reliability_is_defined():
    cited = _TEST_NAME.findall(RELIABILITY.read_text(encoding="utf-8"))
    assert cited, "docs/reliability.md cites no test"
    defined = defined_tests()
    assert len(defined) > 100, "the tests/ folder was not found"
    missing = sorted(set(cited) - defined)
    assert not missing, f"docs/reliability.md cites tests that no tests/**/*.py defines: {missing}"


def test_the_parsers_find_what_they_should():
    """The checks above would pass vacuously if the parsers found nothing: a made-up table shows they do not."""
    text = ("| input | what comes back | test |\n|---|---|---|\n"
            "| a \\| b | `x` | `test_no_such_test_anywhere` |\n| c | d | nothing named |\n| e | f | untested |\n")
    rows = table_rows(text)
    assert [r[2][0] for r in rows] == ["a \\| b", "c", "e"]
    assert _TEST_NAME.findall(text) == ["test_no_such_test_anywhere"]
    assert "test_no_such_test_anywhere" not in defined_tests()
    assert "test_the_parsers_find_what_they_should" in defined_tests()
    shown = shown_commands("```bash\ngraphmax build x  # then graphmax merge\n```\nuse `graphmax graphs info NAME`, "
                           "or `` graphmax bogus ``; graphmax makes prose.")
    assert shown == [("build", "x"), ("graphs", "info"), ("bogus",)]


# ---- README.md ----------------------------------------------------------------------------------------------------

def test_readme_is_at_most_250_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the guide keeps to {MAX_README_LINES}"


def test_every_command_the_readme_shows_is_a_real_subcommand():
    from pipelines.cli import make_parser

    parser, _ = make_parser([])  # no command: every job module registers its commands
    commands = subcommands(parser)
    assert {"build", "generate", "demo"} <= set(commands), sorted(commands)
    shown = shown_commands(README.read_text(encoding="utf-8"))
    assert len(shown) >= 10, f"only {shown} found in README.md"
    wrong = []
    for words in shown:
        command = commands.get(words[0])
        if command is None:
            wrong.append(" ".join(words))
            continue
        nested = subcommands(command)
        if nested and (len(words) < 2 or words[1] not in nested):
            wrong.append(" ".join(words))
    assert not wrong, f"README.md shows commands graphmax does not have: {sorted(set(wrong))} " \
                      f"(it has {sorted(commands)})"


def test_readme_links_the_docs_and_holds_no_dated_results():
    text = README.read_text(encoding="utf-8")
    for target in ("docs/format.md", "docs/reliability.md", "benchmarks/RESULTS.md"):
        assert f"]({target}" in text, f"README.md does not link {target}"
        assert (ROOT / target).is_file(), target
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    commits = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert not dates and not commits, f"README.md holds dates {dates} or commit hashes {commits}: " \
                                      f"dated results belong in benchmarks/RESULTS.md"


# ---- docs/format.md -----------------------------------------------------------------------------------------------

def _constant(pattern: str, marker: str | None = None) -> int:
    """An integer constant assigned in gm_graphs (searched by its assignment, wherever the module now lives)."""
    values = set()
    for path in (ROOT / "gm_graphs").rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        if marker is None or marker in source:
            values.update(int(v) for v in re.findall(pattern, source, re.MULTILINE))
    assert len(values) == 1, f"{pattern!r}: {sorted(values)}"
    return values.pop()


@pytest.mark.parametrize("documented, pattern, marker", [
    ('"format_version": {}', r"^FORMAT_VERSION = (\d+)", None),
    ('"version": {}', r"^VERSION = (\d+)", 'FORMAT = "graphmax-datastore"'),
])
def test_format_md_states_the_versions_the_code_writes(documented, pattern, marker):
    text = FORMAT.read_text(encoding="utf-8")
    version = _constant(pattern, marker)
    assert documented.format(version) in text, f"docs/format.md does not say {documented.format(version)}"
    for name in ('"graphmax-graph"', '"graphmax-datastore"', ".graphmax-datastore", ".graphmax-temp"):
        assert name in text
