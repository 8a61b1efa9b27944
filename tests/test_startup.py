"""Argument errors at once (issue 56): every refusal of the command line that depends on its arguments alone (a
device, a dtype, a range, a missing file or folder) is one line, made before torch or transformers is imported.

Each case runs the command line in a fresh interpreter that reports, as it exits, which heavy modules it had
imported by then. The seconds it takes are ``benchmarks/first_use.py``'s, not a test's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "polars", "pyarrow", "ray")
NEVER = {"torch", "transformers"}  # what no argument error may wait for
# runs MODULE's main() on the arguments after it, then says on stderr's last line which of HEAVY it had imported
PROBE = ("import atexit, importlib, sys\n"
         f"atexit.register(lambda: print('imported:', ','.join(m for m in {HEAVY!r} if m in sys.modules), "
         "file=sys.stderr))\n"
         "main = importlib.import_module(sys.argv[1]).main\n"
         "sys.exit(main(sys.argv[2:]))\n")
GENERATE = ["generate", "--graph", "g", "--prompt", "x"]
CORPUS = "{corpus}"  # a corpus file that exists: the error is another argument's
FOLDER = "{folder}"  # a folder that exists and holds no model
READS = {"pyarrow"}  # the corpus' check opens the file with its reader: pyarrow comes with the readers
CLI = "pipelines.cli"


def case(argv: list[str], says: str, may_import: set[str] = frozenset(), *, module: str = CLI, prog: str = "",
         marks=()):
    """One refusal: ``argv`` given to ``module``'s main, the fragment its one line ``says``, the heavy modules it
    ``may_import`` (none beyond the corpus' readers), and the program its line names (``graphmax <command>``)."""
    prog = prog or ("graphmax " + " ".join(argv[:2] if argv[0] == "graphs" else argv[:1]) if argv else "graphmax")
    return pytest.param(module, argv, says, set(may_import), prog, marks=marks, id=f"{module} {' '.join(argv)}")


BUILD = ["build", CORPUS, "--tokenizer", "smollm2", "--name", "g"]
DATASTORE = ["datastore", "--corpus", CORPUS, "--out", "{tmp}/ds"]

CASES = [
    # no command, or a mistyped one: no command's module is imported
    case([], "the following arguments are required: command"),
    case(["bild"], "argument command: invalid choice: 'bild'", prog="graphmax"),
    # build, merge, graphs (pipelines/build.py)
    case(["build", "{tmp}/missing.csv", "--tokenizer", "smollm2", "--name", "g"],
         "argument corpus: corpus file '{tmp}/missing.csv' does not exist", READS),
    case(["build", CORPUS, "--name", "g"], "the following arguments are required: --tokenizer"),
    case(BUILD + ["--orders", "0"], "argument --orders: must be integers >= 1 separated by commas"),
    case(BUILD + ["--orders", "1,1000"], "argument --orders: must be integers from 1 to 999"),
    case(BUILD + ["--mixture", "1000"], "argument --mixture: must be an integer from 2 to 999"),
    case(BUILD + ["--ngrams", "3,64"], "argument --ngrams: must be integers from 3 to 63"),
    case(BUILD + ["--ngram-run-entries", "0"], "argument --ngram-run-entries: must be an integer >= 1"),
    case(BUILD + ["--eps", "nan"], "argument --eps: must be a finite number >= 0"),
    case(BUILD + ["--engine", "spark"], "argument --engine: invalid choice: 'spark'"),
    case(BUILD + ["--path", "g"], "argument --path: not allowed with argument --name"),
    case(["merge", "a", "b", "--name", "m", "--prune-top-k", "-1"], "argument --prune-top-k: must be an integer >= 0"),
    case(["merge", "a", "b"], "one of the arguments --name --path is required"),
    case(["graphs"], "the following arguments are required: {list,info,upgrade}"),
    case(["graphs", "info"], "one of the arguments NAME --path is required"),
    case(["graphs", "upgrade", "--path", ""], "argument --path: must not be empty"),
    # datastore (pipelines/datastore_command.py)
    case(["datastore", "--corpus", "{tmp}/missing.csv", "--out", "{tmp}/ds"],
         "argument --corpus: corpus file '{tmp}/missing.csv' does not exist", READS),
    case(["datastore", "--corpus", CORPUS], "the following arguments are required: --out"),
    case(DATASTORE + ["--device", "tpu"], "--device 'tpu' is not a device torch knows"),
    case(DATASTORE + ["--device", "cpu:1"], "--device 'cpu:1': the CPU is one device"),
    case(DATASTORE + ["--device", "cpu", "--dtype", "float16"], "--dtype float16 on the CPU is slow"),
    case(DATASTORE + ["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    case(DATASTORE + ["--docs", "0"], "argument --docs: must be an integer >= 1"),
    case(DATASTORE + ["--model", FOLDER], "argument --model: the model folder {folder} has no tokenizer"),
    # eval (pipelines/eval/cli.py)
    case(["eval", "--device", "mps"], "--device 'mps': graphmax runs on 'cpu' or 'cuda' devices"),
    case(["eval", "--heldout-fraction", "1"], "argument --heldout-fraction: must be a number strictly between 0 and 1",
         ),
    case(["eval", "--corpus", "{tmp}/missing.csv"], "corpus file '{tmp}/missing.csv' does not exist", READS),
    case(["eval", "--out", "{tmp}/link"], "--out {tmp}/link is a symlink"),
    # a graph that is not there, by name or by folder (generate, tune, graphs)
    case(["generate", "--graph", "nowhere", "--prompt", "x"], "no graph 'nowhere' in {tmp}/home/graphs"),
    case(["generate", "--path", "{tmp}/nowhere", "--prompt", "x"], "no graph folder {tmp}/nowhere"),
    case(["generate", "--graph", "../g", "--prompt", "x"], "'../g' is not a graph name"),
    case(["tune", "nowhere", "--corpus", CORPUS], "no graph 'nowhere' in {tmp}/home/graphs", READS),
    case(["graphs", "info", "nowhere"], "no graph 'nowhere' in {tmp}/home/graphs", prog="graphmax graphs"),
    # generate (pipelines/generate.py): every decoder option is checked by its kind's settings while parsing
    case(GENERATE + ["--device", "tpu"], "--device 'tpu' is not a device torch knows"),
    case(GENERATE + ["--lam", "-1"], "argument --lam: must be a finite float >= 0 (0 gives softmax), got -1.0"),
    case(GENERATE + ["--kl-share", "2"], "argument --kl-share: must be a float in [0, 1]"),
    case(GENERATE + ["--decoder", "beam"], "argument --decoder: invalid choice: 'beam'"),
    # tune (pipelines/tune.py)
    case(["tune", "g", "--corpus", CORPUS, "--docs", "0"], "argument --docs: must be an integer >= 1"),
    case(["tune", "g", "--corpus", CORPUS, "--device", "mps"],
         "--device 'mps': graphmax runs on 'cpu' or 'cuda' devices"),
    # demo (pipelines/demo.py)
    case(["demo", "--device", "mps"], "--device 'mps': graphmax runs on 'cpu' or 'cuda' devices"),
    case(["demo", "--lam", "-1"], "argument --lam: must be a finite number >= 0"),
    # python -m pipelines.warm (pipelines/warm.py)
    case(["--workers", "0"], "argument --workers: must be an integer >= 1", module="pipelines.warm",
         prog="python -m pipelines.warm"),
    case(["--tokenizr", "smollm2"], "unrecognized arguments: --tokenizr", module="pipelines.warm",
         prog="python -m pipelines.warm"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("startup")
    (tmp / "corpus.txt").write_text("the cat sat\nthe dog ran\n")
    (tmp / "no-model").mkdir()
    (tmp / "link").symlink_to(tmp / "no-model")
    return {"tmp": str(tmp), "corpus": str(tmp / "corpus.txt"), "folder": str(tmp / "no-model")}


def fill(text: str, places: dict[str, str]) -> str:
    for name, value in places.items():
        text = text.replace(f"{{{name}}}", value)
    return text


def run_probe(module: str, argv: list[str], home: str) -> tuple[int, list[str], set[str]]:
    """``module``'s main run on ``argv`` in a fresh interpreter: its status, its stderr lines before the probe's,
    and the heavy modules imported by the time it exited."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"GRAPHMAX_HOME": home}
    done = subprocess.run([sys.executable, "-c", PROBE, module, *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)
    *lines, probe = done.stderr.splitlines() or [""]
    assert probe.startswith("imported:"), done.stderr
    return done.returncode, lines, set(filter(None, probe.removeprefix("imported:").strip().split(",")))


@pytest.mark.parametrize(("module", "argv", "says", "may_import", "prog"), CASES)
def test_an_argument_error_is_one_line_before_torch_and_transformers(places, module, argv, says, may_import, prog):
    argv, says = [fill(arg, places) for arg in argv], fill(says, places)
    code, lines, imported = run_probe(module, argv, f"{places['tmp']}/home")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{prog}: error: ") and says in lines[0], lines[0]
    assert not imported & NEVER, f"{imported & NEVER} imported before: {lines[0]}"
    assert imported <= may_import, f"{imported - may_import} imported before: {lines[0]}"


def test_the_probe_sees_what_a_command_imports(places):
    # the check above can fail: a module that imports torch is seen to (it has no main(): a traceback)
    code, _, imported = run_probe("gm_solver.backends", [], f"{places['tmp']}/home")
    assert code == 1 and "torch" in imported


def test_the_limits_the_build_parser_copies_are_the_librarys():
    # copied so that parsing imports none of numba, scipy and pyarrow; a change to the library's changes the copy
    from gm_graphs.build.graphs import ENGINES
    from gm_graphs.build.options import MAX_ORDER
    from gm_graphs.count.ngram_counts import MAX_ORDER as MAX_NGRAM_ORDER
    from gm_graphs.count.runs import RUN_ENTRIES
    from pipelines import build

    assert (build.MAX_ORDER, build.MAX_NGRAM_ORDER, build.NGRAM_RUN_ENTRIES) == (MAX_ORDER, MAX_NGRAM_ORDER,
                                                                                 RUN_ENTRIES)
    assert build.ENGINES == tuple(ENGINES)


# ---- the model's libraries: imported once the arguments have passed, with the collector paused --------------------

def _in_a_fresh_interpreter(code: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_the_model_libraries_are_imported_without_a_collection_and_the_collector_is_set_back():
    # a library's caller whose collector is off: imported without a pass, the collector left off, nothing frozen
    passes, enabled, frozen, imported = _in_a_fresh_interpreter(
        "import gc, sys\n"
        "gc.disable()\n"
        "from pipelines.models import MODEL_LIBRARIES, import_model_libraries\n"
        "before = sum(s['collections'] for s in gc.get_stats())\n"
        "import_model_libraries()\n"
        "print(sum(s['collections'] for s in gc.get_stats()) - before, gc.isenabled(), gc.get_freeze_count(),\n"
        "      all(m in sys.modules for m in MODEL_LIBRARIES))\n")
    assert (passes, enabled, frozen, imported) == ("0", "False", "0", "True")


def test_a_callers_frozen_objects_stay_frozen(monkeypatch, tmp_path):
    import gc

    from pipelines import models

    (tmp_path / "graphmax_probe_library.py").write_text("made = [[] for _ in range(1000)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(models, "MODEL_LIBRARIES", ("graphmax_probe_library",))
    monkeypatch.delitem(sys.modules, "graphmax_probe_library", raising=False)
    gc.freeze()  # as a server does before it forks
    frozen = gc.get_freeze_count()
    try:
        models.import_model_libraries()
        assert "graphmax_probe_library" in sys.modules and gc.isenabled()
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
        sys.modules.pop("graphmax_probe_library", None)


def test_the_command_line_imports_a_model_commands_libraries_and_freezes_them_in_its_own_process_only(monkeypatch):
    import gc

    from pipelines import demo
    from pipelines.cli import main

    # the process' entry point (argv=None) owns its collector: the libraries imported without a pass, the
    # collector on, every object alive frozen (torch and transformers make some 370,000)
    assert _in_a_fresh_interpreter(
        "import gc, sys\n"
        "from pipelines import demo, models\n"
        "def run(args):\n"
        "    print(passes, gc.isenabled(),\n"
        "          gc.get_freeze_count() > 100_000, all(m in sys.modules for m in models.MODEL_LIBRARIES))\n"
        "    return 0\n"
        "demo.run = run\n"
        "real = models.import_model_libraries\n"
        "def counted(**kw):\n"
        "    global passes\n"
        "    before = sum(s['collections'] for s in gc.get_stats())\n"
        "    real(**kw)\n"
        "    passes = sum(s['collections'] for s in gc.get_stats()) - before\n"
        "models.import_model_libraries = counted\n"
        "from pipelines.cli import main\n"
        "sys.argv = ['graphmax', 'demo']\n"
        "main()\n") == ["0", "True", "True", "True"]
    # a caller of main(argv), as here, keeps its collector as it was
    frozen = gc.get_freeze_count()
    monkeypatch.setattr(demo, "run", lambda args: 0)
    assert main(["demo"]) == 0 and gc.get_freeze_count() == frozen


def test_an_extension_of_nanobinds_is_seen_so_that_the_exit_thaws_what_it_would_report_as_leaked(monkeypatch):
    import types

    from pipelines import cli

    seen = cli._nanobind_loaded()  # True where triton is loaded (torch built for CUDA, vLLM's venv)
    plain = types.ModuleType("graphmax_plain_extension")
    plain.__file__ = "/nowhere/graphmax_plain_extension.so"
    plain.Thing = type("Thing", (), {})
    monkeypatch.setitem(sys.modules, plain.__name__, plain)
    assert cli._nanobind_loaded() == seen
    nb_meta = type("nb_meta", (type,), {"__module__": "nanobind"})
    made = types.ModuleType("graphmax_nanobind_extension")
    made.__file__ = "/nowhere/graphmax_nanobind_extension.cpython-311-x86_64-linux-gnu.so"
    made.ir = types.ModuleType("graphmax_nanobind_extension.ir")  # a submodule nanobind made: no file of its own
    made.ir.builder = nb_meta("builder", (), {})
    monkeypatch.setitem(sys.modules, made.__name__, made)
    assert cli._nanobind_loaded()


def test_a_graphs_folder_that_cannot_be_read_is_left_to_the_commands_one_line(tmp_path, monkeypatch, capsys):
    # a name too long for the file system in $GRAPHMAX_HOME: the check while parsing cannot list the graphs, and the
    # command's opening of the graph reports it as any file-system error, in one line with the fix
    from pipelines.cli import main

    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / ("x" * 300)))
    assert main(["graphs", "info", "nowhere"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("graphmax graphs: error: file name too long"), lines
