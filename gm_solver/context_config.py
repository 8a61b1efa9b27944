"""The settings of context-aware graphmax (:class:`ContextConfig`), each checked once: what a processor is built
from and what ``graphmax tune`` stores in a graph's decoder choice."""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .checks import choice, finite_nonnegative, finite_positive, integer, real
from .divergences import DIVERGENCES

SMOOTHINGS = ("kneser-ney", "dirichlet")


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

    divergence: str = "rkl"
    lam: float = 1.2
    kl_share: float = 0.15
    order_weights: tuple[float, ...] = (1.0,)
    smoothing: str = "kneser-ney"
    discount: float = 0.75
    ngram_order: int = 4
    kappa: float = 3.0
    alpha: float = 0.5
    lam_decay: float = 0.0
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
