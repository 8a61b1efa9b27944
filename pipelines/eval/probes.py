"""What the figures show beside the tables: the solvers' convergence on the paper's context, the top-10 next
tokens after a test opening under a few decoders, and the λ curves of the paper's decoder."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from gm_graphs import Graph
from gm_solver import PaperGraphmaxLogitsProcessor, log_graphmax

from .. import figures
from .roster import LM, OURS, SOFTMAX, Decoder, DecoderId, paper

PAPER_CONTEXT = "I was so disappointed by this, and at this stage I was going to"
TRACE_LAM = 1.0  # the λ the solvers are traced at


@dataclasses.dataclass(frozen=True)
class SolverTrace:
    """One solver's iterations on one solve.

    Args:
        label: the figure's legend.
        gap: the duality gap after each iteration.
        step: ‖xᵗ⁺¹ − xᵗ‖ per iteration (only Algorithm 1 traces it; empty for ours).
    """

    label: str
    gap: list[float]
    step: list[float]


def solver_traces(graph: Graph, model, tok) -> dict[str, SolverTrace]:
    """The paper's Algorithm 1 and ours at ``TRACE_LAM`` on ``PAPER_CONTEXT``.

    Args:
        graph: the graph.
        model, tok: the base LM and its tokenizer.

    Returns:
        Per solver, as ``log_graphmax`` names it ("paper", "mirror"), its trace.
    """
    z = next_token_logits(model, tok, PAPER_CONTEXT).double()
    out = {}
    for solver, label in (("paper", "paper Algorithm 1"), ("mirror", "ours (mirror descent)")):
        _, info = log_graphmax(z, graph, TRACE_LAM, solver=solver, return_info=True, trace=True)
        steps = [float(s[0]) for s in info.step_trace] if solver == "paper" else []
        out[solver] = SolverTrace(label, [float(g[0]) for g in info.gap_trace], steps)
    return out


def next_token_logits(model, tok, text: str) -> torch.Tensor:
    """The LM's logits for the token after ``text``, shape (1, vocabulary)."""
    with torch.no_grad():
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]], device=model.device)
        return model(input_ids=ids).logits[0, -1:]


def top_token_panels(graph: Graph, model, decoders: dict[DecoderId, Decoder],
                     finetuned_model=None) -> dict[str, tuple[object, object]]:
    """The top-10 figure's panels: title → (model, processor; None: softmax): softmax, the paper's decoder at λ = 1
    (made for it when the grid lacks that λ), ours, and the fine-tuned LM when there is one."""
    paper1 = decoders.get((LM.BASE, paper(1.0)))
    panels = {"softmax": (model, None),
              "paper graphmax Ã λ=1": (model, PaperGraphmaxLogitsProcessor(graph, lam=1.0) if paper1 is None
                                       else paper1.processor),
              "context graphmax (ours)": (model, decoders[LM.BASE, OURS].processor)}
    if finetuned_model is not None:
        panels["fine-tuned LM (LoRA)"] = (finetuned_model, None)
    return panels


def top_tokens(tok, panels: dict[str, tuple[object, object]], context: str) -> dict[str, list[tuple[str, float]]]:
    """The 10 most likely next tokens after ``context``, with their probabilities, for each panel's (model,
    processor; None: softmax)."""
    out = {}
    for name, (model, proc) in panels.items():
        ids = torch.tensor([tok(context, add_special_tokens=False)["input_ids"]], device=model.device)
        z = next_token_logits(model, tok, context)
        logp = torch.log_softmax(z.double(), -1) if proc is None else proc(ids, z).double()
        top = torch.topk(logp[0].exp(), 10)
        out[name] = [(tok.decode([i]), float(p)) for p, i in zip(top.values, top.indices)]
    return out


def draw(out: Path, lams: list[float], perplexity: dict[DecoderId, dict], generation: dict[DecoderId, dict],
         traces: dict[str, SolverTrace], top10: dict[str, list[tuple[str, float]]], probe: str, window: int) -> None:
    """The report's four figures: λ against perplexity over ``window`` and against BLEU-2…5 (λ = 0: softmax),
    the solver traces, and the top-10 tokens after ``probe``."""
    grid = [(LM.BASE, SOFTMAX if lam == 0 else paper(lam)) for lam in lams]
    figures.lambda_curves(out / "lambda_perplexity.png", lams,
                          {"paper graphmax Ã": [perplexity[d][f"perplexity_{window}"] for d in grid]},
                          f"held-out perplexity (first {window} tokens)",
                          baseline=perplexity[LM.BASE, OURS][f"perplexity_{window}"],
                          baseline_label=perplexity[LM.BASE, OURS]["decoder"])
    series = {f"BLEU-{n}": [generation[d][f"BLEU-{n}"] for d in grid] for n in (2, 3, 4, 5)}
    figures.lambda_curves(out / "lambda_bleu.png", lams, series, "BLEU vs held-out references")
    figures.solver_traces(out / "solver_convergence.png",
                          {t.label: {"gap": t.gap, "step": t.step} for t in traces.values()})
    figures.top_tokens(out / "top10_tokens.png", probe, top10)
