"""The public API: what ``gm_graphs`` and ``gm_solver`` export is documented (Args, Returns, a runnable example:
``--doctest-modules`` runs every example once), and the pipelines use nothing else."""

from __future__ import annotations

import ast
import doctest
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import gm_graphs
import gm_solver

PACKAGES = (gm_graphs, gm_solver)
PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"
NAMED = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
# exported objects whose examples may skip (``# doctest: +SKIP``): only one that needs the bundled 135M model or a
# large graph, where no small example is possible. None does today: every example runs.
MAY_SKIP: set[str] = set()


def exported_callables() -> dict[str, object]:
    """Every exported function and class (exceptions aside) by qualified name; an exported module (``bundled``)
    stands for the public functions and classes it defines."""
    found = {}
    for pkg in PACKAGES:
        for name in pkg.__all__:
            obj = getattr(pkg, name)  # loads the lazy processors too
            if isinstance(obj, types.ModuleType):
                for member, value in vars(obj).items():
                    if (not member.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
                            and value.__module__ == obj.__name__):
                        found[f"{pkg.__name__}.{name}.{member}"] = value
            elif inspect.isclass(obj) and issubclass(obj, BaseException):
                continue  # the exceptions: their docstring says when they are raised
            elif inspect.isfunction(obj) or inspect.isclass(obj):
                found[f"{pkg.__name__}.{name}"] = obj
    return found


CALLABLES = exported_callables()


