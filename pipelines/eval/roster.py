"""The decoders ``graphmax eval`` compares, each a typed record: which LM's logits, which variant decodes them,
its processor and its label.

The report, the tables and the figures find a decoder by its record's fields (``Decoder.id``), never by its label:
labels are for people and may change.
"""

from __future__ import annotations

import dataclasses
import enum

from gm_solver import ContextConfig, GraphmaxLogitsProcessor, HiddenStateTap, InterpolationLogitsProcessor
from gm_solver.decoders import kinds
from gm_solver.decoders.registry import BUILT_IN

from .baselines import FineTuned, Knn, Prompted
from .data import Setup

# the paper's context-free decoders cost 20–60 ms per position (ours ~2): scored over the first 32 tokens only,
# which is enough to show them far above softmax, and keeps the default eval within 15 minutes
PAPER_POSITIONS = 32
ALGORITHM_1_LAM = 1.0  # Algorithm 1 shows the paper's solver, at one λ


class LM(enum.StrEnum):
    """Whose logits a decoder reads."""

    BASE = "base"
    FINE_TUNED = "fine-tuned"  # LoRA on the training side (``baselines.fine_tuned_baseline``)
    PROMPTED = "prompted"  # the base LM reading a few-shot prompt before each document


class Family(enum.StrEnum):
    """The perplexity table's group of a decoder."""

    BASELINE = "baseline"
    PAPER = "paper"
    OURS = "ours"
    FINE_TUNED = "fine-tuned"
    PROMPTED = "prompted"
    REGISTERED = "registered"  # a decoder kind a package registered (gm_solver.decoders), beside graphmax's own


class Method(enum.StrEnum):
    """What a decoder does to its LM's logits."""

    SOFTMAX = "softmax"
    PAPER = "paper"  # the paper's graphmax on Ã, at a λ
    PAPER_MIXTURE = "paper mixture"  # the paper's graphmax on Ã+Ã², at a λ
    ALGORITHM_1 = "paper algorithm 1"  # the paper's projected-gradient solver on Ã, at ALGORITHM_1_LAM
    INTERPOLATION = "interpolation"  # the LM's and the graph's next-token probabilities mixed at a weight w
    INTERPOLATION_OPTIMUM = "interpolation optimum"  # w fitted on the test tokens of each window
    OURS_DEFAULT = "ours default"  # context graphmax, untuned
    OURS = "ours"  # context graphmax, tuned on the validation half
    OURS_MARGINALS = "ours marginals"  # ours + the datastore's marginal bias alone (no search)
    OURS_KNN = "ours knn"  # ours + the kNN datastore and its marginal bias
    REGISTERED = "kind"  # a registered decoder kind's, with the graph's stored choice of it or its defaults


@dataclasses.dataclass(frozen=True)
class Variant:
    """What decodes an LM's logits: a method, at the paper's λ or the interpolation's weight where it takes one.

    Args:
        method: the ``Method``.
        lam: the λ of ``Method.PAPER`` and ``Method.PAPER_MIXTURE``.
        weight: the w of ``Method.INTERPOLATION``.
        kind: the decoder kind of ``Method.REGISTERED``.

    Example:
        >>> Variant(Method.PAPER, lam=1) == Variant(Method.PAPER, lam=1.0) != Variant(Method.PAPER, lam=0.1)
        True
    """

    method: Method
    lam: float | None = None
    weight: float | None = None
    kind: str | None = None


SOFTMAX = Variant(Method.SOFTMAX)
ALGORITHM_1 = Variant(Method.ALGORITHM_1)
INTERPOLATION_OPTIMUM = Variant(Method.INTERPOLATION_OPTIMUM)
OURS_DEFAULT = Variant(Method.OURS_DEFAULT)
OURS = Variant(Method.OURS)
OURS_MARGINALS = Variant(Method.OURS_MARGINALS)
OURS_KNN = Variant(Method.OURS_KNN)

DecoderId = tuple[LM, Variant]


