"""The ``graphmax`` console script: one sub-command per job module.

A user error ends one way: one line on stderr, ``graphmax <command>: error: <message>``, and exit
status 2. That covers bad arguments (refused while parsing, before any corpus or model is loaded),
graphmax's own errors (``GraphmaxError``) and the file system's (no space, no permission, no such
file), which name the path. Any other exception is a bug and keeps its traceback.

SIGTERM (``kill``'s default, and what schedulers send) ends a command as Ctrl-C does: it is raised in the main
thread as :class:`Terminated`, so the cleanup a failure runs (a staged folder removed, a lock released) runs too,
and the command prints one line and exits with status 143 (128 + SIGTERM). A second SIGTERM while that cleanup
runs ends the process at once, as a kill would; the next writer of that graph removes what it left.

The line of a command that writes a folder says whether its write was committed (``graphmax build: interrupted;
nothing was written: …/g is as it was``, or ``…/g was written whole before it stopped (committed)``). As the process'
entry point, once that line or the command's status is known, a further Ctrl-C or SIGTERM prints one line and exits
at once, so a late signal never ends the process by the signal itself with nothing said. Paths whose names are not
UTF-8 print as backslash escapes (``\\xff`` as ``\\udcff``) on any stdout and stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import importlib
import io
import os
import signal
import stat
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from gm_graphs import GraphmaxError

from .args import ArgumentParser, corpus_error, graph_error, model_error, one_line
from .devices import device_error

DESCRIPTION = """Make a pretrained language model write like your corpus, without fine-tuning: build a
word-transition graph from the corpus in the model's tokens, then decode with graphmax, a softmax
regularised toward what the corpus says comes next."""
EXAMPLES = """examples:
  graphmax demo                                                   # bundled movie reviews and SmolLM2-135M
  graphmax build reviews/*.csv.gz --text-column review --tokenizer smollm2 --name amazon --ngrams 3,4
  graphmax tune amazon --corpus validation.csv --text-column review   # choose the decoder; stored in the graph
  graphmax generate --graph amazon --prompt "This blender" --compare  # the stored decoder, softmax beside it
  graphmax eval --corpus drug-reviews --out report                    # held-out perplexity, BLEU, baselines

`graphmax COMMAND --help` shows a command's options. Graphs live in $GRAPHMAX_HOME/graphs (default
~/.cache/graphmax/graphs)."""
# command → the module whose register() defines it; only the module of the command run is imported
JOBS = {"build": "build", "merge": "build", "graphs": "build", "generate": "generate", "demo": "demo",
        "tune": "tune", "eval": "eval", "datastore": "datastore_command"}
# file-system errors that are the user's to fix: what happened, and what to do
OS_ERRORS = {
    errno.ENOSPC: ("no space left on device", "free space and run again"),
    errno.EDQUOT: ("disk quota exceeded", "free space and run again"),
    errno.EACCES: ("permission denied", "check the permissions or choose another location"),
    errno.EPERM: ("operation not permitted", "check the permissions or choose another location"),
    errno.EROFS: ("read-only file system", "choose a writable location"),
    errno.ENOENT: ("no such file or folder", "check the path"),
    errno.ENOTDIR: ("a part of the path is not a folder", "check the path"),
    errno.EISDIR: ("a folder where a file was expected", "check the path"),
    errno.ENAMETOOLONG: ("file name too long", "use a shorter path"),
    errno.ELOOP: ("too many levels of symbolic links", "check the links on the path"),
    errno.EMFILE: ("too many open files", "raise the limit (ulimit -n) and run again"),
    errno.ENFILE: ("too many open files in the system", "close other programs and run again"),
}


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is; a BaseException like KeyboardInterrupt, so that no ``except
    Exception`` takes it for a failure and goes on."""


def _terminate(signum, frame) -> NoReturn:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one while the cleanup runs: stop at once
    raise Terminated


def make_parser(argv: list[str]) -> tuple[ArgumentParser, dict[str, ArgumentParser]]:
    """The parser and its command parsers, with only the command's module imported when ``argv`` starts
    with a command (``graphmax build`` needs no torch); every module otherwise, for help and for the docs' checks."""
    return _parser([JOBS[argv[0]]] if argv and argv[0] in JOBS else list(dict.fromkeys(JOBS.values())))


def _parser(modules: list[str]) -> tuple[ArgumentParser, dict[str, ArgumentParser]]:
    """The parser with the commands of ``modules`` (their module names in ``JOBS``) and, under every other command's
    name, a bare parser: enough for argparse to refuse a mistyped or missing command, naming every command."""
    parser = ArgumentParser(prog="graphmax", description=DESCRIPTION, epilog=EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command, module in JOBS.items():  # in JOBS' order, as the error's list of commands shows them
        if module in modules:
            modules.remove(module)
            importlib.import_module(f".{module}", __package__).register(sub)
        elif command not in sub.choices:
            sub.add_parser(command)
    _check_path_arguments(parser)
    return parser, sub.choices


def path_argument(text: str) -> Path:
    """A path option's value: ``Path("")`` is ``Path(".")``, so an empty value would silently name this folder."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty; give a path ('.' for this folder)")
    return Path(text)


def _check_path_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``type=Path`` option of every (sub-)command parses with :func:`path_argument`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to one parser
                _check_path_arguments(child)
        elif action.type is Path:
            action.type = path_argument


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (``sys.argv[1:]`` when None) and return its exit status.

    Called with ``argv=None`` it is the process's entry point (the console script, ``python -m pipelines.cli``):
    once the status is known, a Ctrl-C or SIGTERM no longer raises but prints one line saying how the command had
    ended and exits at once, so that a late signal never ends the process silently by the signal itself.
    """
    entry = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    restore_streams = tolerant_streams()
    state = _Run(f"graphmax {argv[0]}" if argv and argv[0] in JOBS else "graphmax")
    # signal handlers can only be set from the main thread; a caller on another thread keeps its own, and a SIGTERM
    # a parent set to be ignored stays ignored
    on_main = threading.current_thread() is threading.main_thread()
    catch_term = on_main and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    previous = signal.signal(signal.SIGTERM, _terminate) if catch_term else None
    code = None
    try:
        try:
            code = _run(argv, state, entry and on_main)
            if entry and on_main:  # a signal before this line is an interrupt of the command, said below
                _exit_on_signal({how: state.ended_line(code, how) for how in _LATE})
        except KeyboardInterrupt:
            code = state.stopped("interrupted", 130, entry and on_main)
        except Terminated:
            code = state.stopped("terminated", 143, entry and on_main)
        return code
    finally:
        if entry and on_main:
            _settle_for_exit()
        if code is None or not (entry and on_main):  # an entry point's handlers stay: the process is ending
            if catch_term:  # None: a handler set outside Python, which cannot be put back; the default instead
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            if not entry:
                restore_streams()


def preload_resident() -> None:
    """What a resident process (:mod:`pipelines.resident`) imports before it serves: the model libraries, frozen,
    and every command's module."""
    from .models import import_model_libraries

    import_model_libraries(keep=True)
    for module in dict.fromkeys(JOBS.values()):
        importlib.import_module(f".{module}", __package__)


def _settle_for_exit() -> None:
    """The process' objects frozen (``gc.freeze``), so that the interpreter's exit does not scan them all (a second,
    once a model's libraries are in), unless an extension built with nanobind is loaded (triton, which transformers
    imports beside a torch built for CUDA): nanobind reports its objects still alive at exit as leaks, a hundred
    lines on stderr, so there they are thawed and collected as usual."""
    if _nanobind_loaded():
        gc.unfreeze()
    else:
        gc.freeze()


def _nanobind_loaded() -> bool:
    """Whether an extension module (or a submodule it made) holds a class of nanobind's (metaclass ``nb_meta``)."""
    for module in list(sys.modules.values()):
        if not str(getattr(module, "__file__", None) or "").endswith((".so", ".pyd")):
            continue
        for space in [module, *(v for v in vars(module).values() if isinstance(v, types.ModuleType)
                                and getattr(v, "__file__", None) is None)]:
            if any(isinstance(v, type) and type(v).__module__ == "nanobind" for v in list(vars(space).values())):
                return True
    return False


def _run(argv: list[str], state: _Run, owns_process: bool) -> int:
    """Parse ``argv`` and run its command; graphmax's and the file system's errors become one line and status 2.

    A command's ``check`` (set by its parser) refuses what reading a file tells, before torch is imported; a
    command whose parser sets ``loads_model`` then runs in this environment's resident process where the process is
    the command's own (``owns_process``, :mod:`pipelines.resident`), or has torch and transformers imported for it,
    frozen out of the collector's passes where it owns the process (:func:`pipelines.models.import_model_libraries`).
    """
    # a command's module, or for a help page every module; a line that names no command fails on bare parsers
    helps = any(arg in ("-h", "--help") for arg in argv)
    parser, commands = make_parser(argv) if helps or (argv and argv[0] in JOBS) else _parser([])
    args, extra = parser.parse_known_args(argv)
    if not hasattr(args, "run"):  # a bare parser took the command (options before it: `graphmax -x build`)
        parser, commands = _parser([JOBS[args.command]])
        args, extra = parser.parse_known_args(argv)
    if extra:  # argparse leaves these to the top parser: name the command they were given to
        commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    # after every other argument, so that a mistyped option is named first; before torch is imported; the cheapest
    # first (the corpus' check imports its readers, and pyarrow with them)
    bad = device_error(args) or model_error(args) or corpus_error(args) or graph_error(args)
    if bad:
        commands[args.command].error(bad)
    prog = state.prog = f"graphmax {args.command}"
    state.watch(args)
    try:
        if hasattr(args, "check"):
            args.check(args)
        if getattr(args, "loads_model", False):
            if owns_process:  # a resident with the libraries imported runs it; else one is started for the next
                from . import resident  # (it imports them beside this command, and is ready when it ends)

                code = resident.forward(argv)
                if code is not None:
                    return code
                resident.start(__package__ + ".cli")
            from .models import import_model_libraries

            import_model_libraries(keep=owns_process)
        return int(args.run(args) or 0)
    except GraphmaxError as e:
        cause = e.__cause__
        if isinstance(cause, OSError) and cause.errno == errno.ENAMETOOLONG:  # the wrapper's fix would be another's
            return fail(prog, os_error_message(cause, args))
        return fail(prog, str(e))
    except BrokenPipeError:  # `graphmax graphs list | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        if e.errno not in OS_ERRORS:
            raise
        return fail(prog, os_error_message(e, args))


class _Run:
    """What an interrupt's line says: the command, and whether the folder it writes was committed, known by
    comparing that folder as it was before the command ran with what is there when it stops.

    Every graphmax writer commits a graph, split, datastore or decoder choice in one step (a rename, or a manifest
    replaced), so a folder that changed was written whole; eval's report, written file by file, is complete only
    once its report.md is new.
    """

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.target: Path | None = None
        self.before: object = None
        self.started = False

    def watch(self, args: argparse.Namespace) -> None:
        self.started = True
        self.target = write_target(args)
        self.before = _state(self.target) if self.target is not None else None

    def outcome(self) -> str | None:
        """Whether the write was committed, in words; None when the command writes no folder."""
        if not self.started:
            return "nothing was written"
        if self.target is None:
            return None
        after = _state(self.target)
        if after == self.before:
            return f"nothing was written: {self.target} is as it was"
        if self.prog == "graphmax eval":  # report.md is written last: a new one means a whole report
            if any(entry[0] == "report.md" for entry in _entries(after) - _entries(self.before)):
                return f"the report in {self.target} was written whole"
            return f"{self.target} holds no complete report of this run (not committed)"
        return f"{self.target} was written whole before it stopped (committed)"

    def stopped(self, how: str, code: int, entry: bool) -> int:
        """Print the line of a command stopped by a signal (``how``: interrupted, terminated); returns ``code``."""
        if entry:  # another signal from here on: this line, at once, and the exit
            _exit_on_signal(dict.fromkeys(_LATE, f"{self.prog}: {how}\n"), code)
        outcome = self.outcome()
        line = f"{self.prog}: {how}" + (f"; {outcome}" if outcome else "")
        if entry:
            _exit_on_signal(dict.fromkeys(_LATE, f"{line}\n"), code)
        print(line, file=sys.stderr, flush=True)
        return code

    def ended_line(self, code: int, how: str) -> str:
        """The line a signal (``how``: interrupted, terminated) prints once the command has ended with ``code``."""
        outcome = self.outcome() if code == 0 else None
        written = f"; {outcome}" if outcome and not outcome.startswith("nothing") else ""
        return f"{self.prog}: {how} as it exited, after the command had ended with status {code}{written}\n"


def write_target(args: argparse.Namespace) -> Path | None:
    """The folder ``args``' command writes (a graph, a datastore, a report), or None."""
    from gm_graphs import graph_path
    from gm_graphs.store.folders import target_folder

    try:
        if args.command in ("build", "merge"):
            return target_folder(args.name, args.path)
        if args.command in ("datastore", "eval"):
            return Path(args.out)
        if args.command == "tune" or (args.command == "graphs" and args.run.__name__ == "run_upgrade"):
            return graph_path(args.graph_path if args.graph_path is not None else args.graph)
    except (GraphmaxError, AttributeError, TypeError, ValueError):  # the command refuses it in its own words
        return None
    return None


def _state(path: Path) -> object:
    """What ``path`` is now, to compare: None if absent, else its identity and that of each entry in it."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size
        entries = []
        for entry in os.scandir(path):
            with contextlib.suppress(FileNotFoundError):
                e = entry.stat(follow_symlinks=False)
                entries.append((entry.name, e.st_ino, e.st_mtime_ns, e.st_size))
        return st.st_dev, st.st_ino, frozenset(entries)
    except FileNotFoundError:
        return None
    except OSError as e:
        return ("unreadable", e.errno)


def _entries(state: object) -> frozenset:
    return state[2] if isinstance(state, tuple) and len(state) == 3 else frozenset()


_LATE = {"interrupted": signal.SIGINT, "terminated": signal.SIGTERM}
_late_lines: dict[int, bytes] = {}
_late_code: int | None = None


def _exit_on_signal(lines: dict[str, str], code: int | None = None) -> None:
    """From now on, a Ctrl-C or SIGTERM writes its line of ``lines`` (by the word for it: interrupted,
    terminated) to stderr and ends the process at once, with ``code`` (None: 128 + the signal)."""
    global _late_code
    _late_code = code
    for how, signum in _LATE.items():
        _late_lines[signum] = lines[how].encode("utf-8", "backslashreplace")
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _late_signal)


def _late_signal(signum, frame) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a flush this signal interrupted: what it held is lost either way
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, _late_lines.get(signum, b""))
    os._exit(128 + signum if _late_code is None else _late_code)


def tolerant_streams() -> Callable[[], None]:
    """stdout and stderr set to write what they cannot encode as backslash escapes (``\\udcff``), so that a path
    whose name is not UTF-8 (a str holding ``os.fsdecode``'s surrogates) prints on a strict UTF-8 stream instead of
    raising UnicodeEncodeError; returns the function that puts their error handlers back."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        if errors in ("backslashreplace", "surrogateescape", "replace") or not hasattr(stream, "reconfigure"):
            continue  # surrogateescape (the C locale's) writes the name's own bytes back
        with contextlib.suppress(ValueError, AttributeError, io.UnsupportedOperation):
            stream.reconfigure(errors="backslashreplace")
            changed.append((stream, errors))

    def restore() -> None:
        for stream, errors in changed:
            with contextlib.suppress(ValueError, AttributeError, io.UnsupportedOperation):
                stream.reconfigure(errors=errors)
    return restore


def fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return 2


def os_error_message(e: OSError, args: argparse.Namespace) -> str:
    """What the file system refused, on which path, and the fix."""
    what, fix = OS_ERRORS[e.errno]
    # a filename may also be bytes (a name that is not UTF-8) or an int (the descriptor of an open file: no path)
    named = [p for p in (e.filename, e.filename2) if isinstance(p, (str, bytes, os.PathLike))]
    if named:
        if e.errno == errno.ENAMETOOLONG:
            return f"{what}: {_too_long(named[0])}; {fix}"
        return f"{what}: {' → '.join(repr(os.fsdecode(p)) for p in named)}; {fix}"
    if isinstance(e.filename, int):  # a file the command opened: one of the paths it was given
        given = _given_paths(args)
        if len(given) == 1:
            return f"{what}: {given[0]!r}; {fix}"
        return f"{what} (on one of {', '.join(map(repr, given))}); {fix}" if given else f"{what}; {fix}"
    # a write that failed mid-file names no path: say where the command was writing
    target = next((getattr(args, k) for k in ("path", "out") if isinstance(getattr(args, k, None), (str, os.PathLike))),
                  None)
    if target is None:
        from gm_graphs import graphmax_home

        target = graphmax_home()
    return f"{what} (writing under {os.fspath(target)!r}); {fix}"


def _given_paths(args: argparse.Namespace) -> list[str]:
    """The paths among the command's options, in the order they were defined."""
    found = []
    for value in vars(args).values():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, os.PathLike):
                found.append(os.fsdecode(v))
    return found


def _too_long(path) -> str:
    """``path`` quoted, and whether one of its names or the whole of it is past the system's limit."""
    path = os.fsdecode(path)
    size = max(len(os.fsencode(part)) for part in path.split("/"))
    try:  # the limit of the nearest folder that exists (255 bytes on most file systems)
        folder = os.path.dirname(os.path.abspath(path))
        while not os.path.isdir(folder):
            folder = os.path.dirname(folder)
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if size > limit:
        return f"{path!r} (a name in it has {size} bytes; this file system allows {limit})"
    return f"{path!r} (the path has {len(os.fsencode(path)):,} bytes, more than the system allows)"


if __name__ == "__main__":
    sys.exit(main())