def section(doc: str, title: str) -> str | None:
    """The indented body of the docstring section ``title`` (``Args:``), or None when there is none."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if re.fullmatch(rf"{title}\b[^:]*::?", line.strip()) and not line.startswith(" "):
            body = []
            for rest in lines[i + 1:]:
                if rest.strip() and not rest.startswith(" "):
                    break
                body.append(rest)
            return "\n".join(body)
    return None


def named_parameters(obj) -> list[str]:
    """What a caller passes by name: a class's constructor or a function's parameters, less ``*args``/``**kw``."""
    return [p.name for p in inspect.signature(obj).parameters.values() if p.kind in NAMED]


def test_every_public_callable_is_found():
    # the check below must see the processors (loaded lazily), bundled's functions and the newer exports
    for name in ("gm_solver.ContextGraphmaxLogitsProcessor", "gm_solver.InterpolationLogitsProcessor",
                 "gm_graphs.bundled.movie_reviews_csv", "gm_graphs.iter_documents",
                 "gm_solver.solve_toward"):
        assert name in CALLABLES
    assert "gm_graphs.GraphmaxError" not in CALLABLES


def doc_problems(name: str, obj) -> list[str]:
    """What ``obj``'s docstring lacks: an Args: section describing each named parameter, a Returns: section (a
    function that returns something), an Example:: section with >>> lines."""
    doc = inspect.getdoc(obj) or ""
    if not doc:
        return [f"{name} has no docstring"]
    problems = []
    params = named_parameters(obj)
    if params:
        args = section(doc, "Args")
        if args is None:
            problems.append(f"{name}'s docstring has no Args: section (it takes {', '.join(params)})")
        else:
            missing = [p for p in params if not re.search(rf"^\s+{p} ?[(:]", args, re.MULTILINE)]
            if missing:
                problems.append(f"{name}'s Args: section does not describe {', '.join(missing)}")
    if (inspect.isfunction(obj) and inspect.signature(obj).return_annotation not in (None, "None")
            and section(doc, "Returns") is None):
        problems.append(f"{name}'s docstring has no Returns: section")
    example = section(doc, "Examples?")
    if example is None:
        problems.append(f"{name}'s docstring has no Example:: section")
    elif not doctest.DocTestParser().get_examples(example):
        problems.append(f"{name}'s Example:: section has no >>> lines to run")
    if "+SKIP" in doc and name not in MAY_SKIP:
        problems.append(f"{name}'s examples skip lines (+SKIP); make them small enough to run, or list it in MAY_SKIP")
    return problems


@pytest.mark.parametrize("name", sorted(CALLABLES))
def test_docstring_has_args_returns_and_example(name):
    problems = doc_problems(name, CALLABLES[name])
    assert not problems, "; ".join(problems)


def test_docstring_check_names_what_is_missing():
    def half_documented(corpus: str, *, clean: bool = False, **options) -> int:
        """Count.

        Args:
            corpus (``str``): files.

        Example::

            half_documented("a.txt")
        """
        return 0

    def returns_nothing(x: int) -> None:
        """Nothing.

        Args:
            x (``int``): anything.

        Example::

            >>> returns_nothing(1)
        """

    assert doc_problems("f", half_documented) == [
        "f's Args: section does not describe clean", "f's docstring has no Returns: section",
        "f's Example:: section has no >>> lines to run"]
    assert doc_problems("g", returns_nothing) == []
    assert doc_problems("h", lambda: None) == ["h has no docstring"]
    returns_nothing.__doc__ = returns_nothing.__doc__.replace("(1)", "(1)  # doctest: +SKIP")
    assert doc_problems("g", returns_nothing) == [
        "g's examples skip lines (+SKIP); make them small enough to run, or list it in MAY_SKIP"]


def test_exported_names_exist_and_processors_load_lazily():
    for pkg in PACKAGES:
        missing = [n for n in pkg.__all__ if not hasattr(pkg, n)]
        assert not missing, f"{pkg.__name__}.__all__ names {missing}, which it does not define"
    # importing gm_solver must not import transformers (the processors load it on first use)
    code = "import sys, gm_solver; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# What the command line takes past the exported names: the kinds of error it reports, and the few defaults and
# checks it shows or runs before loading a model. Anything else it needs is exported.
CLI_PLUMBING = {
    "gm_graphs.errors": None,  # every name
    "gm_graphs.build.graphs": {"ENGINES"},
    "gm_graphs.count.runs": {"RUN_ENTRIES"},
    "gm_graphs.count.ngram_counts": {"ORDERS", "MAX_ORDER"},
    "gm_graphs.build.options": {"MAX_ORDER"},
    "gm_graphs.build.ray_engine": {"RayOptions"},
    "gm_graphs.corpus.read": {"fingerprint"},
    "gm_graphs.corpus.readers": {"READERS"},  # the build's help lists the formats the readers read
    "gm_graphs.corpus.split": {"heldout_side"},  # eval's split checked before --out is made
    "gm_graphs.format.graph_files": {"read_manifest"},  # upgrade reads the manifest before walking the folder
    "gm_graphs.format.datastore_files": {"check_datastore_target"},
    "gm_graphs.store.folders": {"claim_folder", "REPORT_MARKER",
                                "target_folder",  # an interrupt's line names the folder the command writes
                                "missing_graph",  # a graph that is not there, refused while parsing
                                "fsync_dir", "sync_tree"},  # the model cache's atomic entry (pipelines/model_cache.py)
    # the model cache is a cache as the tokenizer's is: sealed, remembered per file identity, fault points for tests
    "gm_graphs.store.faults": {"fault_point"},
    "gm_graphs.store.sealed": {"read_sealed", "trusted", "write_sealed"},
    "gm_graphs.store.verified": {"FileIdentity", "is_verified", "remember"},
    "gm_graphs.tokenize.gguf": {"read_once"},  # the model cache reads a GGUF file as the tokenizer's cache does
    "gm_graphs.tokenize.encoder": {"BUNDLED_ALIASES"},  # --model's check while parsing: 'smollm2' is no folder
    # generate and demo: torch on the CPU while numba compiles; warm's background compile holds the lock they read
    "gm_solver.backends": {"compile_in_background", "holding_compile_lock"},
    # generate's options made from the table of decoder kinds; eval's rows for the kinds a package registered
    "gm_solver.decoders": {"DecoderKind", "kind", "kinds"},
    "gm_solver.decoders.registry": {"BUILT_IN"},
    "gm_solver.arguments": {"options"},
}


def pipeline_imports() -> list[tuple[str, int, str]]:
    """(file, line, what) for every use of gm_graphs or gm_solver in pipelines/ that is neither an exported name
    nor in CLI_PLUMBING."""
    exported = {pkg.__name__: set(pkg.__all__) for pkg in PACKAGES}
    bad = []
    for path in sorted(PIPELINES.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = str(path.relative_to(PIPELINES))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                top, _, sub = node.module.partition(".")
                if node.module in CLI_PLUMBING:
                    allowed = CLI_PLUMBING[node.module]
                    bad += [(where, node.lineno, f"from {node.module} import {a.name}") for a in node.names
                            if allowed is not None and a.name not in allowed]
                elif top in exported and sub:
                    bad.append((where, node.lineno, f"from {node.module} import ..."))
                elif top in exported:
                    bad += [(where, node.lineno, f"from {top} import {a.name}") for a in node.names
                            if a.name not in exported[top]]
            elif isinstance(node, ast.Import):
                bad += [(where, node.lineno, f"import {a.name}") for a in node.names
                        if a.name.partition(".")[0] in exported and "." in a.name]
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in exported and node.attr not in exported[node.value.id]):
                bad.append((where, node.lineno, f"{node.value.id}.{node.attr}"))
    return bad


def test_pipelines_use_only_exported_names():
    bad = pipeline_imports()
    assert not bad, "pipelines/ reaches past the packages' __all__: " + "; ".join(
        f"{f}:{line} {what}" for f, line, what in bad)


def test_pipeline_import_check_catches_submodule_imports(tmp_path, monkeypatch):
    # the check itself: a submodule import, a non-exported top-level name and an attribute are each caught
    (tmp_path / "bad.py").write_text("import gm_graphs.corpus.read\nfrom gm_solver.divergences import solve_toward\n"
                                     "from gm_graphs import numba_cache\nimport gm_graphs\ngm_graphs.store.folders\n"
                                     "from gm_graphs import Graph\n")
    monkeypatch.setattr(sys.modules[__name__], "PIPELINES", tmp_path)
    assert sorted(line for _, line, _ in pipeline_imports()) == [1, 2, 3, 5]
