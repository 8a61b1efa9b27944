"""The ``graphmax`` console script: one sub-command per job module.

A user error ends one way: one line on stderr, ``graphmax <command>: error: <message>``, and exit
status 2. That covers bad arguments (refused while parsing, before any corpus or model is loaded),
graphmax's own errors (``GraphmaxError``) and the file system's (no space, no permission, no such
file), which name the path. Any other exception is a bug and keeps its traceback.

SIGTERM (``kill``'s default, and what schedulers send) ends a command as Ctrl-C does: it is raised in the main
thread as :class:`Terminated`, so the cleanup a failure runs (a staged folder removed, a lock released) runs too,
and the command prints one line and exits with status 143 (128 + SIGTERM). A second SIGTERM while that cleanup
runs ends the process at once, as a kill would; the next writer of that graph removes what it left.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from gm_graphs import GraphmaxError

from .args import corpus_error

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
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is; a BaseException like KeyboardInterrupt, so that no ``except
    Exception`` takes it for a failure and goes on."""


def _terminate(signum, frame) -> NoReturn:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one while the cleanup runs: stop at once
    raise Terminated


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are graphmax's: one line on stderr and exit status 2, without the usage block.

    ``add_subparsers`` makes every sub-parser of this class too.
    """

    def error(self, message: str) -> NoReturn:
        hint = "" if "; " in message else f"; see `{self.prog} --help`"  # a message with its fix needs none
        self.exit(2, f"{self.prog}: error: {one_line(message)}{hint}\n")


def one_line(message: str) -> str:
    """``message`` on one line: line breaks become spaces, other control characters are escaped."""
    message = " ".join(part.strip() for part in message.splitlines() if part.strip())
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", message)


def make_parser(argv: list[str]) -> tuple[ArgumentParser, dict[str, ArgumentParser]]:
    """The parser and its command parsers, with only the command's module imported when ``argv`` starts
    with a command (``graphmax build`` needs no torch); every module for help and mistyped commands."""
    parser = ArgumentParser(prog="graphmax", description=DESCRIPTION, epilog=EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = [JOBS[argv[0]]] if argv and argv[0] in JOBS else list(dict.fromkeys(JOBS.values()))
    for module in modules:
        importlib.import_module(f".{module}", __package__).register(sub)
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
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, commands = make_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse leaves these to the top parser: name the command they were given to
        commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    bad_corpus = corpus_error(args)  # checked after every other argument: a mistyped option is named first
    if bad_corpus:
        commands[args.command].error(bad_corpus)
    prog = f"graphmax {args.command}"
    # signal handlers can only be set from the main thread; a caller on another thread keeps its own, and a SIGTERM
    # a parent set to be ignored stays ignored
    on_main = threading.current_thread() is threading.main_thread() \
        and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main else None
    try:
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
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return 143
    finally:
        if on_main:  # None: a handler set outside Python, which cannot be put back from here; the default instead
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


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
