"""Decoding with a causal LM and a logits processor: one left-padded batch (:func:`generate_texts`), the warm-up
before anything is timed, and the alternated timings the commands and benchmarks print."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList


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


def warm_up(model, tok, processors: list) -> None:
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
