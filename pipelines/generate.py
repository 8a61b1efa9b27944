"""``graphmax generate``: continue prompts with a causal LM, decoding with a graph's graphmax decoder.

By default the decoder is the one ``graphmax tune`` stored in the graph (else context-aware graphmax with its
defaults); ``--decoder KIND`` picks a kind from the table of decoder kinds (``gm_solver.decoders``), and each kind
takes only its own options, made from its settings' fields. ``--examples FILE`` puts text from the domain (a few
documents) before every prompt: the LM reads it, the context decoder's λ_t does not count it.

The options are read and checked before torch, transformers or the graph load (``pipelines.decoding`` decodes).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path

from gm_graphs.errors import GraphFormatError, GraphmaxError
from gm_solver.arguments import options
from gm_solver.decoders import DecoderKind, kind, kinds

from .args import MAX_SEED, integer, nonblank
from .build import add_graph_arguments, graph_arg
from .devices import add_device_arguments, resolve_device, resolve_dtype
from .models import DEFAULT_MODEL
from .prompt import SEPARATOR

MAX_EXAMPLES_BYTES = 2**20  # --examples: the LM reads a few thousand tokens at most


def _finite(text: str) -> float:
    value = float(text) if _is_float(text) else math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    values = [t for t in text.split(",") if t.strip()]
    if not values or not all(_is_float(t) and math.isfinite(float(t)) for t in values):
        raise argparse.ArgumentTypeError(f"must be finite numbers separated by commas, like 0.8,0.2, got {text!r}")
    return tuple(float(t) for t in values)


READ = {"float": _finite, "int": _int, "floats": _floats, "str": str}  # gm_solver.arguments.option's `reads`


def _groups(k: DecoderKind) -> list[type]:
    """The settings classes whose options ``k`` takes: its settings, the operator of the graph it reads, and its
    kNN settings with a datastore."""
    return [c for c in (k.settings, k.graph_settings, k.datastore_settings) if c is not None]


def decoder_options() -> dict[str, list[tuple[DecoderKind, dataclasses.Field, bool]]]:
    """Each decoder option's name → the kinds that take it: (kind, field, whether it is a kNN setting)."""
    table: dict[str, list] = {}
    for k in kinds().values():
        for group in _groups(k):
            for f in options(group):
                table.setdefault(f.name, []).append((k, f, group is k.datastore_settings))
    return table


def add_decoder_arguments(p: argparse.ArgumentParser) -> None:
    """``--decoder`` and every registered kind's options (each kind's settings fields declared with ``option``), a
    kind's kNN settings after ``--datastore``; none has a default here: a value not given is the stored choice's."""
    p.add_argument("--decoder", choices=tuple(kinds()),
                   help="default: the decoder `graphmax tune` stored in the graph, else context")
    later = []
    for name, takers in decoder_options().items():
        k, f, knn = takers[0]
        whose = "with --datastore" if knn else ", ".join(t.name for t, _, _ in takers)
        defaults = "; ".join(f"{t.name}: {_show(g.default)}" for t, g, _ in takers) if len(takers) > 1 else \
            _show(f.default)
        text = f"{whose}: {f.metadata['help']} (default: the stored choice, else {defaults})"
        args = (f"--{name.replace('_', '-')}",)
        kw = dict(type=_checked(name, takers), choices=f.metadata["choices"], help=text, dest=name)
        if knn:
            later.append((args, kw))
        else:
            p.add_argument(*args, **kw)
    p.add_argument("--datastore", type=Path, metavar="DIR",
                   help="also lean toward a kNN datastore of this model's hidden states (graphmax datastore), for a "
                        "decoder that takes one (context)")
    p.add_argument("--knn-nprobe", type=integer(1),
                   help="with --datastore that has an index (--ivf-lists): lists read per search (default 32)")
    for args, kw in later:
        p.add_argument(*args, **kw)


def _checked(name: str, takers: list) -> Callable[[str], object]:
    """The option's reader: the text read as its type, then checked by the settings of the kinds that take it (one
    accepting it is enough here; the kind's own, with the other options, is checked when the decoder is built), so
    that a value out of range is refused while parsing, in the settings' own words."""
    read = READ[takers[0][1].metadata["reads"]]

    def parse(text: str):
        value = read(text)
        errors = []
        for k, f, _ in takers:
            group = next(g for g in _groups(k) if f in dataclasses.fields(g))
            try:
                group(**{name: value})
                return value
            except (TypeError, ValueError) as e:
                errors.append(str(e).replace(f"`{name}` ", "", 1))
        raise argparse.ArgumentTypeError(errors[0])

    parse.__name__ = name  # argparse names the type in "invalid <name> value"
    return parse


def given_options(args: argparse.Namespace) -> dict:
    """The decoder options given on the command line (name → value)."""
    return {name: getattr(args, name) for name in decoder_options() if getattr(args, name, None) is not None}


def _flags(message: str) -> str:
    """A settings class' message with its fields named as the options they are (`kl_share` → --kl-share)."""
    for name in decoder_options():
        message = message.replace(f"`{name}`", f"--{name.replace('_', '-')}")
    return message


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
    # the graph, and its decoder: each kind's options are refused with another (defaults: the stored choice)
    add_graph_arguments(p, "--graph")
    add_decoder_arguments(p)
    p.set_defaults(run=run, loads_model=True)


