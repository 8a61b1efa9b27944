"""The decoder kinds, one module each (``context``, ``paper``), and the one table they are registered in
(:mod:`gm_solver.decoders.registry`), with the choice a graph stores (:mod:`gm_solver.decoders.choice`).

Nothing here imports torch, so that a command line is read and checked before torch loads; each kind's step (its
logits processor) is imported when a decoder of that kind is first built.

Example::

    >>> from gm_solver.decoders import kinds
    >>> list(kinds())[:2]
    ['context', 'paper']
"""

from . import context, paper
from .registry import DecoderKind, kind, kind_of, kinds, register_decoder, unregister_decoder

for _kind in (context.KIND, paper.KIND):
    register_decoder(_kind)

__all__ = ["DecoderKind", "kind", "kind_of", "kinds", "register_decoder", "unregister_decoder"]
