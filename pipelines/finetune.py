"""LoRA fine-tuning of a causal LM on the training side of a corpus, within a wall-clock budget.

The baseline a user with a domain corpus would try before graphmax: adapt the
LM to the corpus. ``graphmax eval`` gives it the same wall-clock time as the
graph's build and tuning, and compares (and combines) the two on held-out text.

Each training example is one document's opening (its first ``seq_len`` tokens,
no BOS), the text the eval scores; documents are visited in a seeded order,
``batch_docs`` at a time, with the causal-LM loss on every real token. The
adapter (rank ``rank`` on the attention's query and value projections) is merged
into a copy of the model, so the caller's model is never modified.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

TARGET_MODULES = ("q_proj", "v_proj")


@dataclass
class FinetuneResult:
    """The fine-tuned model (a merged copy) and what its training consumed.

    ``tokens`` counts the target tokens the loss was taken on; ``losses`` is the
    mean loss of each step; ``seconds`` runs from the call to the merged model,
    copy and merge included.
    """

    model: torch.nn.Module
    steps: int
    tokens: int
    seconds: float
    budget_s: float
    losses: list[float] = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # rank, alpha, lr, seq_len, batch_docs, target_modules, seed

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def training_batches(tok, texts: list[str], seq_len: int, batch_docs: int, seed: int):
    """Endless (input_ids, attention_mask, labels) batches of document openings, in a seeded order per epoch.

    Documents are tokenised as their batch comes (a budget of minutes reads a few
    hundred of a corpus' documents); right padding; labels are -100 on padding,
    so the loss counts real tokens only. Documents shorter than 2 tokens are skipped.
    """
    rng = random.Random(seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    while True:
        order = list(range(len(texts)))
        rng.shuffle(order)
        yielded = False
        for i in range(0, len(order), batch_docs):
            chunk = [ids[:seq_len] for ids in tok([texts[j] for j in order[i:i + batch_docs]],
                                                   add_special_tokens=False)["input_ids"] if len(ids) >= 2]
            if not chunk:
                continue
            width = max(len(e) for e in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, e in enumerate(chunk):
                ids[r, :len(e)] = torch.tensor(e)
                mask[r, :len(e)] = 1
            yielded = True
            yield ids, mask, torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        if not yielded:
            raise ValueError("no training document has two tokens or more; give longer texts")


def finetune_lora(model: torch.nn.Module, tok, texts: list[str], *, budget_s: float, seed: int = 0,
                  rank: int = 8, alpha: float = 16.0, lr: float = 2e-3, seq_len: int = 65, batch_docs: int = 8,
                  max_steps: int | None = None, target_modules: tuple[str, ...] = TARGET_MODULES,
                  clock: Callable[[], float] = time.perf_counter, progress: bool = True) -> FinetuneResult:
    """Train a LoRA adapter on ``texts`` for at most ``budget_s`` seconds; return a merged copy of ``model``.

    The first step always runs: with none, the "fine-tuned" LM would be the base
    LM itself, and a baseline that trained on nothing says nothing. After it, a
    step starts only if the slowest step so far still fits in what is left of
    the budget, so the run ends within it unless one step is far slower than
    every earlier one (or the copy and the first step alone exceed it).
    Deterministic given ``seed`` for a given number of steps (``max_steps``
    fixes it; a time budget alone stops where the clock says).

    Args:
        model: a transformers causal LM; it is copied, never changed.
        tok: its tokenizer.
        texts: training documents.
        budget_s: wall-clock seconds for the whole call (copy, training, merge), > 0.
        seed: the adapter's initialisation and the order of documents.
        rank, alpha: LoRA's rank r and scale α (the update is α/r · BA).
        lr: AdamW's learning rate (constant; a budget of tens of steps leaves no room for a schedule).
        seq_len: tokens per document opening.
        batch_docs: documents per step.
        max_steps: stop after this many steps even if time is left.
        target_modules: the linear layers that get an adapter.
        clock: seconds, monotone (tests pass a fake one).
        progress: print a line every 10 steps.

    Returns:
        A ``FinetuneResult``.
    """
    from peft import LoraConfig, get_peft_model  # imported here: a second or more, needed by `eval` only

    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0 seconds, got {budget_s!r}")
    if not (isinstance(rank, int) and rank >= 1) or not alpha > 0 or not lr > 0:
        raise ValueError(f"need rank >= 1, alpha > 0 and lr > 0, got rank={rank!r}, alpha={alpha!r}, lr={lr!r}")
    if seq_len < 2 or batch_docs < 1 or (max_steps is not None and max_steps < 0):
        raise ValueError(f"need seq_len >= 2, batch_docs >= 1 and max_steps >= 0, got {seq_len}, {batch_docs}, "
                         f"{max_steps}")
    start = clock()
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(target_modules),
                        task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):  # the adapter's initialisation from the seed, the caller's RNG untouched
        torch.manual_seed(seed)
        tuned = get_peft_model(copy.deepcopy(model), config)
    optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    batches = training_batches(tok, texts, seq_len, batch_docs, seed)
    tuned.train()
    steps, tokens, losses, slowest = 0, 0, [], 0.0
    while max_steps is None or steps < max_steps:
        t0 = clock()
        if steps and t0 - start + slowest > budget_s:
            break
        ids, mask, labels = (t.to(model.device) for t in next(batches))
        loss = tuned(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps += 1
        tokens += int((labels[:, 1:] != -100).sum())  # the targets: every real token after the first
        losses.append(float(loss.detach()))
        slowest = max(slowest, clock() - t0)
        if progress and steps % 10 == 0:
            print(f"fine-tune step {steps}: loss {sum(losses[-10:]) / 10:.3f}, {tokens:,} tokens, "
                  f"{clock() - start:.0f}/{budget_s:.0f} s", flush=True)
    merged = tuned.merge_and_unload()
    merged.eval()
    settings = dict(rank=rank, alpha=alpha, lr=lr, seq_len=seq_len, batch_docs=batch_docs,
                    target_modules=list(target_modules), seed=seed)
    return FinetuneResult(merged, steps, tokens, clock() - start, float(budget_s), losses, settings)