def decoder_kind(args, graph) -> DecoderKind:
    """The kind of decoder ``args`` ask for from ``graph``: ``--decoder``, else the graph's stored one, else context.

    Raises:
        GraphmaxError: the graph stores a decoder of a kind not registered here.
    """
    from gm_solver import DecoderChoice

    try:
        return kind(args.decoder or DecoderChoice.stored_kind(graph) or "context")
    except ValueError as e:
        raise GraphmaxError(f"graph {graph_arg(args)} stores a decoder of a kind not registered here: {e}") from None


def build_decoder(args, prompt_length: int = 0, device=None, graph=None):
    """The graph, the decoder ``args`` ask for and where its settings come from; all checked before any model loads.

    ``GraphmaxLogitsProcessor.from_graph`` makes the decoder: the graph's stored choice (``graphmax tune``) when it
    is of the kind asked for (or no kind is asked for), overridden by the options given. Here only the command
    line's own rules are checked: an option of another kind is an error.
    ``prompt_length``: the tokens of ``--examples`` before each prompt (the context decoder's λ_t skips them);
    ``device``: where a datastore's keys are loaded (the model's device: its search then needs no copy per step);
    ``graph``: the graph ``args`` name, loaded already.

    Returns:
        ``(graph, decoder, origin)``: the graph (loaded at the operator the kind reads), the logits processor, and a
        line saying where its settings came from.
    """
    from gm_graphs import load_graph
    from gm_solver import DecoderChoice, GraphmaxLogitsProcessor, load_datastore

    source = graph_arg(args)
    graph = load_graph(source) if graph is None else graph
    stored = DecoderChoice.stored_kind(graph)
    chosen = decoder_kind(args, graph)
    given = given_options(args)
    own = {g: {f.name for f in options(g)} for g in _groups(chosen)}
    for name in given:
        if not any(name in names for names in own.values()):
            other = " or ".join(t.name for t, _, _ in decoder_options()[name])
            hint = "" if args.decoder else f" (this graph's {'stored' if stored else 'default'} decoder is " \
                                           f"{chosen.name})"
            raise GraphmaxError(f"--{name.replace('_', '-')} applies to --decoder {other}{hint}")
    pick = {g: {k: v for k, v in given.items() if k in names} for g, names in own.items()}
    knn = pick.get(chosen.datastore_settings, {}) if chosen.datastore_settings is not None else {}
    if args.datastore is None and (knn or args.knn_nprobe is not None):
        name = next(iter(knn), "knn_nprobe")
        raise GraphmaxError(f"--{name.replace('_', '-')} applies with --datastore DIR only")
    if args.datastore is not None and chosen.datastore_settings is None:
        takes = [k.name for k in kinds().values() if k.datastore_settings is not None]
        raise GraphmaxError(f"--datastore applies to the {' or '.join(takes)} decoder; leave out --decoder "
                            f"{chosen.name}")
    if chosen.graph_settings is not None and pick[chosen.graph_settings]:
        try:
            at = chosen.graph_settings(**pick[chosen.graph_settings])
        except (TypeError, ValueError) as e:
            raise GraphmaxError(_flags(str(e))) from None
        graph = load_graph(source, **dataclasses.asdict(at))
    settings = pick[chosen.settings]
    step = chosen.step_class()
    extra = {"prompt_length": prompt_length} if prompt_length and \
        "prompt_length" in inspect.signature(step.from_choice).parameters else {}
    datastore = None if args.datastore is None else load_datastore(
        args.datastore, **({} if device is None else {"device": device}),
        **({} if args.knn_nprobe is None else {"nprobe": args.knn_nprobe}))
    with_store = {} if datastore is None else {"datastore": datastore}
    try:
        proc = GraphmaxLogitsProcessor.from_graph(graph, decoder=args.decoder, **with_store, **settings, **extra,
                                                  **knn)
    except GraphFormatError:
        raise  # (the stored record's keys are named as stored)
    except (TypeError, ValueError) as e:
        raise GraphmaxError(_flags(str(e))) from e
    origin = "stored by graphmax tune" if proc.origin == "stored" else \
        "defaults" + (f" (the graph stores a {stored} decoder)" if stored else "")
    shown = {k: v for group in (chosen.graph_settings, chosen.settings) if group is not None
             for k, v in pick[group].items()}
    if shown:
        origin += ", with " + " ".join(f"--{k.replace('_', '-')} {_show(v)}" for k, v in shown.items())
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
    from gm_graphs import load_graph, load_tokenizer
    from gm_solver.backends import compile_in_background

    from .warm import BACKGROUND

    device = resolve_device(args.device)  # a GPU asked for and absent is named before anything loads
    dtype = resolve_dtype(args.dtype, device)
    prefix = None
    if args.examples is not None:  # its tokens, for the decoder's λ_t, from the model's tokenizer alone
        examples = read_examples(args.examples)  # a bad file is refused before the tokenizer's seconds of loading
        prefix = load_tokenizer(args.model)(examples, add_special_tokens=False)["input_ids"]
    # the graph and every option are checked before the model loads; where numba has not compiled the kernels this
    # kind of decoder calls (a first run after installing), it decodes with torch while they compile for the next run
    graph = load_graph(graph_arg(args))
    with compile_in_background(BACKGROUND, kernels=decoder_kind(args, graph).kernels):
        return _decode(args, graph, prefix, device, dtype)


def _decode(args, graph, prefix, device, dtype) -> int:
    from .decoding import generate_texts, warm_up
    from .models import check_fits, load_model

    graph, proc, origin = build_decoder(args, len(prefix or ()), device, graph)
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
    if getattr(proc, "datastore", None) is not None:
        proc.datastore.check_model(model)
        if proc.tap is not None:
            proc.tap.attach(model)  # each step's hidden states, for the datastore's search
    warm_up(model, tok, [proc])
    label = proc.kind.label
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