@dataclasses.dataclass(frozen=True)
class Decoder:
    """One row of the perplexity table: a processor (None: softmax) applied to one LM's logits.

    Args:
        family: the table's group.
        lm: whose logits it decodes.
        variant: what decodes them; with ``lm`` what the eval finds it by (``id``).
        processor: a logits processor; None for softmax and for the interpolations, which are scored from each
            token's two probabilities.
        label: what people read in the tables, figures and samples; nothing is read back out of it.
        positions: scored over the first this many tokens of each document (None: all).

    Example:
        >>> d = Decoder(Family.PAPER, LM.BASE, Variant(Method.PAPER, lam=0.1), None, "paper graphmax Ã λ=0.1")
        >>> d.id == (LM.BASE, Variant(Method.PAPER, lam=0.1)), d.key
        (True, 'paper 0.1')
        >>> Decoder(Family.FINE_TUNED, LM.FINE_TUNED, SOFTMAX, None, "fine-tuned LM (LoRA), softmax").key
        'fine-tuned'
    """

    family: Family
    lm: LM
    variant: Variant
    processor: object | None
    label: str
    positions: int | None = None

    @property
    def id(self) -> DecoderId:
        """What the eval finds it by: its LM and its variant."""
        return self.lm, self.variant

    @property
    def key(self) -> str:
        """The CSVs' ``key`` column, made from the fields: the LM unless the base one, the method unless softmax
        on another LM, then the λ or the weight, or a registered decoder's kind."""
        parts = [] if self.lm is LM.BASE else [str(self.lm)]
        if self.variant.kind is not None:
            parts.append(self.variant.kind)
        elif self.variant.method is not Method.SOFTMAX or not parts:
            parts.append(str(self.variant.method))
        parts += [f"{v:g}" for v in (self.variant.lam, self.variant.weight) if v is not None]
        return " ".join(parts)


def paper(lam: float) -> Variant:
    """The paper's graphmax on Ã at ``lam``."""
    return Variant(Method.PAPER, lam=lam)


def roster(setup: Setup, tuned: ContextConfig, paper_lams: list[float], mixture_lams: list[float],
           positions: int, finetuned: FineTuned | None = None, knn: Knn | None = None,
           prompted: Prompted | None = None) -> list[Decoder]:
    """Every decoder scored by a processor, in the perplexity table's order, each processor warmed up; the
    interpolations come from ``scoring.interpolations``.

    Args:
        setup: the split and the graphs.
        tuned: context graphmax's choice on the base LM.
        paper_lams: the λ grid of the paper's decoder on Ã (λ > 0; λ = 0 is softmax).
        mixture_lams: those of ``paper_lams`` at which Ã+Ã² is scored too.
        positions: the tokens of each document scored (the paper's decoders: at most ``PAPER_POSITIONS``).
        finetuned, knn, prompted: the baselines run, None for those that were not.

    Returns:
        The decoders.
    """
    paper_positions = min(PAPER_POSITIONS, positions)
    build = GraphmaxLogitsProcessor.from_graph
    decoders = [Decoder(Family.BASELINE, LM.BASE, SOFTMAX, None, "softmax")]
    for lam in paper_lams:
        decoders.append(Decoder(Family.PAPER, LM.BASE, paper(lam),
                                build(setup.graph, decoder="paper", lam=lam).warmup(),
                                f"paper graphmax Ã λ={lam:g}", paper_positions))
    for lam in paper_lams:
        if lam in mixture_lams:
            decoders.append(Decoder(Family.PAPER, LM.BASE, Variant(Method.PAPER_MIXTURE, lam=lam),
                                    build(setup.mixture, decoder="paper", lam=lam).warmup(),
                                    f"paper graphmax Ã+Ã² λ={lam:g}", paper_positions))
    decoders.append(Decoder(Family.PAPER, LM.BASE, ALGORITHM_1,
                            build(setup.graph, decoder="paper", solver="paper", lam=ALGORITHM_1_LAM).warmup(),
                            f"paper Algorithm 1 Ã λ={ALGORITHM_1_LAM:g}", paper_positions))
    decoders.append(Decoder(Family.OURS, LM.BASE, OURS_DEFAULT, build(setup.graph, settings=ContextConfig()).warmup(),
                            "context graphmax, untuned defaults (ours)"))
    decoders.append(Decoder(Family.OURS, LM.BASE, OURS, build(setup.graph, settings=tuned).warmup(),
                            "context graphmax, tuned (ours)"))
    if knn is not None and knn.bias_only is not None:
        bias_config, bias = knn.bias_only
        bias_only = build(setup.graph, settings=bias_config, datastore=knn.datastore, knn_weight=0.0,
                          marginal_weight=bias["marginal_weight"]).warmup()
        decoders.append(Decoder(Family.OURS, LM.BASE, OURS_MARGINALS, bias_only, "context graphmax + the datastore's "
                                "marginal bias alone (no search), tuned (ours)"))
    if knn is not None:
        decoders.append(Decoder(Family.OURS, LM.BASE, OURS_KNN, build(
            setup.graph, settings=knn.tuned, datastore=knn.datastore, tap=HiddenStateTap(), **knn.settings).warmup(),
            f"context graphmax + kNN datastore ({len(knn.datastore):,} keys) and its marginal bias, tuned (ours)"))
    for name, kind in kinds().items():  # a kind a package registered: the graph's stored choice of it, or its defaults
        if name not in BUILT_IN:
            decoders.append(Decoder(Family.REGISTERED, LM.BASE, Variant(Method.REGISTERED, kind=name),
                                    build(setup.graph, decoder=name).warmup(), f"{kind.label} ({name})"))
    if finetuned is not None:
        decoders.append(Decoder(Family.FINE_TUNED, LM.FINE_TUNED, SOFTMAX, None, "fine-tuned LM (LoRA), softmax"))
        decoders.append(Decoder(Family.OURS, LM.FINE_TUNED, OURS,
                                GraphmaxLogitsProcessor.from_graph(setup.graph, settings=finetuned.tuned).warmup(),
                                "context graphmax on the fine-tuned LM (ours)"))
    if finetuned is not None and finetuned.knn is not None:
        ft_knn = finetuned.knn
        decoders.append(Decoder(Family.OURS, LM.FINE_TUNED, OURS_KNN, GraphmaxLogitsProcessor.from_graph(
            setup.graph, settings=ft_knn.tuned, datastore=ft_knn.datastore, tap=HiddenStateTap(),
            **ft_knn.settings).warmup(),
            f"context graphmax + kNN datastore ({len(ft_knn.datastore):,} keys of its own) on the fine-tuned LM "
            "(ours)"))
    if prompted is not None:
        decoders.append(Decoder(Family.PROMPTED, LM.PROMPTED, SOFTMAX, None, f"LM with a {_shots(prompted)}, softmax"))
        for dec in prompted_decoders(setup, prompted, prompt_length=0):
            dec.processor.warmup()
            decoders.append(dec)
    return decoders


