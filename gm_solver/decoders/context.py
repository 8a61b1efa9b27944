"""The context-aware decoder kind: its settings (:class:`ContextConfig`), its kNN settings with a datastore
(:class:`KnnConfig`) and its record in the table of kinds (:data:`KIND`). Its step is
``gm_solver.processor.ContextGraphmaxLogitsProcessor`` (and ``KnnContextGraphmaxLogitsProcessor`` with a datastore),
imported when first built; the reference q it leans toward is ``gm_solver.context.ContextReference``."""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from ..arguments import choice, finite_nonnegative, finite_positive, integer, option, real
from .registry import DecoderKind

DIVERGENCES = ("kl", "rkl", "l2")  # D's names; gm_solver.divergences solves toward each
SMOOTHINGS = ("kneser-ney", "dirichlet")
# the marginal bias' weight at most: log ratios of counts are within ±30, so the bias stays far inside float16 (tuned
# weights are 0.5–1.5; a weight of 10 already multiplies a token's probability by (c/e)^10)
MAX_MARGINAL_WEIGHT = 10.0


@dataclass(frozen=True)
class ContextConfig:
    """The choices of context-aware graphmax: divergence, λ, its share on KL(x‖q), order weights β_k, smoothing
    (D or κ), unigram α, and how λ falls with the context's length. The regulariser is
    λ_t·[(1 − kl_share)·D(x, q) + kl_share·KL(x‖q)], with λ_t = λ·t^(−lam_decay) after t tokens of context.

    Each setting is checked here, once: ``ContextGraphmaxLogitsProcessor`` builds one from its arguments (where each
    is described at length), and the choice ``graphmax tune`` stores in a graph holds one (``gm_solver.DecoderChoice``).

    Args:
        divergence (``str``, defaults to ``"rkl"``): D, one of ``DIVERGENCES``: ``"rkl"`` KL(q‖x), ``"kl"``
            KL(x‖q) or ``"l2"`` ‖x − q‖².
        lam (``float``, defaults to 1.2): λ ≥ 0; 0 gives softmax.
        kl_share (``float``, defaults to 0.15): the share of λ on KL(x‖q), in [0, 1].
        order_weights (``tuple[float, ...]``, defaults to ``(1.0,)``): β_k ≥ 0 with a positive sum, the weight of
            q_k for the token k back.
        smoothing (``str``, defaults to ``"kneser-ney"``): ``"kneser-ney"`` or ``"dirichlet"``.
        discount (``float``, defaults to 0.75): Kneser–Ney's D in (0, 1), also the n-gram tables' discount.
        ngram_order (``int``, defaults to 4): the longest n-gram that conditions q (2: the bigram row only).
        kappa (``float``, defaults to 3.0): κ > 0, the Dirichlet prior (``"dirichlet"``, and orders k ≥ 2).
        alpha (``float``, defaults to 0.5): α > 0, the add-α smoothing of the unigram every row backs off to.
        lam_decay (``float``, defaults to 0.0): γ ≥ 0, finite: λ_t = λ·t^(−γ) after t tokens of context (the length
            of ``input_ids``, padding included); 0 keeps λ constant.
        source (``dict``, defaults to ``{"tuned": False}``): where the settings came from (``graphmax tune``
            records its validation data); ignored by ``==``.

    Raises:
        ValueError: a setting out of its range, naming it and its value.

    Example::

        >>> cfg = ContextConfig(lam=2.0, kl_share=0.3)
        >>> cfg.divergence_label, cfg.smoothing_label
        ('0.7·rkl + 0.3·kl', 'kneser-ney D=0.75')
        >>> ContextConfig.from_dict(cfg.to_dict()) == cfg
        True
        >>> ContextConfig(lam=2.0, lam_decay=0.5).lam_at(16)    # 2·16^(−0.5)
        0.5
    """

    REQUIRED: ClassVar[tuple[str, ...]]  # every field: a stored choice holds them all (set below)

    divergence: str = option("rkl", "D(x, q): rkl KL(q‖x), kl KL(x‖q) or l2 ‖x − q‖²", choices=DIVERGENCES)
    lam: float = option(1.2, "λ ≥ 0, the weight of the regulariser (0 gives softmax)")
    kl_share: float = option(0.15, "the share of λ on KL(x‖q), in [0, 1]")
    order_weights: tuple[float, ...] = option((1.0,), "β_k ≥ 0 for the token k back, e.g. 0.8,0.2")
    smoothing: str = option("kneser-ney", "the bigram row's smoothing", choices=SMOOTHINGS)
    discount: float = option(0.75, "Kneser–Ney's D in (0, 1), also the n-gram tables'")
    ngram_order: int = option(4, "the longest n-gram conditioning q, ≥ 2")
    kappa: float = option(3.0, "the Dirichlet prior κ > 0")
    alpha: float = option(0.5, "add-α > 0 of the unigram")
    lam_decay: float = option(0.0, "γ ≥ 0 in λ_t = λ·t^(−γ) after t tokens of context (0: λ constant)")
    source: dict = field(default_factory=lambda: {"tuned": False}, compare=False)

    def __post_init__(self):
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("divergence", choice("divergence", self.divergence, DIVERGENCES))
        put("lam", real("lam", self.lam, "a finite float >= 0 (0 gives softmax)", finite_nonnegative))
        put("kl_share", real("kl_share", self.kl_share, "a float in [0, 1] (the share of λ on KL(x‖q))",
                             lambda v: 0 <= v <= 1))
        put("ngram_order", integer("ngram_order", self.ngram_order, "an int >= 2 (2: the bigram row only)",
                                   lambda v: v >= 2))
        put("order_weights", _order_weights(self.order_weights))
        put("smoothing", choice("smoothing", self.smoothing, SMOOTHINGS))
        put("discount", real("discount", self.discount, "a float in (0, 1) (Kneser–Ney's D)", lambda v: 0 < v < 1))
        put("kappa", real("kappa", self.kappa, "a finite float > 0 (the Dirichlet prior's strength)",
                          finite_positive))
        put("alpha", real("alpha", self.alpha, "a finite float > 0 (add-α on the unigram)", finite_positive))
        put("lam_decay", real("lam_decay", self.lam_decay, "a finite float >= 0 (λ_t = λ·t^(−lam_decay); 0: "
                              "constant)", finite_nonnegative))
        if not isinstance(self.source, dict):
            raise ValueError(f"`source` must be a dict (where the settings came from), got {self.source!r}")

    def lam_at(self, length: int, lam: float | None = None) -> float:
        """λ_t for a step after ``length`` tokens of context: λ·t^(−lam_decay), t = max(length, 1); ``lam``: another
        λ than the config's (a request's own, in a serving engine)."""
        lam = self.lam if lam is None else lam
        return lam if self.lam_decay == 0 else lam * max(int(length), 1) ** -self.lam_decay

    @property
    def divergence_label(self) -> str:
        """e.g. "rkl" or "0.85·rkl + 0.15·kl"."""
        if self.kl_share == 0 or self.divergence == "kl":
            return self.divergence
        return "kl" if self.kl_share == 1 else f"{1 - self.kl_share:g}·{self.divergence} + {self.kl_share:g}·kl"

    @property
    def smoothing_label(self) -> str:
        """e.g. "kneser-ney D=0.75" or "dirichlet κ=3"."""
        return (f"kneser-ney D={self.discount:g}" if self.smoothing == "kneser-ney"
                else f"dirichlet κ={self.kappa:g}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["order_weights"] = list(self.order_weights)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ContextConfig:
        """The config of ``to_dict``'s fields in ``d`` (other keys, e.g. a perplexity beside them, are left out)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


ContextConfig.REQUIRED = tuple(f.name for f in fields(ContextConfig))


@dataclass(frozen=True)
class KnnConfig:
    """The context decoder's settings with a kNN datastore (``KnnContextGraphmaxLogitsProcessor``), each checked here.

    Args:
        knn_weight (``float``, defaults to 0.5): β in [0, 1], the share of p_knn in the reference; 0: no search,
            the datastore's marginal bias alone (with ``marginal_weight``).
        knn_k (``int``, defaults to 1024): the neighbours read, ≥ 1.
        knn_temperature (``float``, defaults to 50.0): T > 0, finite, of softmax(−d/T) over squared distances.
        marginal_weight (``float``, defaults to 0.0): w in [0, 10], the weight of the datastore's marginal bias
            (``MarginalBiasLogitsProcessor``) on the scores; 0: none.

    Raises:
        ValueError: a setting out of its range, naming it and its value.

    Example::

        >>> KnnConfig(knn_weight=0.35, knn_temperature=100)
        KnnConfig(knn_weight=0.35, knn_k=1024, knn_temperature=100.0, marginal_weight=0.0)
    """

    REQUIRED: ClassVar[tuple[str, ...]] = ("knn_weight", "knn_k", "knn_temperature", "marginal_weight")

    knn_weight: float = option(0.5, "the datastore's share β in [0, 1] of the reference (0: no search)")
    knn_k: int = option(1024, "neighbours read, ≥ 1")
    knn_temperature: float = option(50.0, "T of softmax(−d/T) over squared distances")
    marginal_weight: float = option(0.0, "the weight w in [0, 10] of its marginal bias on the LM's scores "
                                         "(0: none)")

    def __post_init__(self):
        object.__setattr__(self, "knn_weight", real(
            "knn_weight", self.knn_weight, "a float in [0, 1] (the share of p_knn in q; 0: no search, the "
            "marginal bias alone)", lambda v: 0 <= v <= 1))
        object.__setattr__(self, "knn_k", integer("knn_k", self.knn_k, "an int >= 1", lambda v: v >= 1))
        object.__setattr__(self, "knn_temperature", real("knn_temperature", self.knn_temperature,
                                                         "a finite float > 0", finite_positive))
        object.__setattr__(self, "marginal_weight", real(
            "marginal_weight", self.marginal_weight, f"a float in [0, {MAX_MARGINAL_WEIGHT:g}] (0: no marginal bias)",
            lambda v: 0 <= v <= MAX_MARGINAL_WEIGHT))


KIND = DecoderKind("context", ContextConfig, "gm_solver.processor:ContextGraphmaxLogitsProcessor", "context graphmax",
                   datastore_settings=KnnConfig, kernels=("context.decode_step",))


def _order_weights(value: Any) -> tuple[float, ...]:
    requirement = "a sequence of finite floats >= 0 with a positive sum (β_k for the token k back)"
    try:
        weights = tuple(value)
    except TypeError:
        raise ValueError(f"`order_weights` must be {requirement}, got {value!r}") from None
    if not weights or isinstance(value, str) or any(
            isinstance(b, bool) or not isinstance(b, numbers.Real) or not finite_nonnegative(float(b))
            for b in weights) or sum(weights) <= 0:
        raise ValueError(f"`order_weights` must be {requirement}, got {value!r}")
    return tuple(float(b) for b in weights)
