"""The logits' value checks every decoder and solve shares (NaN, ``+inf``, a row with no finite score), run with one
host synchronisation; the checks of a decoder's arguments are in ``gm_solver.arguments``."""

from __future__ import annotations

import torch

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
