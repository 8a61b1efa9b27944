"""The baselines graphmax is measured against, each with graphmax on top of it: a kNN datastore of the LM's
hidden states, LoRA fine-tuning for as long as graphmax's own build and tuning took, and a few-shot prompt of
training documents (no training at all). Each re-tunes graphmax for the logits it changes, on the validation half.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

from gm_solver import ContextConfig, Datastore, GraphmaxLogitsProcessor, build_datastore

from ..finetune import FinetuneResult, finetune_lora
from ..heldout import HeldOut, perplexity, score_documents
from ..prompt import FewShotPrompt, few_shot_prompt
from ..tune import KNN_TEMPERATURES, tune_knn
from .data import Setup, train_texts
from .sizes import PROMPT_DOC_TOKENS

RETUNE_FACTORS = (0.5, 0.7, 0.85, 1.0)  # λ scales tried for the fine-tuned LM, which needs less of the corpus
# and for the prompted LM, which has read the domain's documents (on drug reviews 0.5 did best of these: the edge)
PROMPT_FACTORS = (0.25, 0.35, 0.5, 0.7, 1.0)


def retune_lambda(graph, heldout: HeldOut, config: ContextConfig,
                  factors=RETUNE_FACTORS) -> tuple[ContextConfig, list[dict]]:
    """``config`` with its λ scaled by the best of ``factors`` on another LM's validation logits.

    Args:
        graph: the graph context graphmax decodes with.
        heldout: the other LM's validation logits.
        config: the choice tuned on the base LM.
        factors: the scales of λ tried.

    Returns:
        The best config, and one row per factor (lam, factor, perplexity) for tuning.csv.
    """
    tried = []
    for f in factors:
        cfg = dataclasses.replace(config, lam=config.lam * f)
        tried.append((perplexity(heldout, GraphmaxLogitsProcessor.from_graph(graph, settings=cfg)), f, cfg))
    best = min(tried, key=lambda t: t[0])[2]
    return best, [{"lam": c.lam, "factor": f, "perplexity": p} for p, f, c in tried]


@dataclasses.dataclass
class Knn:
    """The kNN datastore over the training side, and the decoder tuned with it on the validation half.

    Args:
        datastore: the LM's hidden states over the training documents' openings.
        tuned: context graphmax's choice with the datastore, λ re-scaled.
        settings: knn_weight, knn_temperature, knn_k (and marginal_weight when it has marginals).
        table: the tuning's rows, for tuning.csv.
        documents: the training documents the datastore holds.
        seconds: building the datastore (the LM over its documents) and tuning β, T, λ and the marginal weight.
        bias_only: the datastore's marginal bias alone (β = 0: no search, ``knn_weight=0``), its
            config and settings tuned the same way; None without marginals.
    """

    datastore: Datastore
    tuned: ContextConfig
    settings: dict
    table: list[dict]
    documents: int
    seconds: float
    bias_only: tuple[ContextConfig, dict] | None = None

    def summary(self) -> dict:
        """What the report says of it: keys, documents, seconds and the settings."""
        return {"keys": len(self.datastore), "documents": self.documents, "seconds": self.seconds, **self.settings}


def datastore_decoder(model, tok, setup: Setup, tuned: ContextConfig, valid: HeldOut, docs: int, positions: int,
                      folder: Path, around: Knn | None = None) -> Knn:
    """A datastore of ``model``'s states over the first ``positions`` tokens of ``docs`` training documents, and
    β, T, λ tuned with it.

    Args:
        model, tok: the LM whose states are the keys, and its tokenizer.
        setup: the split and the graph.
        tuned: context graphmax's choice for ``model``.
        valid: ``model``'s validation logits, scored with ``hidden=True``.
        docs, positions: how many training documents, over how many of their first tokens.
        folder: where the datastore is written.
        around: the base LM's, to tune among the neighbours of what was chosen there.

    Returns:
        The ``Knn``.
    """
    t0 = time.perf_counter()
    texts = train_texts(setup)[:docs]
    datastore = build_datastore(model, tok, texts, folder, positions=positions, overwrite=True,
                                model_name=str(getattr(model, "name_or_path", "")))
    print(f"datastore {folder.name}: {len(datastore):,} keys from {len(texts):,} training documents in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    config, settings, table = tune_knn(setup.graph, valid, tuned, datastore,
                                       around=None if around is None else around.settings)
    bias_only = None
    if datastore.marginals is not None:
        near = None if around is None or around.bias_only is None else around.bias_only[1]
        bias_config, bias_settings, bias_table = tune_knn(setup.graph, valid, tuned, datastore, weights=(0.0,),
                                                          temperatures=(KNN_TEMPERATURES[1],), around=near)
        bias_only, table = (bias_config, bias_settings), table + bias_table
    return Knn(datastore, config, settings, table, len(texts), time.perf_counter() - t0, bias_only)


@dataclasses.dataclass
class FineTuned:
    """The fine-tuned baseline.

    Args:
        result: the LoRA run, with the merged model.
        tuned: context graphmax's choice with λ re-tuned on the fine-tuned LM's validation logits.
        test: the fine-tuned LM's logits on the test documents.
        retune_table: the re-tuning's rows, for tuning.csv.
        summary: what the report says of it.
        knn: a datastore of the fine-tuned LM's own states, when the base LM has one.
    """

    result: FinetuneResult
    tuned: ContextConfig
    test: HeldOut
    retune_table: list[dict]
    summary: dict
    knn: Knn | None


def fine_tuned_baseline(args, model, tok, setup: Setup, tuned: ContextConfig, valid_docs: list[str],
                        test_docs: list[str], positions: int, tune_seconds: float, knn: Knn | None,
                        work: Path) -> FineTuned | None:
    """LoRA on the training side for as long as the graph's build and tuning took (or ``--finetune-budget-s``);
    with ``knn``, graphmax with a datastore on top of it too (the datastore built again: its keys are the states
    of the LM that decodes, which fine-tuning changed).

    Args:
        args: the command's arguments (finetune_budget_s, seed).
        model, tok: the base LM and its tokenizer.
        setup: the split and the graph.
        tuned: context graphmax's choice on the base LM.
        valid_docs, test_docs: the validation and test documents scored.
        positions: the tokens of each document scored and trained on.
        tune_seconds: graphmax's tuning time, part of the default budget.
        knn: the base LM's datastore, or None.
        work: the folder the fine-tuned LM's datastore goes into.

    Returns:
        The ``FineTuned``, or None for a budget of 0.
    """
    given = args.finetune_budget_s is not None
    budget = args.finetune_budget_s if given else setup.build_seconds + tune_seconds
    if budget <= 0:
        return None
    texts = train_texts(setup)
    result = finetune_lora(model, tok, texts, budget_s=budget, seed=args.seed, seq_len=positions + 1)
    print(f"fine-tuned: {result.steps} steps, {result.tokens:,} tokens in {result.seconds:.0f} s "
          f"(budget {budget:.0f} s)", flush=True)
    hidden = knn is not None
    valid = score_documents(result.model, tok, valid_docs, positions, hidden=hidden)
    tuned_ft, table = retune_lambda(setup.graph, valid, tuned)
    ft_knn = datastore_decoder(result.model, tok, setup, tuned_ft, valid, knn.documents, positions,
                               work / "datastore-fine-tuned", around=knn) if hidden else None
    losses, tenth = result.losses, max(1, len(result.losses) // 10)
    summary = {"budget_s": budget, "budget_given": given, "build_s": setup.build_seconds, "tune_s": tune_seconds,
               "seconds": result.seconds, "steps": result.steps, "tokens": result.tokens,
               "tokens_per_s": result.tokens_per_second, "tuned": tuned_ft, **result.settings,
               "loss_first": statistics.fmean(losses[:tenth]) if losses else float("nan"),
               "loss_last": statistics.fmean(losses[-tenth:]) if losses else float("nan"),
               "knn": None if ft_knn is None else {**ft_knn.summary(), "tuned": ft_knn.tuned}}
    retune = [{**tuned.to_dict(), **row, "lm": "fine-tuned"} for row in table]
    retune += [{**row, "lm": "fine-tuned"} for row in (ft_knn.table if ft_knn is not None else [])]
    return FineTuned(result, tuned_ft, score_documents(result.model, tok, test_docs, positions, hidden=hidden),
                     retune, summary, ft_knn)


@dataclasses.dataclass
class Prompted:
    """The few-shot baseline.

    Args:
        prompt: the training documents read before each held-out document.
        tuned: context graphmax's choice with λ re-tuned on the prompted LM's validation logits.
        test: the prompted LM's logits on the test documents.
        retune_table: the re-tuning's rows, for tuning.csv.
        knn: the base LM's datastore under the prompted LM's states, β, T, λ, w tuned again; None without one.
        seconds: scoring the validation documents with the prompt and tuning on them (not the test's scoring).
    """

    prompt: FewShotPrompt
    tuned: ContextConfig
    test: HeldOut
    retune_table: list[dict]
    knn: Knn | None
    seconds: float

    def summary(self) -> dict:
        """What the report says of it: the prompt's size, the tuning's time and choices."""
        return {"documents": len(self.prompt.documents), "tokens": len(self.prompt.ids),
                "doc_tokens": PROMPT_DOC_TOKENS, "seconds": self.seconds, "tuned": self.tuned,
                "knn": None if self.knn is None else {"tuned": self.knn.tuned, **self.knn.settings}}


def draw_prompt(args, tok, setup: Setup) -> FewShotPrompt | None:
    """``--shots`` training documents for the few-shot baseline (None for 0); drawn right after the graph, before
    the tuning, the datastore and fine-tuning, so that a corpus without enough short documents is refused early."""
    if args.shots == 0:
        return None
    low, high = PROMPT_DOC_TOKENS
    return few_shot_prompt(train_texts(setup), tok, args.shots, min_doc_tokens=low, max_doc_tokens=high,
                           seed=args.seed)


def prompted_baseline(model, tok, setup: Setup, prompt: FewShotPrompt | None, tuned: ContextConfig,
                      valid_docs: list[str], test_docs: list[str], positions: int, knn: Knn | None) -> Prompted | None:
    """The LM reading ``prompt`` before each held-out document (no training), and graphmax on top of it: λ's
    scale tuned again on the prompted validation logits, and with ``knn`` its β, T, λ and marginal weight too, among
    the neighbours of the base LM's choice (the keys stay the base LM's states without a prompt).

    Args:
        model, tok: the base LM and its tokenizer.
        setup: the split and the graph.
        prompt: the few-shot prompt, or None.
        tuned: context graphmax's choice on the base LM.
        valid_docs, test_docs: the validation and test documents scored.
        positions: the tokens of each document scored.
        knn: the base LM's datastore, or None.

    Returns:
        The ``Prompted``, or None without a prompt.
    """
    if prompt is None:
        return None
    t0 = time.perf_counter()
    hidden = knn is not None
    valid = score_documents(model, tok, valid_docs, positions, hidden=hidden, prefix=prompt.ids)
    tuned_p, table = retune_lambda(setup.graph, valid, tuned, PROMPT_FACTORS)
    retune = [{**tuned.to_dict(), **row, "lm": "prompted"} for row in table]
    p_knn = None
    if hidden:
        t1 = time.perf_counter()
        config, settings, knn_table = tune_knn(setup.graph, valid, tuned_p, knn.datastore, around=knn.settings)
        p_knn = Knn(knn.datastore, config, settings, knn_table, knn.documents, time.perf_counter() - t1)
        retune += [{**row, "lm": "prompted"} for row in knn_table]
    seconds = time.perf_counter() - t0
    print(f"prompted: {len(prompt.documents)} training documents, {len(prompt.ids)} tokens; λ = {tuned_p.lam:g}",
          flush=True)
    test = score_documents(model, tok, test_docs, positions, hidden=hidden, prefix=prompt.ids)
    return Prompted(prompt, tuned_p, test, retune, p_knn, seconds)
