"""``graphmax generate``: continue prompts with a causal LM, decoding with a graph's graphmax decoder.

By default the decoder is the one ``graphmax tune`` stored in the graph (else context-aware graphmax with its
defaults); ``--decoder paper|context`` picks one, and each takes only its own options. ``--examples FILE`` puts
text from the domain (a few documents) before every prompt: the LM reads it, the context decoder's λ_t does not
count it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import statistics
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from gm_graphs import Graph, GraphmaxError, load_graph, load_tokenizer
from gm_graphs.build.options import MAX_ORDER
from gm_solver import (
    ContextGraphmaxLogitsProcessor,
    DecoderChoice,
    GraphmaxLogitsProcessor,
    HiddenStateTap,
    KnnContextGraphmaxLogitsProcessor,
    load_datastore,
)

from .args import MAX_SEED, integer, nonblank, number, numbers
from .build import add_graph_arguments, graph_arg
from .devices import add_device_arguments, resolve_device, resolve_dtype
from .models import DEFAULT_MODEL, check_fits, load_model
from .prompt import SEPARATOR

# each decoder's options (argparse dest); --order/--mixture choose which operator of the graph the paper one uses
OPTIONS = {
    "paper": ("lam", "tol", "solver", "max_iter", "order", "mixture"),
    "context": ("lam", "divergence", "kl_share", "ngram_order", "order_weights", "smoothing", "discount",
                "kappa", "alpha", "lam_decay"),
}
MAX_EXAMPLES_BYTES = 2**20  # --examples: the LM reads a few thousand tokens at most
KNN_OPTIONS = ("knn_weight", "knn_k", "knn_temperature", "marginal_weight")  # with --datastore (context only)
SOLVERS = ("mirror", "paper")  # --solver: PaperGraphmaxLogitsProcessor or PaperAlgorithm1LogitsProcessor


def generate_texts(model, tok, prompts: list[str], processor=None, *, max_new_tokens: int = 32,
                   do_sample: bool = False, seed: int = 0, top_k: int = 50,
                   prefix: list[int] | None = None) -> tuple[list[str], float]:
    """Continuations of ``prompts`` (one left-padded batch) and the wall time per generated token in ms;
    ``prefix``: token ids before each prompt (after the padding), e.g. few-shot examples."""
    tok.padding_side = "left"
    if prefix:
        rows = [list(prefix) + tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        batch = tok.pad({"input_ids": rows}, padding=True, return_tensors="pt")
    else:
        batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    batch = batch.to(model.device)
    torch.manual_seed(seed)
    extra = {"do_sample": True, "top_k": top_k, "temperature": 1.0} if do_sample else {"do_sample": False}
    t0 = time.perf_counter()
    with torch.no_grad(), padded(processor, batch["attention_mask"]):
        out = model.generate(**batch, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             logits_processor=LogitsProcessorList([processor] if processor else []),
                             pad_token_id=tok.pad_token_id, top_p=None, **extra)
    seconds = time.perf_counter() - t0
    new = out[:, batch["input_ids"].shape[1]:]
    return tok.batch_decode(new, skip_special_tokens=True), 1e3 * seconds / max_new_tokens


def padded(processor, attention_mask: torch.Tensor) -> contextlib.ExitStack:
    """A block in which every graphmax processor inside ``processor`` (itself, a list's members, a wrapper's
    ``inner``) reads the batch's left padding from ``attention_mask`` (``GraphmaxLogitsProcessor.padding``), so that
    a row decodes as it does alone; other processors are left as they are."""
    stack = contextlib.ExitStack()
    todo = [processor]
    while todo:
        p = todo.pop()
        if isinstance(p, (list, tuple)):
            todo.extend(p)
        elif hasattr(p, "inner"):
            todo.append(p.inner)
        elif hasattr(p, "padding"):
            stack.enter_context(p.padding(attention_mask))
    return stack


def warm_up(model, tok, processors: list[GraphmaxLogitsProcessor]) -> None:
    """Pay every first-call cost before anything is timed: numba compiling (or loading from its disk cache) each
    decoder's kernels, or its first steps on the model's device, and the model's first ``generate()`` (a two-token
    one)."""
    for proc in processors:
        proc.warmup(model.device, model.dtype)
    generate_texts(model, tok, ["Hello"], None, max_new_tokens=2)


class TimedLogitsProcessor(LogitsProcessor):
    """Wraps a logits processor and records how long each of its calls takes (``calls``, seconds)."""

    def __init__(self, inner: LogitsProcessor):
        self.inner, self.calls = inner, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        t0 = time.perf_counter()
        out = self.inner(input_ids, scores)
        self.calls.append(time.perf_counter() - t0)
        return out


def alternate(model, tok, prompts: list[str], size: int, rounds: int, timed: TimedLogitsProcessor,
              **generate) -> tuple[float, float, float]:
    """``rounds`` batches of ``size`` prompts, each decoded plain and with ``timed``, alternating which runs first
    (round r samples with seed r), so a shared machine's drift hits both alike: (plain ms per step, with the
    processor, the processor's median ms per call inside ``generate()``)."""
    plain, ours = [], []
    for r in range(rounds):
        batch = [prompts[(r * size + i) % len(prompts)] for i in range(size)]
        for proc in ([None, timed] if r % 2 == 0 else [timed, None]):
            (plain if proc is None else ours).append(generate_texts(model, tok, batch, proc, seed=r, **generate)[1])
    return statistics.mean(plain), statistics.mean(ours), 1e3 * statistics.median(timed.calls)