def _shots(prompted: Prompted) -> str:
    return f"{len(prompted.prompt.documents)}-shot prompt"


def prompted_decoders(setup: Setup, prompted: Prompted, prompt_length: int) -> list[Decoder]:
    """Graphmax's decoders tuned for the prompted LM (with the datastore too, when it has one).

    Args:
        setup: the split and the graph.
        prompted: the few-shot baseline.
        prompt_length: 0 for scoring, where they see the document alone; the prompt's length inside
            ``generate()``, where they see it too and λ_t must not count it.

    Returns:
        The decoders, unwarmed.
    """
    shots = _shots(prompted)
    build = GraphmaxLogitsProcessor.from_graph
    decoders = [Decoder(Family.OURS, LM.PROMPTED, OURS, build(setup.graph, settings=prompted.tuned,
                                                              prompt_length=prompt_length),
                        f"context graphmax on the LM with a {shots} (ours)")]
    if prompted.knn is not None:
        p_knn = prompted.knn
        decoders.append(Decoder(Family.OURS, LM.PROMPTED, OURS_KNN, build(
            setup.graph, settings=p_knn.tuned, datastore=p_knn.datastore, tap=HiddenStateTap(),
            prompt_length=prompt_length,
            **p_knn.settings), f"context graphmax + kNN datastore ({len(p_knn.datastore):,} keys) and its marginal "
            f"bias on the LM with a {shots} (ours)"))
    return decoders


def interpolation_name(lm: LM) -> str:
    """What the interpolation on ``lm``'s logits is called."""
    return "interpolation" if lm is LM.BASE else f"{lm} interpolation"


def interpolation(weight: float) -> Decoder:
    """The interpolation on the base LM's logits at a fixed ``weight``."""
    return Decoder(Family.BASELINE, LM.BASE, Variant(Method.INTERPOLATION, weight=weight), None,
                   f"interpolation w={weight:g}")


def interpolation_optimum(lm: LM, weights: dict[int, float]) -> Decoder:
    """The interpolation on ``lm``'s logits at ``weights`` (window → w fitted on the test tokens of that window)."""
    fitted = "; ".join(f"{c}: {w:.3f}" for c, w in weights.items())
    return Decoder(Family.BASELINE if lm is LM.BASE else Family(lm), lm, INTERPOLATION_OPTIMUM, None,
                   f"{interpolation_name(lm)}, w optimised on the test tokens ({fitted})")


def interpolation_at(decoder: Decoder, graph, weight: float) -> Decoder:
    """``decoder`` (an interpolation) as a processor at ``weight``, for ``generate()``."""
    return dataclasses.replace(decoder, processor=InterpolationLogitsProcessor(graph, weight),
                               label=f"interpolation w={weight:.3f} (optimum on test)")


def strongest(lm: LM, ids) -> DecoderId:
    """Graphmax on ``lm``'s logits with the datastore where ``ids`` holds that decoder, else without."""
    return (lm, OURS_KNN) if (lm, OURS_KNN) in ids else (lm, OURS)
