"""The checks of a decoder's arguments, each raising a one-line error that names the argument and its value, and
:func:`option`, the field a decoder's settings declare (its default, its help, how a command line reads it).

Nothing here imports torch: ``graphmax``'s parser reads the decoders' settings (``gm_solver.decoders``) and checks
a command's arguments before torch and transformers load.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

#: how a command line reads an option's value: a float, an int, comma-separated floats, or one of ``choices``
READERS = ("float", "int", "floats", "str")


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


def option(default: Any, help: str, *, reads: str | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A field of a decoder's settings that is also a command-line option (``graphmax generate --NAME``): its
    default, its help, and how the command line reads it (``reads``: one of :data:`READERS`; ``None``: from the
    default's type). The settings class checks the value, once, whatever it came from.

    Example::

        >>> @dataclasses.dataclass(frozen=True)
        ... class Toy:
        ...     weight: float = option(0.5, "how far to lean")
        >>> [(f.name, f.metadata["reads"]) for f in dataclasses.fields(Toy)]
        [('weight', 'float')]
    """
    if reads is None:
        reads = "str" if choices else "floats" if isinstance(default, tuple) else type(default).__name__
    if reads not in READERS:
        raise ValueError(f"`reads` must be one of {READERS}, got {reads!r}")
    return dataclasses.field(default=default, metadata={"help": help, "reads": reads, "choices": choices})


def options(settings: type) -> list[dataclasses.Field]:
    """The fields of ``settings`` (a dataclass) that are command-line options (declared with :func:`option`)."""
    return [f for f in dataclasses.fields(settings) if "reads" in f.metadata]
