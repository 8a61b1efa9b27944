"""The eval's sizes and grids: what its defaults and ``--full`` mean, read by its parser before anything heavy loads
(``pipelines.eval.cli``) and by the run (``pipelines.eval.experiment``)."""

from __future__ import annotations

SIZES = {  # documents and tokens per step; --full uses the second set
    "default": dict(ppl_docs=48, positions=64, tune_docs=24, prompts=8, new_tokens=24, references=2000),
    "full": dict(ppl_docs=200, positions=64, tune_docs=100, prompts=48, new_tokens=48, references=20000),
}
# the paper's decoders' λ grids (--lams, --mixture-lams): each λ costs 45–125 s of scoring in the default run on
# movie reviews, so the default keeps a decade apart and one mixture, within 15 minutes
PAPER_GRIDS = {"default": dict(lams=[0.0, 0.1, 1.0, 10.0], mixture_lams=[0.1]),
               "full": dict(lams=[0.0, 0.1, 0.3, 1.0, 3.0, 10.0], mixture_lams=[0.1, 1.0])}
PROMPT_DOC_TOKENS = (8, 160)  # the training documents a few-shot prompt takes, in tokens: 4 shots stay under 650


def run_sizes(args) -> dict[str, int]:
    """``SIZES``' default (or ``--full``'s) set, with each size the command line gives instead."""
    sizes = dict(SIZES["full" if args.full else "default"])
    for key in sizes:
        if getattr(args, key, None):
            sizes[key] = getattr(args, key)
    return sizes