def decode_cost(model, tok, prompts: list[str], processor, *, max_new_tokens: int = 32) -> dict[str, float]:
    """Greedy decoding one prompt at a time (batch 1), plain and with ``processor`` (:func:`alternate`).

    Returns the mean ms/token of each, their ratio, and the processor's median ms
    per call inside ``generate()`` with the ratio that alone implies (which the
    drift of a shared machine between runs does not blur).
    """
    base, with_proc, own = alternate(model, tok, prompts, 1, len(prompts), TimedLogitsProcessor(processor),
                                     max_new_tokens=max_new_tokens)
    return {"plain_ms": base, "processor_run_ms": with_proc, "ratio": with_proc / base, "processor_ms": own,
            "implied_ratio": (base + own) / base}


def register(sub) -> None:
    p = sub.add_parser("generate", help="continue prompts with a graph's graphmax decoder (the tuned one by default)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (bundled), a .gguf file or a local folder")
    add_device_arguments(p)
    p.add_argument("--prompt", action="append", required=True, type=nonblank, help="a prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=integer(1), default=32)
    p.add_argument("--sample", action="store_true", help="sample (top-k 50) instead of greedy")
    p.add_argument("--seed", type=integer(0, MAX_SEED), default=0)
    p.add_argument("--compare", action="store_true", help="also print the plain softmax continuation")
    p.add_argument("--examples", type=Path, metavar="FILE",
                   help="UTF-8 text the LM reads before every prompt, e.g. a few documents of your corpus separated "
                        "by blank lines (few-shot); the context decoder's λ_t counts the prompt's tokens only")
    # the graph, and its decoder: each decoder's options are refused with the other (defaults: the stored choice)
    add_graph_arguments(p, "--graph")
    p.add_argument("--decoder", choices=tuple(OPTIONS),
                   help="default: the decoder `graphmax tune` stored in the graph, else context")
    p.add_argument("--lam", type=number(at_least=0),
                   help="λ (0 = softmax); default: the stored choice, else 1.0 (paper) or 1.2")
    p.add_argument("--tol", type=number(above=0), help="paper: duality gap per step (default 1e-6)")
    p.add_argument("--solver", choices=SOLVERS,
                   help="paper: certified mirror descent (mirror, the default) or the paper's Algorithm 1 (paper)")
    p.add_argument("--max-iter", type=integer(1), help="paper: iterations per step (default 200)")
    p.add_argument("--order", type=integer(1, MAX_ORDER), help="paper: use Ãᵏ (default 1)")
    p.add_argument("--mixture", type=integer(2, MAX_ORDER), help="paper: use Ã+…+Ãⁿ (n ≥ 2)")
    p.add_argument("--divergence", choices=ContextGraphmaxLogitsProcessor.DIVERGENCES,
                   help="context: D(x, q) (default rkl)")
    p.add_argument("--kl-share", type=number(at_least=0), help="context: the share of λ on KL(x‖q) (default 0.15)")
    p.add_argument("--ngram-order", type=integer(2), help="context: longest n-gram conditioning q (default 4)")
    p.add_argument("--order-weights", type=numbers(at_least=0, example="0.8,0.2"),
                   help="context: β_k for the token k back, e.g. 0.8,0.2")
    p.add_argument("--smoothing", choices=ContextGraphmaxLogitsProcessor.SMOOTHINGS,
                   help="context: the bigram row's smoothing (default kneser-ney)")
    p.add_argument("--discount", type=number(above=0, below=1), help="context: Kneser–Ney's D (default 0.75)")
    p.add_argument("--kappa", type=number(above=0), help="context: the Dirichlet prior κ (default 3)")
    p.add_argument("--alpha", type=number(above=0), help="context: add-α of the unigram (default 0.5)")
    p.add_argument("--datastore", type=Path, metavar="DIR",
                   help="context: also lean toward a kNN datastore of this model's hidden states (graphmax datastore)")
    p.add_argument("--knn-weight", type=number(above=0),
                   help="with --datastore: its share β in the reference (default: what `graphmax tune --datastore` "
                        "stored for this datastore, else 0.5)")
    p.add_argument("--knn-k", type=integer(1), help="with --datastore: neighbours read (default 1024)")
    p.add_argument("--knn-nprobe", type=integer(1),
                   help="with --datastore that has an index (--ivf-lists): lists read per search (default 32)")
    p.add_argument("--knn-temperature", type=number(above=0),
                   help="with --datastore: T of softmax(−d/T) over squared distances (default: as --knn-weight, "
                        "else 50)")
    p.add_argument("--marginal-weight", type=number(at_least=0),
                   help="with --datastore: the weight of its marginal bias on the LM's scores (default: as "
                        "--knn-weight, else 0: none)")
    p.add_argument("--lam-decay", type=number(at_least=0),
                   help="context: γ in λ_t = λ·t^(−γ) after t tokens of context (default 0: λ constant)")
    p.set_defaults(run=run, quick_start=True)  # numba compiles in the background where it has not (pipelines.cli)


def build_decoder(args, prompt_length: int = 0,
                  device: torch.device | None = None) -> tuple[Graph, GraphmaxLogitsProcessor, str]:
    """The graph, the decoder ``args`` ask for and where its settings come from; all checked before any model loads.

    ``GraphmaxLogitsProcessor.from_graph`` makes the decoder: the graph's stored choice (``graphmax tune``) when it
    is of the kind asked for (or no kind is asked for), overridden by the options given. Here only the command
    line's own rules are checked: an option of the other decoder, or one that has no effect, is an error.
    ``prompt_length``: the tokens of ``--examples`` before each prompt (the context decoder's λ_t skips them);
    ``device``: where a datastore's keys are loaded (the model's device: its search then needs no copy per step).
    """
    source = graph_arg(args)
    graph = load_graph(source)
    given = {name: getattr(args, name) for options in OPTIONS.values() for name in options
             if getattr(args, name) is not None}
    kind = args.decoder or DecoderChoice.stored_mode(graph) or "context"  # the kind from_graph will make
    for name in given:
        if name not in OPTIONS[kind]:
            other = " or ".join(k for k, options in OPTIONS.items() if name in options)
            hint = "" if args.decoder else f" (this graph's {'stored' if graph.decoder else 'default'} decoder is " \
                                           f"{kind})"
            raise GraphmaxError(f"--{name.replace('_', '-')} applies to --decoder {other}{hint}")
    if kind == "paper" and (args.order is not None or args.mixture is not None):
        graph = load_graph(source, order=args.order or 1, mixture=args.mixture)
    settings = {k: v for k, v in given.items() if k not in ("order", "mixture", "solver")}
    if args.solver == "paper":
        for name in ("tol", "max_iter"):
            if name in settings:
                raise GraphmaxError(f"--{name.replace('_', '-')} has no effect with --solver paper: the paper's "
                                    f"Algorithm 1 runs its own T = 20 steps and stopping rule")
    extra = {"prompt_length": prompt_length} if kind == "context" and prompt_length else {}
    knn = {k: getattr(args, k) for k in KNN_OPTIONS if getattr(args, k) is not None}
    if args.datastore is None and (knn or args.knn_nprobe is not None):
        name = next(iter(knn), "knn_nprobe")
        raise GraphmaxError(f"--{name.replace('_', '-')} applies with --datastore DIR only")
    if args.datastore is not None and kind != "context":
        raise GraphmaxError("--datastore applies to the context decoder; leave out --decoder paper")
    datastore = None if args.datastore is None else load_datastore(
        args.datastore, **({} if device is None else {"device": device}),
        **({} if args.knn_nprobe is None else {"nprobe": args.knn_nprobe}))
    with_store = {} if datastore is None else {"datastore": datastore, "tap": HiddenStateTap()}
    try:
        proc = GraphmaxLogitsProcessor.from_graph(graph, decoder=args.decoder, solver=args.solver, **with_store,
                                                  **settings, **extra, **knn)
    except (TypeError, ValueError) as e:
        raise GraphmaxError(str(e)) from e
    stored = DecoderChoice.stored_mode(graph)
    origin = "stored by graphmax tune" if proc.origin == "stored" else \
        "defaults" + (f" (the graph stores a {stored} decoder)" if stored else "")
    if args.solver is not None:
        settings["solver"] = args.solver
    if settings:
        origin += ", with " + " ".join(f"--{k.replace('_', '-')} {_show(v)}" for k, v in settings.items())
    if datastore is None:
        return graph, proc, origin
    where = {"stored": "stored by graphmax tune --datastore",
             "stored for another datastore": "defaults (the graph's were tuned with another datastore)"}.get(
        proc.config.source.get("knn"), "defaults")
    keys = f"{len(datastore):,} keys" + (f", {datastore.nprobe} of its {datastore.meta['ivf_lists']:,} lists a "
                                          "search" if datastore.approximate else "")
    return graph, proc, origin + f"; kNN datastore {args.datastore} ({keys}), β, T, marginal weight: {where}"


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(f"{v:g}" for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def read_examples(path: Path) -> str:
    """The text of ``--examples``, ending in a blank line so that a prompt reads as the next document."""
    # opened without blocking and looked at before reading: a FIFO or a device would never end; looked at before
    # open() wraps the descriptor, which refuses a folder with an error that names the descriptor, not the path
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise GraphmaxError(f"--examples {path} is {kind}; write the examples to a file and pass that")
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb") as fh:
        data = fh.read(MAX_EXAMPLES_BYTES + 1)  # to the cap only
    if len(data) > MAX_EXAMPLES_BYTES:
        raise GraphmaxError(f"--examples {path} is larger than {MAX_EXAMPLES_BYTES // 2**20} MiB, far more than the "
                            f"model reads; give a few documents")
    try:
        text = data.decode("utf-8-sig")  # (an editor's byte-order mark is no text)
    except UnicodeDecodeError as e:
        raise GraphmaxError(f"--examples {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    if not text.strip() or "\x00" in text:
        raise GraphmaxError(f"--examples {path} holds no text (empty, blank or binary); give a few documents of your "
                            f"corpus separated by blank lines")
    return text.strip() + SEPARATOR


def run(args) -> int:
    device = resolve_device(args.device)  # a GPU asked for and absent is named before anything loads
    dtype = resolve_dtype(args.dtype, device)
    prefix = None
    if args.examples is not None:  # its tokens, for the decoder's λ_t, from the model's tokenizer alone
        examples = read_examples(args.examples)  # a bad file is refused before the tokenizer's seconds of loading
        prefix = load_tokenizer(args.model)(examples, add_special_tokens=False)["input_ids"]
    # the graph and every option are checked before the model loads
    graph, proc, origin = build_decoder(args, len(prefix or ()), device)
    model, tok = load_model(args.model, device=device, dtype=dtype)
    check_fits(graph, model, tok)
    longest = len(prefix or ()) + max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in args.prompt)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and longest + args.max_new_tokens > limit:  # past them a model's output is garbage
        total = longest + args.max_new_tokens
        if prefix:
            raise GraphmaxError(f"--examples {args.examples} ({len(prefix):,} tokens), the longest prompt and "
                                f"--max-new-tokens make {total:,} tokens, more than the model reads ({limit:,}); "
                                f"give fewer or shorter examples")
        raise GraphmaxError(f"--max-new-tokens {args.max_new_tokens:,} and the longest prompt ({longest:,} tokens) "
                            f"make {total:,} tokens, more than the model reads ({limit:,}); lower --max-new-tokens")
    if prefix:
        origin += f"; after {len(prefix):,} tokens of --examples"
    if isinstance(proc, KnnContextGraphmaxLogitsProcessor):
        proc.datastore.check_model(model)
        proc.tap.attach(model)  # each step's hidden states, for the datastore's search
    warm_up(model, tok, [proc])
    label = "context graphmax" if isinstance(proc, ContextGraphmaxLogitsProcessor) else "paper graphmax"
    path = f", its step {proc.backend}" if getattr(proc, "backend", None) else ""  # the context decoders'
    print(f"model: {args.model} on {device} in {str(dtype).removeprefix('torch.')}\ngraph: {graph!r}\n"
          f"decoder: {proc!r}\n  settings: {origin}\n  warm-up: {proc.warmup_seconds:.1f} s{path}")
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, seed=args.seed, prefix=prefix)
    texts, ms = generate_texts(model, tok, args.prompt, proc, **kw)
    plain, plain_ms = generate_texts(model, tok, args.prompt, None, **kw) if args.compare else (None, None)
    for i, prompt in enumerate(args.prompt):
        print(f"prompt: {prompt}")
        if plain is not None:
            print(f"  {'softmax':<{len(label)}} : {plain[i].strip()}")
        print(f"  {label} : {texts[i].strip()}")
    print(f"time per token: {label} {ms:.1f} ms" + (f", softmax {plain_ms:.1f} ms" if plain_ms else ""))
    return 0
