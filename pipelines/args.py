"""Argument types that refuse a bad value while the command line is parsed, before any corpus or model is loaded.

Each is a ``type=`` or ``action=`` for ``add_argument``; the :class:`ArgumentParser` here reports what it raises in
one line, ``graphmax <command>: error: argument --x: <message>`` (see ``pipelines.cli``). This module imports
nothing heavy: a refusal comes before numpy, pyarrow or torch are imported.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from typing import NoReturn

from gm_graphs.errors import CorpusError, GraphmaxError

__all__ = ["ArgumentParser", "one_line", "MAX_SEED", "CLEAN_HELP", "integer", "number", "integers", "numbers",
           "nonblank", "CorpusFiles", "corpus_error", "graph_error", "model_error", "help_when_shown"]

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


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


# the largest seed: numpy's legacy seeds, torch's and the split's hash key all take it
MAX_SEED = 2**32 - 1

# what --clean does to every document read (gm_graphs' clean_review_text), wherever a command takes it
CLEAN_HELP = "unescape HTML entities and drop <br /> tags"


def integer(minimum: int, maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    """An integer ≥ ``minimum`` (and ≤ ``maximum``, for the reason ``why`` the message gives)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be an integer from {minimum} to {maximum:,}{why}, got {text!r}")
        return value

    return parse


def number(*, at_least: float | None = None, above: float | None = None,
           below: float | None = None) -> Callable[[str], float]:
    """A finite number within the given bounds (``nan`` and ``inf`` are refused)."""
    want = _describe(at_least, above, below)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not _within(value, at_least, above, below):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    return parse


def integers(minimum: int, example: str, maximum: int | None = None) -> Callable[[str], list[int]]:
    """Comma-separated integers, each ≥ ``minimum`` (and ≤ ``maximum``), at least one (``example`` shows the form)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"must be integers >= {minimum} separated by commas, like {example}, "
                                             f"got {text!r}")
        if maximum is not None and max(values) > maximum:
            raise argparse.ArgumentTypeError(f"must be integers from {minimum} to {maximum:,} separated by commas, "
                                             f"like {example}, got {text!r}")
        return values

    return parse


def numbers(*, at_least: float, example: str) -> Callable[[str], list[float]]:
    """Comma-separated finite numbers, each ≥ ``at_least``, at least one."""

    def parse(text: str) -> list[float]:
        try:
            values = [float(t) for t in text.split(",") if t.strip()]
        except ValueError:
            values = []
        if not values or not all(_within(v, at_least, None, None) for v in values):
            raise argparse.ArgumentTypeError(f"must be finite numbers >= {at_least:g} separated by commas, "
                                             f"like {example}, got {text!r}")
        return values

    return parse


def nonblank(text: str) -> str:
    """Any text that is not empty or only spaces."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty or only spaces")
    return text


class CorpusFiles(argparse.Action):
    """An ``action`` for corpus paths and globs. The value stays as given; ``corpus_error`` checks every file
    once all the arguments have parsed, so that a bad option is named before any file is opened."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.corpus_files = (self, values)


def corpus_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the corpus files a ``CorpusFiles`` argument named (as argparse words it), or None."""
    if not hasattr(args, "corpus_files"):
        return None
    from gm_graphs import expand_corpus  # the readers import pyarrow: only once a corpus is named

    action, values = vars(args).pop("corpus_files")
    try:
        expand_corpus(values)
    except CorpusError as e:
        return str(argparse.ArgumentError(action, str(e)))
    return None


def graph_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the graph ``add_graph_arguments`` (``pipelines.build``) parsed, told without reading it
    (a name that is no graph name, or nothing there), or None."""
    if not hasattr(args, "graph_path"):
        return None
    from gm_graphs.store.folders import missing_graph  # the standard library's modules only

    try:
        missing = missing_graph(args.graph_path if args.graph_path is not None else args.graph)
    except GraphmaxError as e:  # a name that is no graph name
        return str(e)
    except OSError:  # (graphs' folder unreadable, a name too long): the command's opening reports it in one line
        return None
    return None if missing is None else str(missing)


# what transformers reads a tokenizer from in a model folder: the fast tokenizer's file, or a slow tokenizer's
# vocabulary (SentencePiece, BPE, WordPiece, tiktoken), which tokenizer_config.json names the class of
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt")


def model_error(args: argparse.Namespace) -> str | None:
    """What is wrong with a ``--model`` folder that can be told before it loads (as argparse words it), or None:
    a folder with no tokenizer in it, which transformers reports only as a failed load."""
    spec = getattr(args, "model", None)
    if not isinstance(spec, (str, os.PathLike)) or not os.path.isdir(spec):
        return None
    from gm_graphs.tokenize.encoder import BUNDLED_ALIASES  # numba comes with it: only for a folder of that name

    if spec in BUNDLED_ALIASES:
        return None
    names = set(os.listdir(spec))
    if names.intersection(TOKENIZER_FILES) or any(name.endswith(".tiktoken") for name in names):
        return None
    return (f"argument --model: the model folder {os.fsdecode(spec)} has no tokenizer (no tokenizer.json, nor the "
            f"vocabulary of one: {', '.join(TOKENIZER_FILES[1:])}); save the model's tokenizer into it with "
            f"tokenizer.save_pretrained(folder)")


def help_when_shown(action: argparse.Action, text: Callable[[], str]) -> argparse.Action:
    """Give ``action`` the help ``text()``, computed only when a help page shows it.

    For a help that quotes what a module heavy to import defines (the corpus readers' suffixes: pyarrow, a third of
    a second), so that a command line parsed or refused without ``--help`` does not import it. Call it after
    ``add_argument``: Python 3.14's ``add_argument`` formats the help it is given at once.

    Args:
        action (``argparse.Action``): what ``add_argument`` returned.
        text (``Callable[[], str]``): makes the help, ``%(default)s`` and the like included.

    Returns:
        ``argparse.Action``: ``action``, its help set.

    Example::

        >>> parser = argparse.ArgumentParser(prog="p")
        >>> _ = help_when_shown(parser.add_argument("--x", default=3), lambda: "made when shown (default %(default)s)")
        >>> "made when shown (default 3)" in parser.format_help()
        True
    """
    action.help = _HelpWhenShown(text)
    return action


class _HelpWhenShown(str):
    """A help text argparse formats (``help % params``) by calling its maker then."""

    def __new__(cls, text: Callable[[], str]) -> _HelpWhenShown:
        self = super().__new__(cls, "(help)")  # what a formatter that does not format it would show
        self.text = text
        return self

    def __mod__(self, params) -> str:
        return self.text() % params


def _within(value: float, at_least: float | None, above: float | None, below: float | None) -> bool:
    return (math.isfinite(value) and (at_least is None or value >= at_least)
            and (above is None or value > above) and (below is None or value < below))


def _describe(at_least: float | None, above: float | None, below: float | None) -> str:
    if above is not None and below is not None:
        return f"a number strictly between {above:g} and {below:g}"
    bound = f" >= {at_least:g}" if at_least is not None else f" > {above:g}" if above is not None else ""
    return f"a finite number{bound}" + (f" below {below:g}" if below is not None else "")
