"""``graphmax generate``: continue prompts with a causal LM, with softmax or graphmax decoding."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from gm_graphs import load_graph
from gm_solver import GraphmaxLogitsProcessor

from .args import integer, nonblank, number
from .build import add_graph_arguments, graph_arg
from .models import DEFAULT_MODEL, load_model


def generate_texts(model, tok, prompts: list[str], processor=None, *, max_new_tokens: int = 32,
                   do_sample: bool = False, seed: int = 0, top_k: int = 50) -> tuple[list[str], float]:
    """Continuations of ``prompts`` (one left-padded batch) and the wall time per generated token in ms."""
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    extra = {"do_sample": True, "top_k": top_k, "temperature": 1.0} if do_sample else {"do_sample": False}
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             logits_processor=LogitsProcessorList([processor] if processor else []),
                             pad_token_id=tok.pad_token_id, top_p=None, **extra)
    seconds = time.perf_counter() - t0
    new = out[:, batch["input_ids"].shape[1]:]
    return tok.batch_decode(new, skip_special_tokens=True), 1e3 * seconds / max_new_tokens


class TimedLogitsProcessor(LogitsProcessor):
    """Wraps a logits processor and records how long each of its calls takes (``calls``, seconds)."""

    def __init__(self, inner: LogitsProcessor):
        self.inner, self.calls = inner, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        t0 = time.perf_counter()
        out = self.inner(input_ids, scores)
        self.calls.append(time.perf_counter() - t0)
        return out


def decode_cost(model, tok, prompts: list[str], processor, *, max_new_tokens: int = 32) -> dict[str, float]:
    """Greedy decoding one prompt at a time (batch 1), plain and with ``processor``, alternating prompt by prompt.

    Returns the mean ms/token of each, their ratio, and the processor's median ms
    per call inside ``generate()`` with the ratio that alone implies (which the
    drift of a shared machine between runs does not blur).
    """
    timed = TimedLogitsProcessor(processor)
    plain, graph = [], []
    for p in prompts:
        plain.append(generate_texts(model, tok, [p], None, max_new_tokens=max_new_tokens)[1])
        graph.append(generate_texts(model, tok, [p], timed, max_new_tokens=max_new_tokens)[1])
    base, with_proc = statistics.mean(plain), statistics.mean(graph)
    own = 1e3 * statistics.median(timed.calls)
    return {"plain_ms": base, "processor_run_ms": with_proc, "ratio": with_proc / base, "processor_ms": own,
            "implied_ratio": (base + own) / base}


def register(sub) -> None:
    p = sub.add_parser("generate", help="continue prompts with softmax and graphmax decoding")
    p.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (bundled), a .gguf file or a local folder")
    add_graph_arguments(p, "--graph")
    p.add_argument("--order", type=integer(1), default=1, help="use Ãᵏ (default 1)")
    p.add_argument("--mixture", type=integer(2), default=None, help="use Ã+…+Ãⁿ (n ≥ 2)")
    p.add_argument("--lam", type=number(at_least=0), default=1.0, help="λ (0 = softmax)")
    p.add_argument("--tol", type=number(above=0), default=1e-6, help="duality gap per step")
    p.add_argument("--solver", default="auto", choices=["auto", "paper"])
    p.add_argument("--prompt", action="append", required=True, type=nonblank,
                   help="a prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=integer(1), default=32)
    p.add_argument("--sample", action="store_true", help="sample (top-k 50) instead of greedy")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--compare", action="store_true", help="also print the plain softmax continuation")
    p.set_defaults(run=run)


def run(args) -> int:
    graph = load_graph(graph_arg(args), args.order, args.mixture)  # refused before the model loads
    model, tok = load_model(args.model)
    graph.check_tokenizer(tok)
    proc = GraphmaxLogitsProcessor(graph, lam=args.lam, tol=args.tol, solver=args.solver)
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, seed=args.seed)
    texts, ms = generate_texts(model, tok, args.prompt, proc, **kw)
    plain, plain_ms = generate_texts(model, tok, args.prompt, None, **kw) if args.compare else (None, None)
    for i, prompt in enumerate(args.prompt):
        print(f"prompt: {prompt}")
        if plain is not None:
            print(f"  softmax         : {plain[i].strip()}")
        print(f"  graphmax λ={args.lam:<5g}: {texts[i].strip()}")
    print(f"time per token: graphmax {ms:.1f} ms" + (f", softmax {plain_ms:.1f} ms" if plain_ms else ""))
    return 0
