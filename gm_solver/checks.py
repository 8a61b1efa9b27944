"""The argument checks every decoder and solve shares: each raises a one-line error that names the argument and its
value, and the logits' value checks (NaN, ``+inf``, a row with no finite score) run with one host synchronisation."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch


def real(name: str, value: Any, requirement: str, ok: Callable[[float], bool]) -> float:
    """``value`` as a float, or a ValueError that names the argument and its value.

    Example::

        >>> real("lam", 2, "a float >= 0", lambda v: v >= 0)
        2.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(float(value)):
        raise ValueError(f"`{name}` must be {requirement}, got {value!r}")
    return float(value)


def integer(name: str, value: Any, requirement: str, ok: Callable[[int], bool]) -> int:
    """``value`` as an int (never a bool), or a ValueError that names the argument and its value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not ok(int(value)):
        raise ValueError(f"`{name}` must be {requirement}, got {value!r}")
    return int(value)


def choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a ValueError that names the argument and its value."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}")
    return value


def finite_nonnegative(v: float) -> bool:
    return 0.0 <= v < math.inf


def finite_positive(v: float) -> bool:
    return 0.0 < v < math.inf


# what is wrong with logits named {name}: NaN, +inf, a row with no finite score (the kernels report the same)
NAN = "{name} contains NaN; check the model's output (fp16 overflow?) before graphmax"
POSINF = "{name} contains +inf; graphmax needs finite logits or -inf for masked tokens"
ALL_MASKED = "a row of {name} is entirely -inf: no token is allowed, so there is no distribution"


def logit_value_checks(z: torch.Tensor, name: str = "logits") -> dict[str, torch.Tensor]:
    """The checks of the logits' values, message → a one-element boolean tensor that is True when the check passes
    (for :func:`raise_unless`): no NaN, no ``+inf``, and a finite score in every row.

    Example::

        >>> checks = logit_value_checks(torch.tensor([[0.0, float("nan")]]))
        >>> [message for message, ok in checks.items() if not ok]
        ["logits contains NaN; check the model's output (fp16 overflow?) before graphmax"]
    """
    return {NAN.format(name=name): ~torch.isnan(z).any(), POSINF.format(name=name): ~torch.isposinf(z).any(),
            ALL_MASKED.format(name=name): ~torch.isneginf(z).all(dim=-1).any()}


def raise_unless(checks: dict[str, torch.Tensor], sync: bool, error: type[Exception] = ValueError) -> None:
    """Each message whose condition (a boolean tensor of one element) is False: raised as ``error`` after one host
    synchronisation for all of them, or, when ``sync`` is False, asserted on the device (a device-side assert when
    the device gets there, at once on the CPU, as graphmax's check_every=0 does)."""
    if not sync:
        for message, ok in checks.items():
            torch._assert_async(ok, message)
        return
    if not checks:
        return
    passed = torch.stack([ok.reshape(()) for ok in checks.values()]).tolist()
    for message, ok in zip(checks, passed):
        if not ok:
            raise error(message)
